"""Streaming readers for corpora on local disk or S3: .txt (a line per document), .txt.gz, .jsonl, .tsv, .parquet.
Nothing is loaded whole: a line is read at most `max_document_bytes` at a time, `on_oversize` says what happens past
that; errors name the file and line."""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import unicodedata
from collections.abc import Callable, Iterator
from typing import IO, Literal
from urllib.parse import urlparse

from .configs import MAX_DOCUMENT_BYTES, Oversize, TextFormat
from .errors import InputError
from .identity import regular_file, source_files

log = logging.getLogger(__name__)


def detect_format(uri: str) -> str:
    suffix = uri.lower().removesuffix(".gz").rpartition(".")[2]
    return {"jsonl": "jsonl", "json": "jsonl", "tsv": "tsv", "parquet": "parquet"}.get(suffix, "txt")


# Compressed files a user may name as a corpus; only gzip (.gz) is read.
_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed"),
    (b"BZh", "bzip2-compressed"),
    (b"\xfd7zXZ\x00", "xz-compressed"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
    (b"PK\x03\x04", "a zip archive"),
    (b"PAR1", "a parquet file"),
)
_FIX = {"gzip-compressed": "name it .gz (gzip is read as it streams)", "a parquet file": "set format: parquet"}


def _check_not_compressed(stream: IO[bytes], uri: str) -> None:
    """A compressed file read as text would be reported as invalid UTF-8; say what it is instead."""
    head = stream.peek(8)[:8]
    for magic, what in _MAGIC:
        if magic == b"BZh" and head[3:4] not in b"123456789":  # bzip2: "BZh" then the block size digit
            continue
        if head.startswith(magic):
            fix = _FIX.get(what, "decompress it, or recompress it with gzip and name it .gz")
            raise InputError(f"is {what}, not text: {fix}", path=uri)


def open_binary(uri: str, endpoint_url: str | None) -> IO[bytes]:
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        from botocore.exceptions import ClientError

        from .store import S3Storage

        try:
            stream = S3Storage(parsed.netloc, "", endpoint_url).open(parsed.path.lstrip("/"))
        except ClientError as exc:
            raise InputError(f"cannot read S3 object: {exc.response.get('Error', {}).get('Code')}", path=uri) from None
    else:
        try:
            stream = open(regular_file(uri, uri), "rb")  # noqa: SIM115 - returned to the caller, who closes it
        except OSError as exc:
            raise InputError(f"cannot open: {exc.strerror}", path=uri) from None
    if uri.lower().endswith(".gz"):
        stream = gzip.GzipFile(fileobj=stream)  # type: ignore[assignment]
    elif not uri.lower().endswith(".parquet"):
        try:
            _check_not_compressed(stream, uri)
        except InputError:
            stream.close()
            raise
    return stream


