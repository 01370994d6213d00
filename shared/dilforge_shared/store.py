"""Artifact store over a local directory (path or file://) and S3 (boto3). Publishing is atomic for readers: files
go to a fresh `data-<uuid>/`, the manifest last and create-only (of two publishers exactly one wins). Reading
verifies every file's size and sha256. Every key is checked (`check_relative_path`) before it becomes a path."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

from .errors import ArtifactExistsError, DilforgeError, IntegrityError, ManifestNotFound, UnsafePathError
from .manifest import (
    MANIFEST_NAME,
    InputRef,
    Manifest,
    artifact_ref,
    check_relative_path,
    parse_manifest,
    scan_files,
    sha256_bytes,
    sha256_file,
)
from .settings import cache_root, settings

log = logging.getLogger("dilforge_shared.store")

MULTIPART_THRESHOLD = 64 << 20  # bytes; larger files go up in parts of this size
PUBLISH_LOG_S = 25.0  # the longest a publish goes without a log line between files, as stages log progress


def local_path(uri: str) -> Path:
    """A local URI (a path or file://) as a Path."""
    return Path(uri.removeprefix("file://")).expanduser()


def confined(root: Path, rel: str, what: str = "path") -> Path:
    """`root / rel`, refused unless `rel` is a clean relative path that also resolves (links followed) inside root."""
    check_relative_path(rel)
    path = root / rel
    real_root = root.resolve()
    if not path.resolve().is_relative_to(real_root):
        raise UnsafePathError(f"{what} {rel!r} resolves to {path.resolve()}, outside {real_root}")
    return path


class NotFound(DilforgeError):
    """A key or object that does not exist."""


def _staged(dest: Path, fill: Callable[[Path], object]) -> Path:
    """A complete temp file beside `dest`, filled by `fill`, to move or link into place; a failed write removes it
    and names the store path (shutil's copy blames its source for a full store disk)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
    try:
        fill(tmp)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) or exc.filename in (None, str(tmp)):
            raise OSError(exc.errno, exc.strerror or str(exc), str(dest)) from None
        raise
    return tmp


MISSING = ("404", "NoSuchKey", "NotFound")  # the codes S3 and S3-compatible stores answer for a missing object


@contextmanager
def _found(uri: str) -> Iterator[None]:
    """A missing local file or S3 object (botocore's 404 / NoSuchKey) as NotFound naming `uri`."""
    try:
        yield
    except FileNotFoundError:
        raise NotFound(f"{uri}: no such file") from None
    except Exception as exc:
        if (getattr(exc, "response", None) or {}).get("Error", {}).get("Code") in MISSING:
            raise NotFound(f"{uri}: no such object") from None
        raise


class LocalStorage:
    """Artifact bytes in a local folder; create-only writes with os.link."""

    def __init__(self, root: Path):
        self.root = root.expanduser().resolve()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return confined(self.root, key, "store key") if key else self.root

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def read_bytes(self, key: str) -> bytes:
        with _found(f"{self.uri}/{key}"):
            return self._path(key).read_bytes()

    def size(self, key: str) -> int:
        with _found(f"{self.uri}/{key}"):
            return self._path(key).stat().st_size

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.replace(_staged(path, lambda tmp: tmp.write_bytes(data)), path)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Create-only write: link a complete temp file into place; False if the key exists."""
        path = self._path(key)
        tmp = _staged(path, lambda tmp: tmp.write_bytes(data))
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def upload_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        os.replace(_staged(dest, lambda tmp: shutil.copyfile(path, tmp)), dest)

    def download_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _found(f"{self.uri}/{key}"):
            shutil.copyfile(src, path)

    def list(self, prefix: str) -> Iterator[str]:
        for p in sorted(self._path(prefix).rglob("*")):  # none under a missing folder
            if p.is_file() and not p.name.endswith(".tmp"):
                yield p.relative_to(self.root).as_posix()

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_stats(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """(key, size, a version tag: the mtime in ns) of every file under prefix, as S3's listing gives them."""
        for key in self.list(prefix):
            st = self._path(key).stat()
            yield key, st.st_size, f"mtime:{st.st_mtime_ns}"


_ENDPOINT_KEYS: dict[str, tuple[str, str, str]] = {}  # by endpoint URL, for `use_endpoint_keys`


def use_endpoint_keys(endpoint_url: str, access_key_id: str, secret_access_key: str, region: str = "us-east-1") -> None:
    """This process's S3 clients of `endpoint_url` use these keys unless DILFORGE_S3_* are set."""
    _ENDPOINT_KEYS[endpoint_url.rstrip("/")] = (access_key_id, secret_access_key, region)


def endpoint_keys(endpoint_url: str | None) -> dict[str, str]:
    """boto3 client keys for `endpoint_url`: DILFORGE_S3_*, else registered ones, else none (boto3's chain)."""
    cfg = settings()
    if cfg.s3_access_key_id and cfg.s3_secret_access_key:
        return {
            "aws_access_key_id": cfg.s3_access_key_id.get_secret_value(),
            "aws_secret_access_key": cfg.s3_secret_access_key.get_secret_value(),
        }
    if endpoint_url and (registered := _ENDPOINT_KEYS.get(endpoint_url.rstrip("/"))):
        key, secret, region = registered
        return {"aws_access_key_id": key, "aws_secret_access_key": secret, "region_name": region}
    return {}


class S3Storage:
    """boto3 with bounded standard retries and multipart transfers above MULTIPART_THRESHOLD."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None, client=None):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        cfg = settings()
        endpoint_url = endpoint_url or cfg.s3_endpoint_url or None
        keys = self.keys = endpoint_keys(endpoint_url)
        # Bounded: a frozen endpoint fails after max_attempts × (connect + read timeout), not 8 × 60 s.
        self.client = client or boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            **keys,
            config=Config(
                retries={"total_max_attempts": cfg.s3_max_attempts, "mode": "standard"},
                connect_timeout=cfg.s3_connect_timeout,
                read_timeout=cfg.s3_read_timeout,
                s3={"addressing_style": "path"},
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD, max_concurrency=8
        )

    def _key(self, key: str) -> str:
        if key:
            check_relative_path(key)
        return "/".join(part for part in (self.prefix, key) if part)

    def local_path(self, key: str) -> Path | None:
        return None

    def head(self, key: str) -> dict:
        """The object's HeadObject answer (ContentLength, ETag, user `Metadata`)."""
        with _found(f"{self.uri}/{key}"):
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
            return True
        except NotFound:
            return False

    def size(self, key: str) -> int:
        return self.head(key)["ContentLength"]

    def read_bytes(self, key: str) -> bytes:
        return self.read_versioned(key)[0]

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag, from one GetObject."""
        with _found(f"{self.uri}/{key}"):
            got = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return got["Body"].read(), got["ETag"]

    def open(self, key: str) -> IO[bytes]:
        """The object as a buffered stream, read as it downloads (botocore's errors as they come)."""
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]  # an IOBase with readinto
        return io.BufferedReader(body, buffer_size=1 << 20)

    def write_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """PutObject with If-None-Match: * (S3 conditional write); False when the key exists."""
        return self._put_if(key, data, IfNoneMatch="*")

    def replace_bytes(self, key: str, data: bytes, version: str) -> bool:
        """PutObject with If-Match: the ETag read_versioned gave; False when the object changed or is gone since."""
        return self._put_if(key, data, IfMatch=version)

    def _put_if(self, key: str, data: bytes, **condition: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
            return True
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in (*MISSING, "PreconditionFailed", "ConditionalRequestConflict") or status in (404, 409, 412):
                return False
            raise

    def upload_file(self, key: str, path: Path, sha256: str | None = None) -> None:
        """`path` to `key`; `sha256`, when given, is stored as the object's metadata (an uploaded copy's digest)."""
        extra = {"ExtraArgs": {"Metadata": {"sha256": sha256}}} if sha256 else {}
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer, **extra)

    def download_file(self, key: str, path: Path) -> None:
        full = self._key(key)  # checked before anything is created locally
        path.parent.mkdir(parents=True, exist_ok=True)
        with _found(f"{self.uri}/{key}"):
            self.client.download_file(self.bucket, full, str(path), Config=self.transfer)

    def list_stats(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """(key, size, ETag) of every object under prefix, from the listing (no HEAD per object)."""
        full = self._key(prefix)
        full = full + "/" if full else ""
        strip = len(self.prefix) + 1 if self.prefix else 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:], obj["Size"], obj["ETag"]

    def list(self, prefix: str) -> Iterator[str]:
        return (key for key, _, _ in self.list_stats(prefix))

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def copy(self, key: str, dest: str) -> None:
        self.client.copy(
            {"Bucket": self.bucket, "Key": self._key(key)}, self.bucket, self._key(dest), Config=self.transfer
        )

    def delete_prefix(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            )


# Where artifact bytes live (Storage, not Backend: the coordinator's backends are where stages run).
Storage = LocalStorage | S3Storage


def open_backend(uri: str, endpoint_url: str | None = None) -> Storage:
    """The storage rooted at `s3://bucket/prefix`, `file:///path` or a plain path (an artifact's folder too)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise DilforgeError(f"{uri}: an s3:// URI needs a bucket")
        return S3Storage(parsed.netloc, parsed.path, endpoint_url)
    if parsed.scheme in ("", "file"):
        return LocalStorage(Path(parsed.path if parsed.scheme else uri))
    raise DilforgeError(f"{uri}: unsupported URI scheme {parsed.scheme!r}; use a path, file:// or s3://")


def read_uri_bytes(uri: str, endpoint_url: str | None = None) -> bytes:
    """The bytes of the object or file at `uri`."""
    uri = uri.rstrip("/")
    name = uri.rpartition("/")[2]
    return open_backend(uri[: len(uri) - len(name)] or ".", endpoint_url).read_bytes(name)


STORE_MARKER = ".dilforge-store"  # at a store's root, written by every publish and run record


def mark_store(backend: Storage) -> None:
    """Leave the marker that says this root is a dilforge store (`coordinator gc` works nowhere else)."""
    if not backend.exists(STORE_MARKER):
        backend.create_bytes(STORE_MARKER, b"dilforge artifact store\n")


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
        return artifact_ref(name, self.uri, self.manifest)


# sha256 of the manifest's bytes, written beside it just before it: every reader catches a later change. Named after
# the data folder (two racing publishers each write their own) and outside it (it holds exactly the listed files).
def manifest_digest_key(data_dir: str) -> str:
    return f".{data_dir}.manifest.sha256"


def artifact_exists(artifact_uri: str, endpoint_url: str | None = None) -> bool:
    return open_backend(artifact_uri, endpoint_url).exists(MANIFEST_NAME)


def publish(artifact_uri: str, local_dir: Path, manifest: Manifest, endpoint_url: str | None = None) -> Manifest:
    """Upload every file of `local_dir`, then create the manifest; ArtifactExistsError if taken."""
    backend = open_backend(artifact_uri, endpoint_url)
    if backend.exists(MANIFEST_NAME):
        raise ArtifactExistsError(f"{artifact_uri}/{MANIFEST_NAME}")
    files = scan_files(local_dir)
    if not files:
        raise DilforgeError(f"{local_dir}: nothing to publish (empty output folder)")
    if found := store_of(artifact_uri, endpoint_url):
        mark_store(open_backend(found[0], endpoint_url))
    data_dir = f"data-{uuid.uuid4().hex[:12]}"
    manifest = manifest.model_copy(update={"files": files, "data_dir": data_dir})
    body = manifest.to_json()
    logged = time.monotonic()
    try:
        for n, entry in enumerate(files, 1):
            if entry.size >= MULTIPART_THRESHOLD or time.monotonic() - logged >= PUBLISH_LOG_S:
                logged = time.monotonic()
                log.info(
                    "publish %s: %d/%d files, uploading %s (%d MiB)",
                    artifact_uri,
                    n,
                    len(files),
                    entry.path,
                    entry.size >> 20,
                )
            backend.upload_file(f"{data_dir}/{entry.path}", local_dir / entry.path)
        backend.write_bytes(manifest_digest_key(data_dir), sha256_bytes(body).encode())
        created = backend.create_bytes(MANIFEST_NAME, body)
    except BaseException:
        _remove_attempt(backend, data_dir)
        raise
    if not created:
        _remove_attempt(backend, data_dir)
        raise ArtifactExistsError(f"{artifact_uri}/{MANIFEST_NAME}")
    log.info("published %s (%d files)", artifact_uri, len(files))
    return manifest


def _remove_attempt(backend: Storage, data_dir: str) -> None:
    """What a failed or losing publish wrote: its data folder and its manifest digest."""
    backend.delete_prefix(data_dir)
    backend.delete(manifest_digest_key(data_dir))


def read_manifest(uri: str, endpoint_url: str | None = None) -> tuple[Manifest, str]:
    """Return (manifest, sha256 of its bytes) for an artifact folder or manifest URI."""
    muri = manifest_uri_of(uri)
    try:
        data = read_uri_bytes(muri, endpoint_url)
    except NotFound as exc:
        raise ManifestNotFound(f"{muri}: no manifest there ({exc})") from None
    manifest, digest = parse_manifest(data, muri), sha256_bytes(data)
    sidecar = manifest_digest_key(manifest.data_dir)
    try:
        recorded = read_uri_bytes(f"{muri[: -len(MANIFEST_NAME)]}{sidecar}", endpoint_url).decode("ascii", "replace")
    except NotFound:
        raise IntegrityError(
            f"{muri}: no recorded digest beside the manifest ({sidecar} is missing): an edited manifest cannot be "
            "told from the published one; republish the artifact (rerun its stage)"
        ) from None
    if recorded.strip() != digest:
        raise IntegrityError(
            f"{muri}: damaged manifest: its sha256 is not the one recorded when it was published ({sidecar})"
        )
    return manifest, digest


def store_of(artifact_uri: str, endpoint_url: str | None = None) -> tuple[str, str] | None:
    """(store root, `artifacts/<stage>/<id>`) of an artifact kept in a store (a local one by real path)."""
    local = open_backend(artifact_uri, endpoint_url).local_path("")
    where = local.as_posix() if local is not None else artifact_uri.rstrip("/")
    root, sep, tail = where.rpartition("/artifacts/")
    if not sep or not root or tail.count("/") != 1:
        return None
    return root, f"artifacts/{tail}"


def recorded_digest_problem(artifact_uri: str, manifest: Manifest, digest: str, endpoint_url: str | None) -> str | None:
    """None unless the store's run records witnessed publishes of this artifact (data folder, manifest sha256) and
    none is this one: its manifest was edited or its files swapped, whatever digest lies beside it."""
    if (found := store_of(artifact_uri, endpoint_url)) is None:
        return None
    root, address = found
    try:
        store = open_backend(root, endpoint_url)
        keys = [k for k in store.list("runs") if k.endswith(".json")]
    except (NotFound, OSError, DilforgeError):
        return None
    seen: list[tuple[str, dict]] = []
    for key in sorted(keys):
        try:
            witness = (json.loads(store.read_bytes(key)).get("witnesses") or {}).get(address)
        except (NotFound, OSError, ValueError, AttributeError):
            continue  # a damaged record is the coordinator's to report
        if isinstance(witness, dict):
            if (witness.get("data_dir"), witness.get("manifest_sha256")) == (manifest.data_dir, digest):
                return None
            seen.append((key, witness))
    if not seen:
        return None
    key, witness = next(((k, w) for k, w in seen if w.get("data_dir") == manifest.data_dir), seen[-1])
    if witness.get("data_dir") == manifest.data_dir:
        return (
            f"{artifact_uri}/{MANIFEST_NAME}: changed since run record {key} recorded it (sha256 "
            f"{str(witness.get('manifest_sha256'))[:12]}…, now {digest[:12]}…); rerun its stage to rebuild it"
        )
    return (
        f"{artifact_uri}/{MANIFEST_NAME}: its data folder {manifest.data_dir} is no publish a run record witnessed "
        f"({key} recorded {witness.get('data_dir')}): the artifact was replaced after it was made; rerun its stage "
        "to rebuild it"
    )


def extra_keys(manifest: Manifest, backend: Storage) -> list[str]:
    """Objects under a remote artifact's data prefix that its manifest does not list."""
    listed = {f"{manifest.data_dir}/{entry.path}" for entry in manifest.files}
    return sorted(k for k in backend.list(manifest.data_dir) if k not in listed)


def verify_files(manifest: Manifest, root: Path, source: str, full: bool = True) -> None:
    """Every listed file present, inside `root`, of its size and (full) sha256, and nothing else there."""
    listed = {entry.path for entry in manifest.files}
    extra = sorted(
        path
        for folder, dirs, files in os.walk(root)
        for name in files + [d for d in dirs if (Path(folder) / d).is_symlink()]
        if (path := (Path(folder).relative_to(root) / name).as_posix()) not in listed
    )
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise IntegrityError(
            f"{source}: {root.name}/{extra[0]}{more} not listed in the manifest: an artifact holds exactly its "
            "manifest's files (remove what was added, or rerun its stage)"
        )
    real_root = root.resolve()
    for entry in manifest.files:
        path = root / entry.path
        if path.is_symlink() or not path.resolve().is_relative_to(real_root):
            raise IntegrityError(
                f"{source}: file {entry.path} is a symlink ({path} -> {path.resolve()}); "
                "artifact files must be regular files inside the artifact"
            )
        if not path.is_file():
            raise IntegrityError(f"{source}: file {entry.path} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise IntegrityError(f"{source}: file {entry.path} has {size} bytes, manifest says {entry.size}")
        if full and sha256_file(path) != entry.sha256:
            raise IntegrityError(f"{source}: file {entry.path} does not match its sha256 in the manifest")


def fetch(uri: str, cache_dir: Path | None = None, endpoint_url: str | None = None) -> Artifact:
    """A manifest and its files, verified: a local store's in place, a remote one's downloaded to a cache."""
    muri = manifest_uri_of(uri)
    artifact_uri = muri[: -len(MANIFEST_NAME) - 1]
    manifest, digest = read_manifest(muri, endpoint_url)
    if problem := recorded_digest_problem(artifact_uri, manifest, digest, endpoint_url):
        raise IntegrityError(problem)
    backend = open_backend(artifact_uri, endpoint_url)
    local = backend.local_path(manifest.data_dir)
    if local is not None:
        verify_files(manifest, local, muri)
    else:
        if extra := extra_keys(manifest, backend):
            raise IntegrityError(
                f"{muri}: {extra[0]} not listed in the manifest: an artifact holds exactly its manifest's files"
            )
        # the artifact's layout (manifest.json beside its data folder): a reader finds the list of its files there
        cache_dir = cache_dir or cache_root() / "artifacts"
        top = confined(cache_dir, f"{manifest.artifact_id}-{digest[:12]}", f"{muri}: artifact_id")
        local = top / manifest.data_dir
        marker = top / ".complete"
        if marker.exists():
            try:
                verify_files(manifest, local, muri)
                return Artifact(uri=artifact_uri, manifest=manifest, manifest_sha256=digest, path=local)
            except IntegrityError:
                log.warning("%s: cached copy at %s is damaged; downloading again", muri, top)
                shutil.rmtree(top)
        for entry in manifest.files:
            try:
                backend.download_file(f"{manifest.data_dir}/{entry.path}", local / entry.path)
            except NotFound:
                raise IntegrityError(f"{muri}: file {entry.path} listed in the manifest is missing") from None
        verify_files(manifest, local, muri)
        backend.download_file(MANIFEST_NAME, top / MANIFEST_NAME)  # as published: a reader can check its digest
        if sha256_file(top / MANIFEST_NAME) != digest:
            raise IntegrityError(f"{muri}: the manifest changed while its artifact was being copied")
        marker.touch()
    return Artifact(uri=artifact_uri, manifest=manifest, manifest_sha256=digest, path=local)
