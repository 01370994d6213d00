"""How a tokenizer is measured on raw text, the same for the tokenizer and eval stages: fertility, bytes per
token, share of words split 3+ ways. A word is a `str.split()` run; tokens exclude added specials; fertility and
bytes/token are ratios of sums over the set; a token counts for every word its span overlaps."""

from __future__ import annotations

import itertools
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence

from .manifest import Metrics

Offsets = Sequence[tuple[int, int]]
EncodeOffsets = Callable[[list[str]], list[Offsets]]
"""A batch of texts → for each text, the (start, end) character span of each of its tokens."""

_WORD = re.compile(r"\S+")


class SetFigures(Metrics):
    """A tokenizer measured on one text set (`measure`); ratios are rounded to 4 digits, NaN on an empty set."""

    tokens_per_word: float
    bytes_per_token: float
    share_words_3plus: float
    num_texts: int
    num_words: int
    num_tokens: int
    num_bytes: int
    num_words_3plus: int


def tokens_per_word_span(text: str, offsets: Offsets) -> list[int]:
    """For each word of `text`, how many tokens overlap it: token (s, e) overlaps word (ws, we) when s < we and
    e > ws, which with offsets in order (as tokenizers give them) is bisect_left(starts, we) - bisect_right(ends, ws)."""
    offsets = [o for o in offsets if o[1] > o[0]]
    starts = [o[0] for o in offsets]
    ends = [o[1] for o in offsets]
    return [bisect_left(starts, we) - bisect_right(ends, ws) for ws, we in (m.span() for m in _WORD.finditer(text))]


def measure(texts: Iterable[str], encode: EncodeOffsets, batch_size: int = 256) -> SetFigures:
    """The figures of a text set under a tokenizer given as `encode` (see EncodeOffsets)."""
    num_texts = num_words = num_tokens = num_bytes = num_words_3plus = 0
    texts = iter(texts)
    while batch := list(itertools.islice(texts, batch_size)):
        for text, offsets in zip(batch, encode(batch), strict=False):
            per_word = tokens_per_word_span(text, offsets)
            num_texts += 1
            num_words += len(per_word)
            num_tokens += len(offsets)
            num_bytes += len(text.encode("utf-8"))
            num_words_3plus += sum(1 for c in per_word if c >= 3)

    def ratio(a: int, b: int) -> float:
        return round(a / b, 4) if b else float("nan")

    return SetFigures(
        tokens_per_word=ratio(num_tokens, num_words),
        bytes_per_token=ratio(num_bytes, num_tokens),
        share_words_3plus=ratio(num_words_3plus, num_words),
        num_texts=num_texts,
        num_words=num_words,
        num_tokens=num_tokens,
        num_bytes=num_bytes,
        num_words_3plus=num_words_3plus,
    )


def tokenizers_encoder(tokenizer) -> EncodeOffsets:
    """EncodeOffsets for a `tokenizers.Tokenizer` (no special tokens added)."""

    def encode(texts: list[str]) -> list[Offsets]:
        return [enc.offsets for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return encode
