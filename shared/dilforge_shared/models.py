"""Find the HF model behind a URI: a dilforge artifact, a plain HF folder, or an s3:// prefix of one.

Shared by the stages (their base models) and `coordinator chat` (any model or adapter artifact). No
torch import here: resolving is file work.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from .errors import ConfigError, ManifestNotFound
from .manifest import InputRef, Manifest, scan_files, sha256_file
from .store import NotFound, S3Backend, fetch, mirror_prefix, read_manifest

ADAPTER_DIR, MERGED_DIR = "adapter", "merged"
MODEL_SUBDIRS = ("model", "hf", "merged")


@dataclass
class ModelSource:
    """A local folder holding an artifact's or model's files, and how lineage names it."""
    path: Path
    uri: str
    name: str
    manifest: Manifest | None = None
    manifest_sha256: str | None = None

    @cached_property
    def ref(self) -> InputRef:
        """Lineage: the manifest digest of an artifact, else a digest of every file (computed only when asked)."""
        if self.manifest_sha256 is not None:
            return InputRef(name=self.name, kind="manifest", uri=self.uri, sha256=self.manifest_sha256)
        return InputRef(name=self.name, kind="data", uri=self.uri, sha256=dir_digest(self.path))


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
    h = hashlib.sha256()
    for entry in scan_files(root):
        h.update(f"{entry.path}:{entry.sha256}\n".encode())
    return h.hexdigest()


def model_digest(uri: str, endpoint_url: str | None = None) -> str:
    """Content digest of a model folder without downloading it: file sha256s locally, ETags on S3."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        path = Path(uri.removeprefix("file://")).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder")
        return dir_digest(path)
    backend = S3Backend(parsed.netloc, parsed.path, endpoint_url)
    h = hashlib.sha256()
    for key in sorted(backend.list("")):
        head = backend.client.head_object(Bucket=parsed.netloc, Key=backend._key(key))
        h.update(f"{key}:{head['ETag']}\n".encode())
    return h.hexdigest()


def source_digest(uri: str, endpoint_url: str | None = None) -> str:
    """Digest of whatever a model/tokenizer URI holds: an artifact's manifest, a single file, or a folder."""
    try:
        return read_manifest(uri, endpoint_url)[1]
    except ManifestNotFound:
        pass
    path = Path(uri.removeprefix("file://")).expanduser()
    if urlparse(uri).scheme != "s3" and path.is_file():
        return sha256_file(path)
    return model_digest(uri, endpoint_url)


def _download_prefix(uri: str, endpoint_url: str | None, cache_dir: Path | None = None) -> Path:
    cache = cache_dir or Path(os.environ.get("DILFORGE_CACHE", tempfile.gettempdir())) / "dilforge-models"
    try:
        return mirror_prefix(uri, cache / hashlib.sha256(uri.encode()).hexdigest()[:16], endpoint_url)
    except NotFound:
        raise ConfigError(f"{uri}: no objects under this prefix") from None


def open_model(uri: str, name: str, endpoint_url: str | None = None, cache_dir: Path | None = None) -> ModelSource:
    """A dilforge artifact (verified, lineage by manifest digest) or a plain HF folder (lineage by file digests)."""
    try:
        art = fetch(uri, cache_dir=cache_dir, endpoint_url=endpoint_url)
        return ModelSource(path=art.path, uri=art.uri, name=name, manifest=art.manifest,
                           manifest_sha256=art.manifest_sha256)
    except (ManifestNotFound, NotFound):
        pass
    if urlparse(uri).scheme == "s3":
        path = _download_prefix(uri, endpoint_url, cache_dir)
    else:
        path = Path(uri.removeprefix("file://")).expanduser()
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder or artifact")
    return ModelSource(path=path, uri=uri, name=name)


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

    For an SFT adapter artifact the base model comes from its manifest's lineage (the 'cpt' input or
    the 'base_model' input), unless `base` overrides it.
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
        ref = refs.get("cpt") or refs.get("base_model")
        if ref is None:
            cfg = json.loads((adapter / "adapter_config.json").read_text())
            raise ConfigError(f"{uri}: an adapter without a recorded base model; pass --base (adapter_config names "
                              f"{cfg.get('base_model_name_or_path')!r})")
        base = ref.uri
    base_src = open_model(base, "base_model", endpoint_url)
    return ChatModel(base_dir=find_hf_dir(base_src.path, base), adapter_dir=adapter, tokenizer_dir=adapter,
                     description=f"adapter {uri} on base {base}")
