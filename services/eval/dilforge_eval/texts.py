"""The eval stage's texts: text sets and aligned az/en parallel sets, read through the shared corpus readers and
capped by documents and bytes (a document never larger than the cap)."""

from __future__ import annotations

from itertools import zip_longest

from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import InputError


def _capped(source, max_bytes: int | None) -> dict:
    """Reader bounds: a document never larger than the set's byte cap (the first one is truncated to it)."""
    bounds = source.bounds
    if max_bytes is not None and max_bytes < bounds["max_document_bytes"]:
        bounds = {"max_document_bytes": max(max_bytes, 64), "on_oversize": "truncate"}
    return bounds


def read_set(source, max_docs: int | None, max_bytes: int | None, endpoint: str | None) -> list[str]:
    """Documents of a text set, stopping at max_docs or once max_bytes are reached (at least one doc)."""
    docs, size = [], 0
    for text in iter_texts(source.uri, source.format, source.text_field, endpoint, **_capped(source, max_bytes)):
        n = len(text.encode("utf-8")) + 1
        if docs and max_bytes is not None and size + n > max_bytes:
            break
        docs.append(text)
        size += n
        if max_docs is not None and len(docs) >= max_docs:
            break
    if not docs:
        raise InputError("text set holds no text", path=source.uri)
    return docs


def read_parallel(pset, max_docs: int | None, max_bytes: int | None, endpoint: str | None) -> list[tuple[str, str]]:
    """Aligned (az, en) pairs: line i of one side with line i of the other; capped like a text set. Both sides are
    streamed together; past the cap the rest is only counted (to check alignment), not kept."""
    az, en = (
        iter_texts(s.uri, s.format, s.text_field, endpoint, skip_empty=False, **_capped(s, max_bytes))
        for s in (pset.az, pset.en)
    )
    pairs: list[tuple[str, str]] = []
    size, full, num_az, num_en = 0, False, 0, 0
    for a, e in zip_longest(az, en):
        num_az += a is not None
        num_en += e is not None
        if full or a is None or e is None or not (a.strip() and e.strip()):
            continue
        n = len(a.encode("utf-8")) + 1
        if pairs and max_bytes is not None and size + n > max_bytes:
            full = True
            continue
        pairs.append((a, e))
        size += n
        full = max_docs is not None and len(pairs) >= max_docs
    if num_az != num_en:
        raise InputError(
            f"parallel set {pset.name!r}: {num_az} az documents but {num_en} en documents", path=pset.en.uri
        )
    if not pairs:
        raise InputError(f"parallel set {pset.name!r} holds no aligned pair", path=pset.az.uri)
    return pairs
