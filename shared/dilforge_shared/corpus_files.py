"""Where a corpus is: a file, a folder, a glob or an S3 object/prefix (`expand`), regular files only, and its
content digest for lineage (`data_digest`), which every stage's identity check needs. Opening and reading those
files is `corpus`'s."""

from __future__ import annotations

import glob
import os
import stat
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from .errors import InputError
from .paths import content_keys, declared_uri, holds_dilforge_data

TextFormat = Literal["auto", "txt", "jsonl", "tsv", "parquet"]
Oversize = Literal["error", "split", "truncate", "skip"]
MAX_DOCUMENT_BYTES = 32 << 20  # default bound on one line/document; a 200 MB line never reaches memory whole

SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".tsv", ".tsv.gz", ".parquet")
GLOB_CHARS = "*?["


def expand(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The corpus files behind `uri`: a file, a folder (every corpus file below it, sorted), a glob, or an S3 object
    or prefix (`s3://bucket/prefix/` included). In a folder or prefix, hidden entries (`.git/`, `.cache`, a
    `.dilforge/` store), stores, artifacts and stage work folders (`paths.holds_dilforge_data`) are
    skipped; a link to a folder is refused (it may loop or lead out of the folder). A name holding `*`, `?` or
    `[` is a glob only when no such file exists (`data[1].txt` is a file)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return _expand_s3(uri, parsed.netloc, parsed.path.lstrip("/"), endpoint_url)
    path = uri[len("file://") :] if parsed.scheme == "file" else uri
    if any(ch in path for ch in GLOB_CHARS) and not os.path.lexists(path):
        matches = sorted(glob.glob(path))
        if not matches:
            raise InputError(
                "glob matches no file (a file whose name holds *, ? or [ is read when it exists)", path=uri
            )
        return [regular_file(m, m) for m in matches]
    p = Path(path)
    if p.is_dir():
        files = _walk(p, uri)
        if not files:
            raise InputError("folder holds no corpus file (.txt, .txt.gz, .jsonl, .tsv, .parquet)", path=uri)
        return files
    if not p.exists():
        raise InputError("no such file", path=uri)
    return [regular_file(str(p), uri)]


def _walk(root: Path, uri: str) -> list[str]:
    """Corpus files below `root`, sorted, skipping what `expand` says it skips."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_walk_error(uri)):
        here = Path(dirpath)
        keep = []
        for name in dirnames:
            sub = here / name
            if name.startswith("."):
                continue
            if sub.is_symlink():
                raise InputError(
                    f"{sub.relative_to(root)} is a link to a folder; links are not followed in a corpus folder "
                    "(they may loop or lead out of it): name its target as a source of its own",
                    path=uri,
                )
            if not holds_dilforge_data(sub):
                keep.append(name)
        dirnames[:] = keep
        files += [
            str(here / f)
            for f in filenames
            if not f.startswith(".") and f.lower().endswith(SUFFIXES) and (here / f).is_file()
        ]
    return sorted(files)


def _walk_error(uri: str):
    def fail(exc: OSError):
        raise InputError(f"cannot list folder: {exc.strerror} ({exc.filename})", path=uri)

    return fail


def _expand_s3(uri: str, bucket: str, key: str, endpoint_url: str | None) -> list[str]:
    from .store import S3Storage

    backend = S3Storage(bucket, "", endpoint_url)
    if key and not key.endswith("/") and backend.exists(key):
        return [uri]
    prefix = key.rstrip("/")
    keys = [k for k in content_keys(backend.list(prefix), prefix) if k.lower().endswith(SUFFIXES)]
    if not keys:
        raise InputError("no such S3 object, and no corpus files under that prefix", path=uri)
    return [f"s3://{bucket}/{k}" for k in sorted(keys)]


def regular_file(path: str, uri: str) -> str:
    """Corpora are regular files: a FIFO, a device (/dev/zero) or a socket would hang hashing and reading."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InputError(f"cannot open: {exc.strerror}", path=uri) from None
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "not a regular file"
        )
        raise InputError(
            f"is {kind}, not a regular file; corpora must be regular files (hashing and reading "
            "a stream would never end)",
            path=uri,
        )
    return path


def source_files(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The files a source names: an artifact's data folder by its manifest's list (a file added to a published
    artifact is never read), anything else by `corpus_files.expand`."""
    listed = artifact_files(uri)
    return listed if listed is not None else expand(uri, endpoint_url)


def artifact_files(uri: str) -> list[str] | None:
    """The corpus files an artifact's manifest lists, when `uri` is its data folder (the folder a `manifest.json`
    beside it names as `data_dir`: in a local store, a fetched copy, a SageMaker channel); else None."""
    from .manifest import MANIFEST_NAME, parse_manifest

    folder = Path(uri)
    beside = folder.parent / MANIFEST_NAME
    if "://" in uri or not folder.is_dir() or not beside.is_file():
        return None
    manifest = parse_manifest(beside.read_bytes(), str(beside))
    if manifest.data_dir != folder.name:
        return None
    files = sorted(str(folder / e.path) for e in manifest.files if e.path.lower().endswith(SUFFIXES))
    if not files:
        raise InputError("the artifact's manifest lists no corpus file (.txt, .jsonl, .tsv, .parquet)", path=uri)
    return files


def data_digest(uri: str, endpoint_url: str | None = None) -> str:
    """A content digest for lineage and artifact reuse: sha256 of local files, ETags on S3. A source naming one
    local file (or an uploaded copy of one) is that file's sha256, whatever its name or path: a copy or a link
    is the same input; a folder or glob also hashes its files' names."""
    import hashlib

    files = source_files(uri, endpoint_url)
    named = files == [uri.removeprefix("file://")]
    h = hashlib.sha256()
    for file_uri in files:
        parsed = urlparse(file_uri)
        if parsed.scheme == "s3":
            from .store import S3Storage

            backend = S3Storage(parsed.netloc, "", endpoint_url)
            head = backend.client.head_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
            sha256 = head.get("Metadata", {}).get("sha256")
            if sha256 and declared_uri(file_uri) != file_uri:  # an uploaded copy: hashed as the local file
                if named:
                    return sha256
                h.update(f"{os.path.basename(file_uri)}:{sha256}\n".encode())
            else:
                h.update(f"{file_uri}:{head['ETag']}\n".encode())
        elif named:
            return stamped_sha256(Path(file_uri))
        else:
            h.update(f"{os.path.basename(file_uri)}:{stamped_sha256(Path(file_uri))}\n".encode())
    return h.hexdigest()


def stamped_sha256(path: Path) -> str:
    """sha256 of a local file, read in full once per content: the digest is kept under the cache
    (DILFORGE_CACHE, else ~/.cache/dilforge) keyed by the file's stat stamp (path, device, inode, size,
    mtime and ctime in ns, as git's index does), so planning hashes a corpus and the stage's checks (at start,
    before publishing, on every rank of every host sharing the cache) only stat it. Any write changes the stamp."""
    import hashlib

    from .manifest import sha256_file
    from .settings import cache_root

    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    root = cache_root() / "digests"
    entry = root / hashlib.sha256(stamp.encode()).hexdigest()
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    digest = sha256_file(path)
    try:  # best effort: an unwritable cache only costs the next read
        root.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, entry)
    except OSError:
        pass
    return digest
