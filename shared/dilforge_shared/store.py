"""Artifact store over a local directory (plain path or file://) and S3 (s3://, via boto3).

Publishing is atomic for readers: files go to a fresh `data-<uuid>/` folder, then the manifest is
written last with a create-only conditional write. So a crash leaves no manifest, an existing
manifest is never overwritten, and of two concurrent publishers of the same artifact exactly one
wins while the other's files are removed. Reading verifies the size and sha256 of every file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from .errors import ArtifactExistsError, DilforgeError, IntegrityError, ManifestNotFound
from .manifest import (
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
from .settings import settings

log = logging.getLogger(__name__)

S3_ENDPOINT_ENV = "DILFORGE_S3_ENDPOINT_URL"
# Credentials for an S3-compatible store only (SeaweedFS, MinIO). Unset = boto3's usual chain (AWS).
S3_KEY_ENV, S3_SECRET_ENV = "DILFORGE_S3_ACCESS_KEY_ID", "DILFORGE_S3_SECRET_ACCESS_KEY"

# Keys for an S3-compatible endpoint this process itself provides (the compose backend's local-only
# SeaweedFS identity), by endpoint URL: used only by clients of that endpoint, and only while the
# DILFORGE_S3_* keys are unset. This replaces writing them into os.environ at run time.
_ENDPOINT_KEYS: dict[str, tuple[str, str, str]] = {}


def use_endpoint_keys(endpoint_url: str, access_key_id: str, secret_access_key: str,
                      region: str = "us-east-1") -> None:
    """Give this process's S3 clients of `endpoint_url` these keys (unless DILFORGE_S3_* keys are set)."""
    _ENDPOINT_KEYS[endpoint_url.rstrip("/")] = (access_key_id, secret_access_key, region)


def endpoint_keys(endpoint_url: str | None) -> dict[str, str]:
    """boto3 client keyword arguments for `endpoint_url`: the DILFORGE_S3_* keys, else registered ones."""
    cfg = settings()
    if cfg.s3_access_key_id and cfg.s3_secret_access_key:
        return {"aws_access_key_id": cfg.s3_access_key_id.get_secret_value(),
                "aws_secret_access_key": cfg.s3_secret_access_key.get_secret_value()}
    if endpoint_url and (registered := _ENDPOINT_KEYS.get(endpoint_url.rstrip("/"))):
        key, secret, region = registered
        return {"aws_access_key_id": key, "aws_secret_access_key": secret, "region_name": region}
    return {}
MULTIPART_THRESHOLD = 64 << 20  # bytes; larger files go up in parts of this size


class NotFound(DilforgeError):
    """A key or object that does not exist."""


class Storage(Protocol):
    """Where artifact bytes live: a folder (LocalStorage) or an S3 bucket prefix (S3Storage). Named Storage, not
    Backend, because the coordinator's backends (local, compose, sagemaker) are where stages *run*."""
    uri: str

    def exists(self, key: str) -> bool: ...
    def read_bytes(self, key: str) -> bytes: ...
    def write_bytes(self, key: str, data: bytes) -> None: ...
    def create_bytes(self, key: str, data: bytes) -> bool: ...
    def upload_file(self, key: str, path: Path) -> None: ...
    def download_file(self, key: str, path: Path) -> None: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def local_path(self, key: str) -> Path | None: ...


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class LocalStorage:
    """Artifact bytes in a local folder; create-only writes with os.link."""

    def __init__(self, root: Path):
        self.root = root.expanduser().resolve()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        if key:
            check_relative_path(key)
        return self.root / key

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{self.uri}/{key}: no such file") from None

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"{self.uri}/{key}: no such file") from None

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Create-only write: link a complete temp file into place; False if the key exists."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def upload_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dest)

    def download_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.exists():
            raise NotFound(f"{self.uri}/{key}: no such file")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.name.endswith(".tmp"):
                yield p.relative_to(self.root).as_posix()

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def copy(self, key: str, dest: str) -> None:
        self.upload_file(dest, self._path(key))

    def stat(self, key: str) -> tuple[int, str]:
        """(size, a version tag): size and mtime in ns locally, the ETag on S3."""
        st = self._path(key).stat()
        return st.st_size, f"mtime:{st.st_mtime_ns}"