def parquet_location(uri: str, endpoint_url: str | None):
    """(path, filesystem) for pyarrow: a checked local file, or an S3 object behind a `pyarrow.fs.S3FileSystem`
    (read by ranges) with the store's endpoint, credentials, region, timeouts and attempts."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":  # a regular file; whatever its name, pyarrow reads it as parquet
        return regular_file(uri, uri), None
    import boto3
    from pyarrow import fs

    from .settings import settings
    from .store import S3Storage

    cfg = settings()
    try:
        storage = S3Storage(parsed.netloc, "", endpoint_url)
        creds = boto3.Session(**{k: v for k, v in storage.keys.items() if k != "region_name"}).get_credentials()
        frozen = creds.get_frozen_credentials() if creds is not None else None
        endpoint = urlparse(storage.client.meta.endpoint_url)
        filesystem = fs.S3FileSystem(
            access_key=frozen.access_key if frozen else None,
            secret_key=frozen.secret_key if frozen else None,
            session_token=frozen.token if frozen else None,
            anonymous=frozen is None,
            region=storage.client.meta.region_name,
            endpoint_override=endpoint.netloc,
            scheme=endpoint.scheme,
            connect_timeout=cfg.s3_connect_timeout,
            request_timeout=cfg.s3_read_timeout,
            retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=cfg.s3_max_attempts),
        )
    except OSError as exc:
        raise InputError(f"cannot reach S3: {str(exc).splitlines()[0][:200]}", path=uri) from None
    return f"{parsed.netloc}/{parsed.path.lstrip('/')}", filesystem


def _decode(data: bytes, uri: str, lineno: int, decoder=None, final: bool = True) -> str:
    try:
        return decoder.decode(data, final) if decoder is not None else data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"not valid UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 4]!r})", path=uri, line=lineno
        ) from None


def _split_piece(text: str, max_bytes: int) -> tuple[str, str]:
    """The longest prefix of at most `max_bytes` UTF-8 bytes, cut at its last whitespace in the second half."""
    prefix = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    at = max(prefix.rfind(" ", len(prefix) // 2), prefix.rfind("\t", len(prefix) // 2))
    if at > 0:
        return prefix[:at], text[at + 1 :]
    return prefix, text[len(prefix) :]


_OVERSIZE = "{} longer than {} bytes (max_document_bytes); raise it, or set on_oversize to split, truncate or skip"


def iter_lines(
    uri: str,
    endpoint_url: str | None,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    oversize: Oversize = "error",
    splittable: bool = True,
) -> Iterator[tuple[int, str]]:
    """(line number, text) with every yielded text at most `max_bytes` of UTF-8; see the module doc."""
    policy = oversize if splittable or oversize == "skip" else "error"
    with open_binary(uri, endpoint_url) as stream:
        lineno = 0
        try:
            while raw := stream.readline(max_bytes + 1):
                lineno += 1
                if len(raw) <= max_bytes or raw.endswith(b"\n"):
                    yield lineno, _decode(raw, uri, lineno).rstrip("\r\n")
                    continue
                if policy == "error":
                    raise InputError(_OVERSIZE.format("line", max_bytes), path=uri, line=lineno)
                yield from _oversized(stream, raw, uri, lineno, max_bytes, policy)
        except (OSError, EOFError) as exc:
            raise InputError(f"read failed: {exc}", path=uri, line=lineno + 1) from None


def _oversized(
    stream, first: bytes, uri: str, lineno: int, max_bytes: int, policy: Oversize
) -> Iterator[tuple[int, str]]:
    """The rest of an over-long line, read `max_bytes` at a time: split into pieces, truncated or skipped."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    if policy != "split":
        what = "skipped" if policy == "skip" else "truncated"
        log.warning("%s:%d: %s; %s", uri, lineno, _OVERSIZE.format("line", max_bytes), what)
    if policy == "truncate":  # a character cut in half at the end is dropped, not decoded
        yield lineno, _decode(first[:max_bytes], uri, lineno, decoder, final=False)
    chunk, buffer = first, ""
    while True:
        done = chunk.endswith(b"\n") or len(chunk) <= max_bytes
        if policy == "split":
            buffer += _decode(chunk, uri, lineno, decoder, final=done)
            if done:
                buffer = buffer.rstrip("\r\n")
            while len(buffer.encode("utf-8")) > max_bytes:
                piece, buffer = _split_piece(buffer, max_bytes)
                yield lineno, piece
            if done and buffer:
                yield lineno, buffer
        if done:
            return
        chunk = stream.readline(max_bytes + 1)


def iter_records(
    uri: str,
    endpoint_url: str | None = None,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
    on_oversize: Oversize = "error",
    on_bad: Callable[[str, int, str], None] | None = None,
) -> Iterator[tuple[int, dict]]:
    """JSON objects of a JSONL file with line numbers; a bad line is an InputError or goes to `on_bad`."""
    for lineno, line in iter_lines(uri, endpoint_url, max_document_bytes, on_oversize, splittable=False):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            record, reason = None, f"not valid JSON: {exc.msg} (column {exc.colno})"
        else:
            reason = None if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"
        if reason is None:
            yield lineno, record
        elif on_bad is None:
            raise InputError(reason, path=uri, line=lineno)
        else:
            on_bad(uri, lineno, reason)


def iter_located_records(uri: str, endpoint_url: str | None = None, **kwargs) -> Iterator[tuple[str, int, dict]]:
    """(file, line, object) for every JSONL record or TSV row (by its header) behind `uri`."""
    for file_uri in source_files(uri, endpoint_url):
        if detect_format(file_uri) == "tsv":
            rows = iter_tsv_records(file_uri, endpoint_url, **{k: v for k, v in kwargs.items() if k != "on_bad"})
        else:
            rows = iter_records(file_uri, endpoint_url, **kwargs)
        for lineno, record in rows:
            yield file_uri, lineno, record


def iter_tsv_records(
    uri: str,
    endpoint_url: str | None = None,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
    on_oversize: Oversize = "error",
) -> Iterator[tuple[int, dict]]:
    """A TSV file's rows after its header, as {column: cell} with line numbers; short rows refused."""
    header = None
    for lineno, line in iter_lines(uri, endpoint_url, max_document_bytes, on_oversize, splittable=False):
        if header is None:
            header = line.split("\t")
            continue
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) < len(header):
            raise InputError(f"row has {len(cells)} columns, the header {len(header)}", path=uri, line=lineno)
        yield lineno, dict(zip(header, cells, strict=False))


