"""Where artifact bytes live: a local folder (LocalStorage) or an S3 bucket prefix (S3Storage), behind one Protocol.

Every key is checked by `check_relative_path` before it becomes a path or an object key, so no name read from a
manifest, record or config can address anything outside the backend's root.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from ..errors import DilforgeError
from ..paths import check_relative_path, confined
from ..settings import settings

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
    def read_versioned(self, key: str) -> tuple[bytes, str]: ...
    def replace_bytes(self, key: str, data: bytes, version: str) -> bool: ...
    def upload_file(self, key: str, path: Path) -> None: ...
    def download_file(self, key: str, path: Path) -> None: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def local_path(self, key: str) -> Path | None: ...


FULL_DISK = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


@contextmanager
def _writing(dest: Path, tmp: Path):
    """A failed write into the store names the store path: shutil's sendfile copy blames its *source* (the work
    folder) for a full store disk. The temp file is removed either way."""
    try:
        yield
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in FULL_DISK or exc.filename in (None, str(tmp)):
            raise OSError(exc.errno, exc.strerror or str(exc), str(dest)) from None
        raise


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


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
        with _writing(path, tmp):
            tmp.write_bytes(data)
        os.replace(tmp, path)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Create-only write: link a complete temp file into place; False if the key exists."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with _writing(path, tmp):
            tmp.write_bytes(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def _folder_lock(self, path: Path, kind: int):
        """flock on the key's folder: what read_versioned and replace_bytes make one step of."""
        import fcntl

        fd = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, kind)
            yield
        finally:
            os.close(fd)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The file's bytes and its version (inode, size, mtime), read as one step against replace_bytes."""
        import fcntl

        path = self._path(key)
        try:
            with self._folder_lock(path, fcntl.LOCK_SH), path.open("rb") as f:
                st = os.fstat(f.fileno())
                return f.read(), f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        except FileNotFoundError:
            raise NotFound(f"{self.uri}/{key}: no such file") from None

    def replace_bytes(self, key: str, data: bytes, version: str) -> bool:
        """Compare-and-swap: write only while the file is still `version` (read_versioned's); False otherwise."""
        import fcntl

        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with self._folder_lock(path, fcntl.LOCK_EX):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    return False
                if f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}" != version:
                    return False
                with _writing(path, tmp):
                    tmp.write_bytes(data)
                os.replace(tmp, path)
                return True
        finally:
            tmp.unlink(missing_ok=True)

    def upload_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        with _writing(dest, tmp):
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


# Keys for an S3-compatible endpoint this process itself provides (the compose backend's local-only SeaweedFS
# identity), by endpoint URL: used only by clients of that endpoint, while the DILFORGE_S3_* keys are unset, and
# never written into os.environ.
_ENDPOINT_KEYS: dict[str, tuple[str, str, str]] = {}


def use_endpoint_keys(endpoint_url: str, access_key_id: str, secret_access_key: str, region: str = "us-east-1") -> None:
    """Give this process's S3 clients of `endpoint_url` these keys (unless DILFORGE_S3_* keys are set)."""
    _ENDPOINT_KEYS[endpoint_url.rstrip("/")] = (access_key_id, secret_access_key, region)


def endpoint_keys(endpoint_url: str | None) -> dict[str, str]:
    """boto3 client keyword arguments for `endpoint_url`: the DILFORGE_S3_* keys, else registered ones, else none
    (boto3's usual chain, as on AWS)."""
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
        keys = self._keys = endpoint_keys(endpoint_url)
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
        return join(self.prefix, key)

    def arrow_filesystem(self):
        """The same endpoint, credentials (boto3's chain), region, timeouts and attempts as a
        `pyarrow.fs.S3FileSystem`, for readers that seek (parquet reads its footer, then one row group at a time)."""
        import boto3
        from pyarrow import fs

        cfg = settings()
        creds = boto3.Session(**{k: v for k, v in self._keys.items() if k != "region_name"}).get_credentials()
        frozen = creds.get_frozen_credentials() if creds is not None else None
        endpoint = urlparse(self.client.meta.endpoint_url)
        return fs.S3FileSystem(
            access_key=frozen.access_key if frozen else None,
            secret_key=frozen.secret_key if frozen else None,
            session_token=frozen.token if frozen else None,
            anonymous=frozen is None,
            region=self.client.meta.region_name,
            endpoint_override=endpoint.netloc,
            scheme=endpoint.scheme,
            connect_timeout=cfg.s3_connect_timeout,
            request_timeout=cfg.s3_read_timeout,
            retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=cfg.s3_max_attempts),
        )

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
        return self.read_versioned(key)[0]

    def write_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """PutObject with If-None-Match: * (S3 conditional write); False on 412 / conflict."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if self._precondition_failed(exc):
                return False
            raise

    def _precondition_failed(self, exc) -> bool:
        """A conditional write refused: the key exists (If-None-Match), or changed since it was read (If-Match)."""
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and its ETag, from one GetObject."""
        from botocore.exceptions import ClientError

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return got["Body"].read(), got["ETag"]
        except ClientError as exc:
            if self._missing(exc):
                raise NotFound(f"s3://{self.bucket}/{self._key(key)}: no such object") from None
            raise

    def replace_bytes(self, key: str, data: bytes, version: str) -> bool:
        """PutObject with If-Match: the ETag read_versioned gave (S3 conditional write); False when the object
        changed or is gone since."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfMatch=version)
            return True
        except ClientError as exc:
            if self._missing(exc) or self._precondition_failed(exc):
                return False
            raise

    def metadata(self, key: str) -> dict[str, str]:
        """The object's user metadata (`x-amz-meta-*`)."""
        return self.client.head_object(Bucket=self.bucket, Key=self._key(key)).get("Metadata", {})

    def upload_file(self, key: str, path: Path, sha256: str | None = None) -> None:
        """`path` to `key`; `sha256`, when given, is stored as the object's metadata (an uploaded copy's digest)."""
        extra = {"ExtraArgs": {"Metadata": {"sha256": sha256}}} if sha256 else {}
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer, **extra)

    def download_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import ClientError

        full = self._key(key)  # checked before anything is created locally
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, full, str(path), Config=self.transfer)
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
        self.client.copy(
            {"Bucket": self.bucket, "Key": self._key(key)}, self.bucket, self._key(dest), Config=self.transfer
        )

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
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
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
    if parsed.scheme in ("",) or (len(parsed.scheme) == 1 and os.name == "nt"):
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
