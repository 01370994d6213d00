"""Paths built from untrusted text stay inside their root.

Manifests, run records, configs and archives come from places a user does not fully control (an S3 bucket, a
copied store, a downloaded wheel). Every name in them that becomes part of a path is checked here: ids and
names by pattern (`check_name`), relative paths by `confined`, and folders read as input by `check_links`
(no symlink, file or folder, that resolves outside the folder). What of such a folder or S3 prefix is its content,
never a dilforge store or work folder kept in it, is `holds_dilforge_data` and `content_keys` (corpus and model
folders alike).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from .errors import UnsafePathError

# Artifact ids, run ids, stage and input names: one path component, no leading dot, nothing a shell or a URI
# would read specially. Fingerprints (16 hex digits) and every run id the pipeline config accepts match.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)


# Local inputs a backend uploads for its containers (`--backend sagemaker-local`) sit at
# s3://<bucket>/data/<16 hex of their content>/<the absolute local path as written>, each object carrying its sha256 as
# metadata. Identity reads such a URI as the local path it was uploaded from (`declared_uri`) and its content by
# that sha256, so a stage fed the copy gets the id the local run gets.
UPLOADED_COPY = re.compile(r"^s3://[a-z0-9][a-z0-9.-]*/data/[0-9a-f]{16}(/.+)$")


# A folder below a corpus folder holding one of these is a dilforge store, artifact or stage work folder, never
# read as corpus text: a store or work folder kept inside the corpus folder would otherwise feed each run its own
# earlier output.
STORE_FILES = (".dilforge-store", ".dilforge-work", "manifest.json")


def holds_dilforge_data(folder: Path) -> bool:
    """A dilforge store, artifact or stage work folder (it holds one of STORE_FILES): never content of a corpus or
    model folder it sits in."""
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


def uploaded_copy(bucket_root: str, content_digest: str, location: str) -> str:
    """Where the uploaded copy of the local input at `location` (an absolute path, as the config wrote it) lives."""
    return f"{bucket_root}/data/{content_digest[:16]}{location}"


def declared_uri(uri: str) -> str:
    """The URI a config declared: the local path for an uploaded copy (`uploaded_copy`), else `uri` itself."""
    match = UPLOADED_COPY.match(uri)
    return match.group(1) if match else uri


def check_relative_path(path: str) -> str:
    """Reject absolute paths, `..`, backslashes and empty parts: a file name may not escape its artifact."""
    p = PurePosixPath(path)
    if not path or "\\" in path or p.is_absolute() or any(part in ("..", "", ".") for part in path.split("/")):
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
    """Refuse a folder read as input if any symlink in it (file or folder) points outside it.

    Links inside the folder are fine (HF caches link snapshot files to blobs beside them only when the folder is
    the cache root; a model folder that links out would publish, or fingerprint, files the user never pointed at).
    """
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
