"""The one resolver: a model/tokenizer/adapter URI → a local folder of that kind (an S3 prefix through
`mirror_prefix`, a local copy re-validated against its listing on every use), and the one precedence rule for a
stage's base model (`choose`). Lineage is `identity.source_ref`'s."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from .errors import ConfigError, ManifestNotFound
from .manifest import Manifest
from .settings import cache_root
from .store import Artifact, NotFound, fetch, local_path, open_backend

log = logging.getLogger("dilforge")

ADAPTER_DIR, MERGED_DIR = "adapter", "merged"

Kind = Literal["model", "tokenizer", "adapter"]
MARKERS: dict[str, str] = {"model": "config.json", "tokenizer": "tokenizer.json", "adapter": "adapter_config.json"}
# subfolders tried before any other (in this order) when an artifact holds several folders of a kind
PREFERRED: dict[str, tuple[str, ...]] = {
    "model": (MERGED_DIR, "model", "final", "hf"),
    "tokenizer": ("tokenizer", MERGED_DIR, "model", "final", "hf"),
    "adapter": (ADAPTER_DIR,),
}
# a tokenizer's files in an HF folder: what is downloaded, copied or published as a tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
BASE_INPUTS = ("cpt", "model")  # upstream artifacts that carry a base model, nearest stage first
WHAT = {"model": "HF model folder (config.json + safetensors)", "adapter": "PEFT adapter (adapter_config.json)"}


@dataclass(frozen=True)
class Choice:
    """Where a stage's base model/tokenizer comes from: a config field's URI, or an upstream input by name."""

    uri: str
    input: str | None  # the upstream input's name, or None when the config field gave the URI
    field: str  # the config field, for messages


def choose(
    field: str, value: str | None, inputs: Mapping[str, str], order: Iterable[str] = BASE_INPUTS
) -> Choice | None:
    """The precedence rule for every stage, chat and serve: the config field (`base_model`, `base_tokenizer`) when
    set, else the nearest upstream artifact that carries a base model (`cpt` before `model`), else None (a run given
    both uses the field and logs the input it ignores)."""
    present = [name for name in order if name in inputs]
    if value:
        if present:
            log.warning("%s=%s wins over the upstream %r artifact (config field first)", field, value, present[0])
        return Choice(uri=value, input=None, field=field)
    if present:
        return Choice(uri=inputs[present[0]], input=present[0], field=field)
    return None


def _has_weights(folder: Path) -> bool:
    return any(f.name.endswith(WEIGHT_SUFFIXES) and "adapter" not in f.name for f in folder.iterdir())


def find_dir(root: Path, kind: Kind, source: str, required: bool = True) -> Path | None:
    """The folder of `kind` under root (its marker file: config.json + weights, tokenizer.json,
    adapter_config.json): root itself, else the preferred subfolders (PREFERRED, in order), else the
    shallowest one (3 levels deep at most); two equally good candidates are an error naming both."""
    folders, frontier = [root], [root]
    for _ in range(3):
        frontier = [c for d in frontier for c in sorted(d.iterdir()) if c.is_dir() and not c.name.startswith(".")]
        folders += frontier
    hits = [d for d in folders if (d / MARKERS[kind]).is_file() and (kind != "model" or _has_weights(d))]
    if not hits:
        if not required:
            return None
        raise ConfigError(f"{source}: no {WHAT.get(kind, MARKERS[kind])} in it")

    def rank(d: Path) -> tuple[int, int, int]:
        rel = d.relative_to(root).parts
        pref = min((PREFERRED[kind].index(p) for p in rel if p in PREFERRED[kind]), default=len(PREFERRED[kind]))
        return (len(rel) > 0, pref, len(rel))

    best = min(rank(d) for d in hits)
    tied = [d for d in hits if rank(d) == best]
    if len(tied) > 1:
        raise ConfigError(f"{source}: several {kind} folders {[str(d.relative_to(root)) for d in tied]}; point at one")
    return tied[0]


@dataclass
class Resolved:
    """A local folder (or tokenizer file), the URI it came from and, for an artifact, its manifest."""

    path: Path
    uri: str
    manifest: Manifest | None = None


def mirror_prefix(uri: str, dest: Path, endpoint_url: str | None = None, only: Collection[str] | None = None) -> Path:
    """Make `dest` a copy of the objects under an S3 (or local) prefix (`only`: just these top-level names),
    re-validated on every use against the listing `.complete` recorded (sizes and ETags or mtimes): changed weights
    under the same URI get a fresh copy, downloaded beside `dest` and swapped in (a crash leaves no half copy)."""
    backend = open_backend(uri, endpoint_url)
    listing = {  # key -> [size, version]: ETags on S3, mtimes locally
        k: [size, tag] for k, size, tag in backend.list_stats("") if not k.endswith("/") and (only is None or k in only)
    }
    if not listing:
        raise NotFound(f"{uri}: no objects under this prefix" + (f" named {sorted(only)}" if only else ""))
    marker = dest / ".complete"
    if marker.exists():
        try:
            recorded = json.loads(marker.read_text())
        except (OSError, ValueError):
            recorded = None
        sizes_ok = all((dest / k).is_file() and (dest / k).stat().st_size == size for k, (size, _) in listing.items())
        if recorded == listing and sizes_ok:
            return dest
        why = "out of date (the source changed)" if recorded != listing else "damaged"
        log.warning("%s: the copy at %s is %s; downloading again", uri, dest, why)
    partial = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        for key in listing:
            backend.download_file(key, partial / key)
        (partial / ".complete").write_text(json.dumps(listing, sort_keys=True))
        old = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.old")
        if dest.exists():
            os.rename(dest, old)
        os.rename(partial, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def open_model(
    uri: str | Artifact,
    endpoint_url: str | None = None,
    cache_dir: Path | None = None,
    only: Iterable[str] | None = None,
) -> Resolved:
    """A dilforge artifact (verified; or an already fetched `Artifact`) or a plain HF folder / s3:// prefix,
    as a local folder. `only`: of a plain s3:// prefix, download just these top-level files."""
    if isinstance(uri, Artifact):
        return Resolved(uri.path, uri.uri, uri.manifest)
    try:
        art = fetch(uri, cache_dir=cache_dir, endpoint_url=endpoint_url)
        return Resolved(art.path, art.uri, art.manifest)
    except (ManifestNotFound, NotFound):
        pass
    if urlparse(uri).scheme == "s3":
        key = hashlib.sha256((f"{uri}|{sorted(only)}" if only else uri).encode()).hexdigest()[:16]
        try:
            path = mirror_prefix(uri, (cache_dir or cache_root() / "models") / key, endpoint_url, only)
        except NotFound as exc:
            raise ConfigError(str(exc)) from None
    else:
        path = local_path(uri)
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder or artifact")
    return Resolved(path, uri)


def resolve(
    source: str | Artifact, kind: Kind, endpoint_url: str | None = None, cache_dir: Path | None = None
) -> Resolved:
    """The folder of a model, tokenizer or adapter in `source` (a verified artifact, an HF folder, an s3:// prefix, a
    tokenizer .json file, or a fetched `Artifact`), found by `find_dir` (a tokenizer never downloads the weights
    beside it); ConfigError naming the URI."""
    plain = isinstance(source, str) and urlparse(source).scheme != "s3"
    if kind == "tokenizer" and plain and (file := local_path(source)).is_file() and file.suffix == ".json":
        return Resolved(file, source)
    src = open_model(source, endpoint_url, cache_dir, only=TOKENIZER_FILES if kind == "tokenizer" else None)
    return Resolved(find_dir(src.path, kind, src.uri), src.uri, src.manifest)
