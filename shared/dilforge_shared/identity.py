"""What identifies a stage's inputs, and so its artifact: lineage refs and artifact ids.

Planning and the container contract compute the same refs, so `recompute_artifact_id(manifest) ==
manifest.artifact_id`. A model URI is identified by its manifest (an artifact), its sha256 (a file), every
file's sha256 (a folder) or its objects' ETags (an s3:// prefix, nothing downloaded)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import urlparse

from . import stages
from .configs.base import StageConfig
from .configs.model import ModelConfig
from .corpus_files import data_digest
from .errors import ConfigError, InputError, ManifestNotFound
from .manifest import InputRef, artifact_ref, fingerprint, scan_files, sha256_file
from .paths import check_links, declared_uri
from .recipes import RECIPES, source_kind
from .store.artifacts import read_manifest
from .store.backends import S3Storage


def model_ref_name(uri: str) -> str:
    """The lineage name of a model or tokenizer read from a URI in a stage's config."""
    return f"model:{uri}"


def local_path(uri: str) -> Path:
    """A local URI (a path or file://) as a Path."""
    return Path(uri.removeprefix("file://")).expanduser()


def source_ref(uri: str, name: str, endpoint_url: str | None = None) -> InputRef:
    """Lineage of whatever a model/tokenizer URI holds, computed without downloading any weights."""
    if urlparse(uri).scheme != "s3" and local_path(uri).is_file():
        return InputRef(name=name, kind="data", uri=uri, sha256=sha256_file(local_path(uri)))
    try:
        return artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0])
    except ManifestNotFound:
        pass
    return InputRef(name=name, kind="data", uri=uri, sha256=model_digest(uri, endpoint_url))


def model_stage_ref(config: ModelConfig, endpoint_url: str | None = None) -> InputRef:
    """Identity of a model stage's source: a recipe's pinned sha256 (nothing downloaded), else its content."""
    kind = source_kind(config.source)
    if kind == "recipe":
        recipe = RECIPES[config.source]
        return InputRef(name="source", kind="data", uri=recipe.uri, sha256=recipe.sha256)
    if kind == "gguf" and not local_path(config.source).is_file():
        raise InputError("model.source: no such GGUF file", path=config.source)
    return source_ref(config.source, "source", endpoint_url)


def config_refs(config: StageConfig, endpoint_url: str | None = None) -> list[InputRef]:
    """Everything a stage reads besides upstream artifacts: data sources, models/tokenizers by URI, a model source."""
    refs = [
        InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=data_digest(s.uri, endpoint_url))
        for s in config.file_sources()
    ]
    refs += [source_ref(uri, model_ref_name(uri), endpoint_url) for uri in config.model_uris()]
    if isinstance(config, ModelConfig):
        refs.append(model_stage_ref(config, endpoint_url))
    return refs


def upstream_refs(inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """Upstream artifacts by their artifact ids (`manifest.artifact_ref`)."""
    return [artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0]) for name, uri in sorted(inputs.items())]


def stage_refs(config: StageConfig, inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """What a stage's artifact id covers, in the form its manifest records them."""
    return [*upstream_refs(inputs, endpoint_url), *config_refs(config, endpoint_url)]


def artifact_id(config: StageConfig, refs: list[InputRef], code_version: str | None = None) -> str:
    """The id of the artifact `config` produces from inputs `refs` with this code (or the given code version)."""
    version = stages.code_version(config.stage) if code_version is None else code_version
    return fingerprint(config.stage, config.identity(), refs, version)


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
        path = local_path(uri)
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder")
        return dir_digest(path)
    backend = S3Storage(parsed.netloc, parsed.path, endpoint_url)
    h = hashlib.sha256()
    stats = sorted(backend.list_stats(""))  # (key, size, ETag): one listing, no request per object
    if not stats:
        raise ConfigError(f"{uri}: no objects under this prefix")
    copy = declared_uri(uri) != uri  # an uploaded copy: each object's sha256, as dir_digest hashes the folder
    for key, _, etag in stats:
        sha256 = backend.metadata(key).get("sha256") if copy else None
        h.update(f"{key}:{sha256 or etag}\n".encode())
    return h.hexdigest()
