"""The one resolver: a model/tokenizer/source URI → its lineage (InputRef) and, when needed, a local folder.

Used by the coordinator's planning (`stage_refs`: the artifact id of a stage is the fingerprint of its
config and these refs), by the container contract (which records the very same refs in the manifest,
so `recompute_artifact_id(manifest) == manifest.artifact_id`), by every stage that opens a base model
or tokenizer (`open_model`), and by `coordinator chat`. A URI is a dilforge artifact (lineage: its
manifest's sha256), a local file (its sha256), a local folder (sha256 of every file) or an s3:// prefix
(the ETags of its objects: no download needed to plan). No torch import here: resolving is file work.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from .configs.base import StageConfig
from .configs.model import ModelConfig
from .corpus import data_digest
from .errors import ConfigError, InputError, ManifestNotFound
from .manifest import InputRef, Manifest, fingerprint, legacy_fingerprint, scan_files, sha256_file
from .paths import check_links
from .recipes import RECIPES, cache_root, source_kind
from .stages import STAGE_VERSIONS
from .store import NotFound, S3Storage, fetch, mirror_prefix, read_manifest

ADAPTER_DIR, MERGED_DIR = "adapter", "merged"
MODEL_SUBDIRS = ("model", "hf", "merged")


def model_ref_name(uri: str) -> str:
    """The lineage name of a model or tokenizer read from a URI in a stage's config."""
    return f"model:{uri}"


def _local(uri: str) -> Path:
    return Path(uri.removeprefix("file://")).expanduser()


def source_ref(uri: str, name: str, endpoint_url: str | None = None) -> InputRef:
    """Lineage of whatever a model/tokenizer URI holds, computed without downloading any weights."""
    if urlparse(uri).scheme != "s3" and _local(uri).is_file():
        return InputRef(name=name, kind="data", uri=uri, sha256=sha256_file(_local(uri)))
    try:
        return InputRef(name=name, kind="manifest", uri=uri, sha256=read_manifest(uri, endpoint_url)[1])
    except ManifestNotFound:
        pass
    return InputRef(name=name, kind="data", uri=uri, sha256=model_digest(uri, endpoint_url))


def model_stage_ref(config: ModelConfig, endpoint_url: str | None = None) -> InputRef:
    """Identity of a model stage's source: a recipe's pinned sha256 (nothing downloaded), else its content."""
    kind = source_kind(config.source)
    if kind == "recipe":
        recipe = RECIPES[config.source]
        return InputRef(name="source", kind="data", uri=recipe.uri, sha256=recipe.sha256)
    if kind == "gguf" and not _local(config.source).is_file():
        raise InputError("model.source: no such GGUF file", path=config.source)
    return source_ref(config.source, "source", endpoint_url)


def config_refs(config: StageConfig, endpoint_url: str | None = None) -> list[InputRef]:
    """Everything a stage reads besides upstream artifacts: data sources, models/tokenizers by URI, a model source."""
    refs = [InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=data_digest(s.uri, endpoint_url))
            for s in config.data_sources()]
    refs += [source_ref(uri, model_ref_name(uri), endpoint_url) for uri in config.model_uris()]
    if isinstance(config, ModelConfig):
        refs.append(model_stage_ref(config, endpoint_url))
    return refs