def _iter_file(
    uri: str, fmt: str, text_field: str, endpoint_url: str | None, max_bytes: int, oversize: Oversize
) -> Iterator[tuple[int, str]]:
    if fmt == "txt":
        yield from iter_lines(uri, endpoint_url, max_bytes, oversize)
    elif fmt == "jsonl":
        for lineno, record in iter_records(uri, endpoint_url, max_bytes, oversize):
            value = record.get(text_field)
            if not isinstance(value, str):
                raise InputError(
                    f"field {text_field!r} missing or not a string (set text_field)", path=uri, line=lineno
                )
            yield lineno, value
    elif fmt == "tsv":
        for lineno, row in iter_tsv_records(uri, endpoint_url, max_bytes, oversize):
            if text_field not in row:
                raise InputError(
                    f"header has no column {text_field!r} (columns: {list(row)}); set text_field", path=uri, line=1
                )
            yield lineno, row[text_field]
    elif fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # an optional dependency outside the images (the tokenizer's `parquet` extra)
            raise InputError("reading parquet needs pyarrow installed", path=uri) from None

        path, filesystem = parquet_location(uri, endpoint_url)  # S3: read by ranges, a row group at a time
        try:
            pf = pq.ParquetFile(path, filesystem=filesystem, pre_buffer=False)  # no read-ahead of all groups
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            raise InputError(f"not a readable parquet file: {str(exc).splitlines()[0][:200]}", path=uri) from None
        if text_field not in pf.schema_arrow.names:
            raise InputError(f"no column {text_field!r} (columns: {pf.schema_arrow.names}); set text_field", path=uri)
        kind = pf.schema_arrow.field(text_field).type
        if not _is_text(kind):
            texts = [f.name for f in pf.schema_arrow if _is_text(f.type)]
            raise InputError(
                f"column {text_field!r} holds {kind}, not text (text columns: {texts}); set text_field", path=uri
            )
        row = 0
        try:
            for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
                for value in batch.column(0).to_pylist():
                    row += 1
                    if isinstance(value, str):
                        yield from _bounded_value(value, uri, row, max_bytes, oversize)
        except (OSError, ValueError) as exc:  # a damaged row group or page
            raise InputError(
                f"damaged parquet data after row {row}: {str(exc).splitlines()[0][:200]}", path=uri
            ) from None
    else:
        raise InputError(f"unknown format {fmt!r}", path=uri)


def _is_text(kind) -> bool:
    """An arrow type whose values are strings (plain, large, view, or dictionary-encoded)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _bounded_value(text: str, uri: str, row: int, max_bytes: int, oversize: Oversize) -> Iterator[tuple[int, str]]:
    """A parquet value (already in memory, as arrow hands it over) under the same policy as a line."""
    if len(text) * 4 <= max_bytes or len(text.encode("utf-8")) <= max_bytes:
        yield row, text
    elif oversize == "error":
        raise InputError(_OVERSIZE.format("value", max_bytes), path=uri, line=row)
    elif oversize == "truncate":
        yield row, _split_piece(text, max_bytes)[0]
    elif oversize == "split":
        while text:
            piece, text = _split_piece(text, max_bytes)
            yield row, piece


def iter_texts(uri: str, *args, **kwargs) -> Iterator[str]:
    """The texts of `iter_located_texts` (same arguments), without their locations."""
    return (text for _, _, text in iter_located_texts(uri, *args, **kwargs))


def iter_located_texts(
    uri: str,
    fmt: TextFormat = "auto",
    text_field: str = "text",
    endpoint_url: str | None = None,
    normalization: Literal["NFC", "none"] = "NFC",
    skip_empty: bool = True,
    max_document_bytes: int = MAX_DOCUMENT_BYTES,
    on_oversize: Oversize = "error",
) -> Iterator[tuple[str, int, str]]:
    """(file, line, text) for every document behind `uri`; the location serves error messages."""
    for file_uri in source_files(uri, endpoint_url):
        file_fmt = detect_format(file_uri) if fmt == "auto" else fmt
        for lineno, text in _iter_file(file_uri, file_fmt, text_field, endpoint_url, max_document_bytes, on_oversize):
            if normalization == "NFC":
                text = unicodedata.normalize("NFC", text)
            if skip_empty and not text.strip():
                continue
            yield file_uri, lineno, text