class S3Storage:
    """boto3 with adaptive retries (exponential backoff) and multipart transfers above 64 MiB."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None, client=None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        cfg = settings()
        endpoint_url = endpoint_url or cfg.s3_endpoint_url or None
        keys = endpoint_keys(endpoint_url)
        # Bounded: a frozen endpoint fails after max_attempts × (connect + read timeout), not 8 × 60 s.
        self.client = client or boto3.client(
            "s3", endpoint_url=endpoint_url, **keys,
            config=Config(retries={"total_max_attempts": cfg.s3_max_attempts, "mode": "standard"},
                          connect_timeout=cfg.s3_connect_timeout, read_timeout=cfg.s3_read_timeout,
                          s3={"addressing_style": "path"}),
        )
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD,
                                       max_concurrency=8)

    def _key(self, key: str) -> str:
        if key:
            check_relative_path(key)
        return join(self.prefix, key)

    def local_path(self, key: str) -> Path | None:
        return None

    def _missing(self, exc) -> bool:
        code = exc.response.get("Error", {}).get("Code", "")
        return code in ("404", "NoSuchKey", "NotFound")

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if self._missing(exc):
                return False
            raise

    def size(self, key: str) -> int:
        from botocore.exceptions import ClientError
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except ClientError as exc:
            if self._missing(exc):
                raise NotFound(f"s3://{self.bucket}/{self._key(key)}: no such object") from None
            raise

    def read_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as exc:
            if self._missing(exc):
                raise NotFound(f"s3://{self.bucket}/{self._key(key)}: no such object") from None
            raise

    def write_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """PutObject with If-None-Match: * (S3 conditional write); False on 412 / conflict."""
        from botocore.exceptions import ClientError
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise

    def upload_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer)

    def download_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import ClientError
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, self._key(key), str(path), Config=self.transfer)
        except ClientError as exc:
            if self._missing(exc):
                raise NotFound(f"s3://{self.bucket}/{self._key(key)}: no such object") from None
            raise

    def list(self, prefix: str) -> Iterator[str]:
        full = self._key(prefix)
        full = full + "/" if full else ""
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:]

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def copy(self, key: str, dest: str) -> None:
        self.client.copy({"Bucket": self.bucket, "Key": self._key(key)}, self.bucket, self._key(dest),
                         Config=self.transfer)

    def list_stats(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """(key, size, ETag) of every object under prefix, from the listing (no HEAD per object)."""
        full = self._key(prefix)
        full = full + "/" if full else ""
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:], obj["Size"], obj["ETag"]

    def delete_prefix(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            )


def open_backend(uri: str, endpoint_url: str | None = None) -> Storage:
    """`s3://bucket/prefix`, `file:///path` or a plain path."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise DilforgeError(f"{uri}: an s3:// URI needs a bucket")
        return S3Storage(parsed.netloc, parsed.path, endpoint_url)
    if parsed.scheme == "file":
        return LocalStorage(Path(parsed.path))
    if parsed.scheme in ("", ) or (len(parsed.scheme) == 1 and os.name == "nt"):
        return LocalStorage(Path(uri))
    raise DilforgeError(f"{uri}: unsupported URI scheme {parsed.scheme!r}; use a path, file:// or s3://")


def split_uri(uri: str, endpoint_url: str | None = None) -> tuple[Storage, str]:
    """Split an object URI into (backend rooted at its parent, file name)."""
    uri = uri.rstrip("/")
    parent, _, name = uri.rpartition("/")
    if not parent or parent in ("s3:", "file:"):
        parent, name = ".", uri
    return open_backend(parent, endpoint_url), name


def read_uri_bytes(uri: str, endpoint_url: str | None = None) -> bytes:
    backend, name = split_uri(uri, endpoint_url)
    return backend.read_bytes(name)


def manifest_uri_of(uri: str) -> str:
    """Accept either an artifact folder or its manifest.json."""
    uri = uri.rstrip("/")
    return uri if uri.endswith("/" + MANIFEST_NAME) or uri == MANIFEST_NAME else f"{uri}/{MANIFEST_NAME}"


@dataclass
class Artifact:
    """A manifest read from a store, with the local folder holding its verified files."""
    uri: str
    manifest: Manifest
    manifest_sha256: str
    path: Path

    def ref(self, name: str) -> InputRef:
        return InputRef(name=name, kind="manifest", uri=self.uri, sha256=self.manifest_sha256)