def upstream_refs(inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """Upstream artifacts by the sha256 of their manifest bytes."""
    return [InputRef(name=name, kind="manifest", uri=uri, sha256=read_manifest(uri, endpoint_url)[1])
            for name, uri in sorted(inputs.items())]


def stage_refs(config: StageConfig, inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """What a stage's artifact id covers, in the form its manifest records them."""
    return [*upstream_refs(inputs, endpoint_url), *config_refs(config, endpoint_url)]


def artifact_id(config: StageConfig, refs: list[InputRef], code_version: int | None = None) -> str:
    """The id of the artifact `config` produces from inputs `refs` with this (or the given) code version."""
    version = STAGE_VERSIONS[config.stage] if code_version is None else code_version
    return fingerprint(config.stage, config.identity(), refs, version)


def recompute_artifact_id(manifest: Manifest) -> str:
    """The artifact id from a published manifest alone: stage, code version, recorded config and inputs.

    The recorded config is validated again by its stage's config class to drop its run-only fields; a config
    the class refuses is a ConfigError naming the manifest's stage."""
    if manifest.code_version is None:
        return legacy_fingerprint(manifest.stage, manifest.config, manifest.inputs)
    from .configs.pipeline import STAGE_CONFIGS, validate_model
    config = validate_model(STAGE_CONFIGS[manifest.stage], manifest.config, f"manifest config of stage {manifest.stage}")
    return artifact_id(config, manifest.inputs, manifest.code_version)


@dataclass
class ModelSource:
    """A local folder holding an artifact's or model's files, and how lineage names it."""
    path: Path
    uri: str
    name: str
    manifest: Manifest | None = None
    manifest_sha256: str | None = None
    endpoint_url: str | None = None

    @cached_property
    def ref(self) -> InputRef:
        """The same ref the coordinator fingerprints (computed only when asked: a folder digest reads every file)."""
        if self.manifest_sha256 is not None:
            return InputRef(name=self.name, kind="manifest", uri=self.uri, sha256=self.manifest_sha256)
        return source_ref(self.uri, self.name, self.endpoint_url)


def find_hf_dir(root: Path, source: str) -> Path:
    """The folder with config.json: root itself, a conventional subfolder, or the only subfolder that has one."""
    if (root / "config.json").is_file():
        return root
    for name in MODEL_SUBDIRS:
        if (root / name / "config.json").is_file():
            return root / name
    found = sorted(p.parent for p in root.glob("*/config.json"))
    if len(found) == 1:
        return found[0]
    raise ConfigError(f"{source}: no HF model folder (config.json) in it" if not found else
                      f"{source}: several model folders {[p.name for p in found]}; point at one")


def dir_digest(root: Path) -> str:
    """sha256 over every file's path and sha256: lineage for a model that is not an artifact."""
    check_links(root, str(root))  # a link out of the folder would fingerprint (and publish) a file never pointed at
    h = hashlib.sha256()
    for entry in scan_files(root):
        h.update(f"{entry.path}:{entry.sha256}\n".encode())
    return h.hexdigest()


def model_digest(uri: str, endpoint_url: str | None = None) -> str:
    """Content digest of a model folder without downloading it: file sha256s locally, ETags on S3."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        path = _local(uri)
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder")
        return dir_digest(path)
    backend = S3Storage(parsed.netloc, parsed.path, endpoint_url)
    h = hashlib.sha256()
    keys = sorted(backend.list(""))
    if not keys:
        raise ConfigError(f"{uri}: no objects under this prefix")
    for key in keys:
        head = backend.client.head_object(Bucket=parsed.netloc, Key=backend._key(key))
        h.update(f"{key}:{head['ETag']}\n".encode())
    return h.hexdigest()


def _download_prefix(uri: str, endpoint_url: str | None, cache_dir: Path | None = None) -> Path:
    cache = cache_dir or cache_root() / "models"
    try:
        return mirror_prefix(uri, cache / hashlib.sha256(uri.encode()).hexdigest()[:16], endpoint_url)
    except NotFound:
        raise ConfigError(f"{uri}: no objects under this prefix") from None


def open_model(uri: str, name: str | None = None, endpoint_url: str | None = None,
               cache_dir: Path | None = None) -> ModelSource:
    """A dilforge artifact (verified) or a plain HF folder / s3:// prefix, as a local folder plus its lineage.

    `name` defaults to the name `config_refs` gives a URI from a stage config, so a stage that records
    `.ref` records what the coordinator fingerprinted.
    """
    name = name or model_ref_name(uri)
    try:
        art = fetch(uri, cache_dir=cache_dir, endpoint_url=endpoint_url)
        return ModelSource(path=art.path, uri=art.uri, name=name, manifest=art.manifest,
                           manifest_sha256=art.manifest_sha256, endpoint_url=endpoint_url)
    except (ManifestNotFound, NotFound):
        pass
    if urlparse(uri).scheme == "s3":
        path = _download_prefix(uri, endpoint_url, cache_dir)
    else:
        path = _local(uri)
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder or artifact")
    return ModelSource(path=path, uri=uri, name=name, endpoint_url=endpoint_url)


@dataclass
class ChatModel:
    """What to load for inference: base weights, an optional adapter on top, and the tokenizer to use."""
    base_dir: Path
    adapter_dir: Path | None
    tokenizer_dir: Path
    description: str


def resolve_chat_model(uri: str, base: str | None = None, endpoint_url: str | None = None,
                       prefer_merged: bool = False) -> ChatModel:
    """Any model or adapter artifact (or HF folder) → base + adapter folders.

    For an SFT adapter artifact the base model comes from its manifest's lineage (the 'cpt' input, a
    'model' input, or the config's base_model), unless `base` overrides it.
    """
    src = open_model(uri, "model", endpoint_url)
    adapter = src.path / ADAPTER_DIR if (src.path / ADAPTER_DIR / "adapter_config.json").is_file() else (
        src.path if (src.path / "adapter_config.json").is_file() else None)
    if adapter is None:
        hf = find_hf_dir(src.path, uri)
        return ChatModel(base_dir=hf, adapter_dir=None, tokenizer_dir=hf, description=f"model {uri}")
    if prefer_merged and (src.path / MERGED_DIR / "config.json").is_file():
        merged = src.path / MERGED_DIR
        return ChatModel(base_dir=merged, adapter_dir=None, tokenizer_dir=merged, description=f"merged model of {uri}")
    if base is None:
        refs = {r.name: r for r in (src.manifest.inputs if src.manifest else [])}
        ref = refs.get("cpt") or refs.get("base_model") or refs.get("model")
        recorded = (src.manifest.config.get("base_model") if src.manifest else None)
        if ref is None and recorded:
            ref = refs.get(model_ref_name(recorded))
        if ref is None:
            cfg = json.loads((adapter / "adapter_config.json").read_text())
            raise ConfigError(f"{uri}: an adapter without a recorded base model; pass --base (adapter_config names "
                              f"{cfg.get('base_model_name_or_path')!r})")
        base = ref.uri
    base_src = open_model(base, "base_model", endpoint_url)
    return ChatModel(base_dir=find_hf_dir(base_src.path, base), adapter_dir=adapter, tokenizer_dir=adapter,
                     description=f"adapter {uri} on base {base}")
