"""Paths built from untrusted text (manifests, records, configs, archives) stay inside their root: names by pattern
(`check_name`), relative paths by `confined`, input folders by `check_links`. What of a folder or S3 prefix is its
content, never a dilforge store or work folder kept in it: `holds_dilforge_data`, `content_keys`."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from .errors import UnsafePathError

# Artifact ids, run ids, stage and input names: one path component, no leading dot, nothing a shell or a URI
# would read specially. Fingerprints (16 hex digits) and every run id the pipeline config accepts match.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# A local input uploaded for `--backend sagemaker-local`: s3://<bucket>/data/<16 hex of its content>/<its absolute
# path>, its sha256 as metadata. Identity reads it as that local path (`declared_uri`), so the copy gets the local id.
UPLOADED_COPY = re.compile(r"^s3://[a-z0-9][a-z0-9.-]*/data/[0-9a-f]{16}(/.+)$")


STORE_FILES = (".dilforge-store", ".dilforge-work", "manifest.json")


def holds_dilforge_data(folder: Path) -> bool:
    """A dilforge store, artifact or stage work folder (it holds one of STORE_FILES): never content of a corpus or
    model folder it sits in (a store kept inside a corpus folder would feed each run its own earlier output)."""
    return any((folder / f).exists() for f in STORE_FILES)


def content_keys(keys: Iterable[str], prefix: str) -> list[str]:
    """The keys under an S3 `prefix` that are its content, by the folders' rule: none hidden at any level below the
    prefix, none under a sub-prefix holding one of STORE_FILES (a store, artifact or work folder kept there)."""
    keys = list(keys)
    start = len(prefix) + 1 if prefix else 0
    stores = {k.rsplit("/", 1)[0] + "/" for k in keys if "/" in k[start:] and k.rsplit("/", 1)[-1] in STORE_FILES}
    return [
        k
        for k in keys
        if not any(part.startswith(".") for part in k[start:].split("/")) and not any(k.startswith(s) for s in stores)
    ]


def local_path(uri: str) -> Path:
    """A local URI (a path or file://) as a Path."""
    return Path(uri.removeprefix("file://")).expanduser()


def declared_uri(uri: str) -> str:
    """The URI a config declared: the local path for an uploaded copy (UPLOADED_COPY), else `uri` itself."""
    match = UPLOADED_COPY.match(uri)
    return match.group(1) if match else uri


def check_relative_path(path: str) -> str:
    """Reject absolute paths, `..`, backslashes and empty parts: a file name may not escape its artifact."""
    if not path or "\\" in path or any(part in ("..", "", ".") for part in path.split("/")):  # "" for "/x", "a//b"
        raise UnsafePathError(f"unsafe file path {path!r}: must be relative, without '..' or empty parts")
    return path


def check_name(value: str, what: str) -> str:
    """`value` as one safe path component (an id or a name), else UnsafePathError naming `what`."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise UnsafePathError(
            f"{what} {value!r} is not a valid name: use letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit, no '..')"
        )
    return value


def confined(root: Path, rel: str, what: str = "path") -> Path:
    """`root / rel`, refused unless `rel` is a clean relative path that also resolves (links followed) inside root."""
    check_relative_path(rel)
    path = root / rel
    real_root = root.resolve()
    if not path.resolve().is_relative_to(real_root):
        raise UnsafePathError(f"{what} {rel!r} resolves to {path.resolve()}, outside {real_root}")
    return path


def check_links(folder: Path, source: str) -> None:
    """Refuse a folder read as input if any symlink in it points outside it (it would publish, or fingerprint,
    files the user never pointed at); links inside it are fine."""
    real = folder.resolve()
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(real):
                    raise UnsafePathError(
                        f"{source}: {path.relative_to(folder)} is a link to {target}, outside the "
                        "folder; copy the file in instead of linking it"
                    )