class ArtifactStore:
    """Publish and fetch artifacts under a root URI: `<root>/artifacts/<stage>/<artifact_id>/`."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/")
        self.endpoint_url = endpoint_url
        self.backend = open_backend(self.uri, endpoint_url)

    def artifact_uri(self, stage: str, artifact_id: str) -> str:
        return f"{self.backend.uri}/artifacts/{stage}/{artifact_id}"

    # ---- runs: small mutable records, unlike manifests -------------------------------------
    def write_run_record(self, run_id: str, data: bytes) -> None:
        self.backend.write_bytes(f"runs/{run_id}.json", data)

    def read_run_record(self, run_id: str) -> bytes:
        return self.backend.read_bytes(f"runs/{run_id}.json")


def _artifact_backend(artifact_uri: str, endpoint_url: str | None) -> Storage:
    return open_backend(artifact_uri.rstrip("/"), endpoint_url)


def artifact_exists(artifact_uri: str, endpoint_url: str | None = None) -> bool:
    return _artifact_backend(artifact_uri, endpoint_url).exists(MANIFEST_NAME)


def publish(
    artifact_uri: str,
    local_dir: Path,
    manifest: Manifest,
    endpoint_url: str | None = None,
    progress: bool = False,
) -> Manifest:
    """Upload every file of `local_dir`, then create the manifest. Raises ArtifactExistsError if taken.

    `manifest.files` and `manifest.data_dir` are filled in here from what is actually uploaded.
    """
    backend = _artifact_backend(artifact_uri, endpoint_url)
    manifest_key = MANIFEST_NAME
    if backend.exists(manifest_key):
        raise ArtifactExistsError(f"{artifact_uri}/{MANIFEST_NAME}")
    files = scan_files(local_dir)
    if not files:
        raise DilforgeError(f"{local_dir}: nothing to publish (empty output folder)")
    data_dir = f"data-{uuid.uuid4().hex[:12]}"
    manifest = manifest.model_copy(update={"files": files, "data_dir": data_dir})
    from tqdm import tqdm
    try:
        for entry in tqdm(files, desc=f"publish {artifact_uri}", unit="file", disable=not progress):
            backend.upload_file(f"{data_dir}/{entry.path}", local_dir / entry.path)
        created = backend.create_bytes(manifest_key, manifest.to_json())
    except BaseException:
        backend.delete_prefix(data_dir)
        raise
    if not created:
        backend.delete_prefix(data_dir)
        raise ArtifactExistsError(f"{artifact_uri}/{MANIFEST_NAME}")
    log.info("published %s (%d files)", artifact_uri, len(files))
    return manifest


def read_manifest(uri: str, endpoint_url: str | None = None) -> tuple[Manifest, str]:
    """Return (manifest, sha256 of its bytes) for an artifact folder or manifest URI."""
    muri = manifest_uri_of(uri)
    try:
        data = read_uri_bytes(muri, endpoint_url)
    except NotFound as exc:
        raise ManifestNotFound(f"{muri}: no manifest there ({exc})") from None
    return parse_manifest(data, muri), sha256_bytes(data)


def verify_files(manifest: Manifest, root: Path, source: str, full: bool = True) -> None:
    """Every listed file present, inside `root` (no symlink leaving it), of its size, and (full) of its sha256."""
    real_root = root.resolve()
    for entry in manifest.files:
        path = root / entry.path
        if path.is_symlink() or not path.resolve().is_relative_to(real_root):
            raise IntegrityError(f"{source}: file {entry.path} is a symlink ({path} -> {path.resolve()}); "
                                 "artifact files must be regular files inside the artifact")
        if not path.is_file():
            raise IntegrityError(f"{source}: file {entry.path} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise IntegrityError(f"{source}: file {entry.path} has {size} bytes, manifest says {entry.size}")
        if full and sha256_file(path) != entry.sha256:
            raise IntegrityError(f"{source}: file {entry.path} does not match its sha256 in the manifest")


def fetch(uri: str, cache_dir: Path | None = None, endpoint_url: str | None = None) -> Artifact:
    """Read a manifest and make its files available locally, verified.

    Local stores are verified in place (no copy); remote ones are downloaded to
    `cache_dir/<artifact_id>-<sha>/` (reused across calls when already complete and verified).
    """
    muri = manifest_uri_of(uri)
    artifact_uri = muri[: -len(MANIFEST_NAME) - 1]
    manifest, digest = read_manifest(muri, endpoint_url)
    backend = _artifact_backend(artifact_uri, endpoint_url)
    local = backend.local_path(manifest.data_dir)
    if local is not None:
        verify_files(manifest, local, muri)
    else:
        cache_dir = cache_dir or (settings().cache or Path(tempfile.gettempdir())) / "dilforge-cache"
        local = cache_dir / f"{manifest.artifact_id}-{digest[:12]}"
        marker = local / ".complete"
        if marker.exists():
            try:
                verify_files(manifest, local, muri)
                return Artifact(uri=artifact_uri, manifest=manifest, manifest_sha256=digest, path=local)
            except IntegrityError:
                log.warning("%s: cached copy at %s is damaged; downloading again", muri, local)
                shutil.rmtree(local)
        for entry in manifest.files:
            try:
                backend.download_file(f"{manifest.data_dir}/{entry.path}", local / entry.path)
            except NotFound:
                raise IntegrityError(f"{muri}: file {entry.path} listed in the manifest is missing") from None
        verify_files(manifest, local, muri)
        marker.touch()
    return Artifact(uri=artifact_uri, manifest=manifest, manifest_sha256=digest, path=local)


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
        log.warning("%s: the copy at %s is %s; downloading again", uri, dest,
                    "out of date (the source changed)" if recorded != listing else "damaged")
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


def ls_files(files: list[FileEntry]) -> str:
    return "\n".join(f"{f.size:>12}  {f.sha256[:12]}  {f.path}" for f in files)
