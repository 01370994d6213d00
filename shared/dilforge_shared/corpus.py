"""Streaming text readers for corpora on local disk or S3.

Formats: `.txt` (one document per line), `.txt.gz`, `.jsonl` (a configurable text field),
`.tsv` (a header row; a configurable column) and `.parquet` (a configurable column, if pyarrow is
installed). Nothing is loaded whole. Every error names the file and, where there is one, the line.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import unicodedata
from pathlib import Path
from typing import IO, Iterator, Literal
from urllib.parse import urlparse

from .errors import InputError

TextFormat = Literal["auto", "txt", "jsonl", "tsv", "parquet"]
SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".tsv", ".tsv.gz", ".parquet")


def detect_format(uri: str) -> str:
    name = uri.lower().removesuffix(".gz")
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".tsv", "tsv"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return fmt
    return "txt"


def expand(uri: str, endpoint_url: str | None = None) -> list[str]:
    """A file, a folder (every corpus file inside, sorted), a glob, or an S3 object or prefix."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        from .store import S3Backend
        backend = S3Backend(parsed.netloc, "", endpoint_url)
        key = parsed.path.lstrip("/")
        if backend.exists(key):
            return [uri]
        keys = [k for k in backend.list(key.rstrip("/")) if k.lower().endswith(SUFFIXES)]
        if not keys:
            raise InputError("no such S3 object, and no corpus files under that prefix", path=uri)
        return [f"s3://{parsed.netloc}/{k}" for k in keys]
    path = uri[len("file://"):] if parsed.scheme == "file" else uri
    if any(ch in path for ch in "*?["):
        matches = sorted(glob.glob(path))
        if not matches:
            raise InputError("glob matches no file", path=uri)
        return matches
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(SUFFIXES))
        if not files:
            raise InputError("folder holds no corpus file (.txt, .txt.gz, .jsonl, .tsv, .parquet)", path=uri)
        return files
    if not p.exists():
        raise InputError("no such file", path=uri)
    return [str(p)]


class _BodyReader(io.RawIOBase):
    """A botocore StreamingBody as a raw stream, so buffering, gzip and line iteration work on it."""

    def __init__(self, body):
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.body.close()
        super().close()


def _open_binary(uri: str, endpoint_url: str | None) -> IO[bytes]:
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        from botocore.exceptions import ClientError

        from .store import S3Backend
        backend = S3Backend(parsed.netloc, "", endpoint_url)
        try:
            body = backend.client.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))["Body"]
        except ClientError as exc:
            raise InputError(f"cannot read S3 object: {exc.response.get('Error', {}).get('Code')}", path=uri) from None
        stream: IO[bytes] = io.BufferedReader(_BodyReader(body), buffer_size=1 << 20)
    else:
        try:
            stream = open(uri, "rb")
        except OSError as exc:
            raise InputError(f"cannot open: {exc.strerror}", path=uri) from None
    if uri.lower().endswith(".gz"):
        stream = gzip.GzipFile(fileobj=stream)  # type: ignore[assignment]
    return stream


def _lines(uri: str, endpoint_url: str | None) -> Iterator[tuple[int, str]]:
    with _open_binary(uri, endpoint_url) as stream:
        lineno = 0
        try:
            for lineno, raw in enumerate(stream, start=1):
                try:
                    yield lineno, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise InputError(f"not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 4]!r})",
                                     path=uri, line=lineno) from None
        except (OSError, EOFError) as exc:
            if isinstance(exc, InputError):
                raise
            raise InputError(f"read failed: {exc}", path=uri, line=lineno + 1) from None


def iter_records(uri: str, endpoint_url: str | None = None) -> Iterator[tuple[int, dict]]:
    """JSON objects of a JSONL file with their line numbers; blank lines skipped."""
    for lineno, line in _lines(uri, endpoint_url):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON: {exc.msg} (column {exc.colno})", path=uri, line=lineno) from None
        if not isinstance(record, dict):
            raise InputError(f"expected a JSON object, got {type(record).__name__}", path=uri, line=lineno)
        yield lineno, record


def _iter_file(uri: str, fmt: str, text_field: str, endpoint_url: str | None) -> Iterator[tuple[int, str]]:
    if fmt == "txt":
        yield from _lines(uri, endpoint_url)
    elif fmt == "jsonl":
        for lineno, record in iter_records(uri, endpoint_url):
            value = record.get(text_field)
            if not isinstance(value, str):
                raise InputError(f"field {text_field!r} missing or not a string (set text_field)", path=uri, line=lineno)
            yield lineno, value
    elif fmt == "tsv":
        column = None
        for lineno, line in _lines(uri, endpoint_url):
            cells = line.split("\t")
            if column is None:
                if text_field not in cells:
                    raise InputError(f"header has no column {text_field!r} (columns: {cells}); set text_field",
                                     path=uri, line=lineno)
                column = cells.index(text_field)
                continue
            if not line.strip():
                continue
            if column >= len(cells):
                raise InputError(f"row has {len(cells)} columns, expected at least {column + 1}", path=uri, line=lineno)
            yield lineno, cells[column]
    elif fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("reading parquet needs pyarrow installed", path=uri) from None
        with _open_binary(uri, endpoint_url) as stream:
            data = stream.read() if urlparse(uri).scheme == "s3" else None
        pf = pq.ParquetFile(io.BytesIO(data) if data is not None else uri)
        if text_field not in pf.schema_arrow.names:
            raise InputError(f"no column {text_field!r} (columns: {pf.schema_arrow.names}); set text_field", path=uri)
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                row += 1
                if isinstance(value, str):
                    yield row, value
    else:
        raise InputError(f"unknown format {fmt!r}", path=uri)


def iter_texts(
    uri: str,
    fmt: TextFormat = "auto",
    text_field: str = "text",
    endpoint_url: str | None = None,
    normalization: Literal["NFC", "none"] = "NFC",
    skip_empty: bool = True,
) -> Iterator[str]:
    """Documents of every file behind `uri`, NFC-normalised, streamed."""
    for located in iter_located_texts(uri, fmt, text_field, endpoint_url, normalization, skip_empty):
        yield located[2]


def iter_located_texts(
    uri: str,
    fmt: TextFormat = "auto",
    text_field: str = "text",
    endpoint_url: str | None = None,
    normalization: Literal["NFC", "none"] = "NFC",
    skip_empty: bool = True,
) -> Iterator[tuple[str, int, str]]:
    """(file, line, text) for every document behind `uri`; the location serves error messages."""
    for file_uri in expand(uri, endpoint_url):
        file_fmt = detect_format(file_uri) if fmt == "auto" else fmt
        for lineno, text in _iter_file(file_uri, file_fmt, text_field, endpoint_url):
            if normalization == "NFC":
                text = unicodedata.normalize("NFC", text)
            if skip_empty and not text.strip():
                continue
            yield file_uri, lineno, text


def data_digest(uri: str, endpoint_url: str | None = None) -> str:
    """A content digest for lineage and artifact reuse: sha256 of local files, ETags on S3."""
    import hashlib

    from .manifest import sha256_file
    h = hashlib.sha256()
    for file_uri in expand(uri, endpoint_url):
        parsed = urlparse(file_uri)
        if parsed.scheme == "s3":
            from .store import S3Backend
            backend = S3Backend(parsed.netloc, "", endpoint_url)
            head = backend.client.head_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
            h.update(f"{file_uri}:{head['ETag']}\n".encode())
        else:
            h.update(f"{os.path.basename(file_uri)}:{sha256_file(Path(file_uri))}\n".encode())
    return h.hexdigest()
