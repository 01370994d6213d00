"""Local copies of S3 (or local) prefixes, re-validated against the source listing on every use."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path

from .backends import NotFound, S3Storage, Storage, open_backend

log = logging.getLogger("dilforge_shared.store")


def _listing(backend: Storage, only: Collection[str] | None) -> dict[str, list]:
    """key → [size, version] for what a mirror copies: ETags on S3, size + mtime locally."""
    if isinstance(backend, S3Storage):
        items = ((k, size, etag) for k, size, etag in backend.list_stats(""))
    else:
        items = ((k, *backend.stat(k)) for k in backend.list(""))
    return {k: [size, tag] for k, size, tag in items if not k.endswith("/") and (only is None or k in only)}


def mirror_prefix(uri: str, dest: Path, endpoint_url: str | None = None, only: Collection[str] | None = None) -> Path:
    """Make `dest` a copy of the objects under an S3 (or local) prefix, re-validated against the source on every use.

    The listing (keys, sizes, ETags on S3; sizes and mtimes locally) is read each time and compared with the one
    `.complete` recorded when the copy was made: changed weights under the same URI get a fresh copy instead of
    the stale one. A new copy is downloaded beside `dest` and swapped in, so a crash never leaves a half copy.
    `only`: top-level names to copy (e.g. a tokenizer's files from a model prefix that also holds weights).
    """
    backend = open_backend(uri, endpoint_url)
    listing = _listing(backend, only)
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
        log.warning(
            "%s: the copy at %s is %s; downloading again",
            uri,
            dest,
            "out of date (the source changed)" if recorded != listing else "damaged",
        )
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
