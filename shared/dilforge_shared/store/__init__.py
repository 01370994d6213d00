"""Artifact store over a local directory (path or file://) and S3 (s3://, via boto3).

Publishing is atomic for readers: files go to a fresh `data-<uuid>/`, then the manifest is written last,
create-only, so a crash leaves no manifest and of two concurrent publishers exactly one wins. Reading verifies
every file's size and sha256. Submodules: credentials, backends, artifacts, mirror; this one re-exports them."""

from __future__ import annotations

from ..errors import ArtifactExistsError, DilforgeError, IntegrityError, ManifestNotFound
from ..manifest import (
    MANIFEST_NAME,
    FileEntry,
    InputRef,
    Manifest,
    check_relative_path,
    parse_manifest,
    scan_files,
    sha256_bytes,
    sha256_file,
)
from .artifacts import (
    Artifact,
    ArtifactStore,
    artifact_exists,
    artifact_storage,
    fetch,
    manifest_uri_of,
    publish,
    read_manifest,
    verify_files,
)
from .backends import (
    MULTIPART_THRESHOLD,
    LocalStorage,
    NotFound,
    S3Storage,
    Storage,
    join,
    open_backend,
    read_uri_bytes,
    split_uri,
)
from .credentials import S3_ENDPOINT_ENV, S3_KEY_ENV, S3_SECRET_ENV, endpoint_keys, use_endpoint_keys
from .mirror import mirror_prefix

__all__ = [
    "MANIFEST_NAME",
    "MULTIPART_THRESHOLD",
    "S3_ENDPOINT_ENV",
    "S3_KEY_ENV",
    "S3_SECRET_ENV",
    "Artifact",
    "ArtifactExistsError",
    "ArtifactStore",
    "DilforgeError",
    "FileEntry",
    "InputRef",
    "IntegrityError",
    "LocalStorage",
    "Manifest",
    "ManifestNotFound",
    "NotFound",
    "S3Storage",
    "Storage",
    "artifact_exists",
    "artifact_storage",
    "check_relative_path",
    "endpoint_keys",
    "fetch",
    "join",
    "ls_files",
    "manifest_uri_of",
    "mirror_prefix",
    "open_backend",
    "parse_manifest",
    "publish",
    "read_manifest",
    "read_uri_bytes",
    "scan_files",
    "sha256_bytes",
    "sha256_file",
    "split_uri",
    "use_endpoint_keys",
    "verify_files",
]


def ls_files(files: list[FileEntry]) -> str:
    return "\n".join(f"{f.size:>12}  {f.sha256[:12]}  {f.path}" for f in files)
