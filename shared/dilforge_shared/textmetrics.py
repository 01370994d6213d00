"""Tokenizer efficiency on raw text, the same for the tokenizer and eval stages: fertility, bytes per token, share
of words split 3+ ways. A word is a `str.split()` run; tokens exclude added specials; fertility and bytes/token are
ratios of sums over the set; a token counts for every word its span overlaps."""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

Offsets = Sequence[tuple[int, int]]
EncodeOffsets = Callable[[list[str]], list[Offsets]]
"""A batch of texts → for each text, the (start, end) character span of each of its tokens."""

_WORD = re.compile(r"\S+")


@dataclass
class TokenStats:
    """Sums over a text set, and their ratios."""

    num_texts: int = 0
    num_words: int = 0
    num_tokens: int = 0
    num_bytes: int = 0
    num_words_3plus: int = 0

    @property
    def tokens_per_word(self) -> float:
        return self.num_tokens / self.num_words if self.num_words else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / self.num_tokens if self.num_tokens else float("nan")

    @property
    def share_words_3plus(self) -> float:
        return self.num_words_3plus / self.num_words if self.num_words else float("nan")

    def summary(self, digits: int = 4) -> dict[str, float | int]:
        """Counts and ratios, for a manifest or a report table."""
        return {
            "tokens_per_word": round(self.tokens_per_word, digits),
            "bytes_per_token": round(self.bytes_per_token, digits),
            "share_words_3plus": round(self.share_words_3plus, digits),
            **asdict(self),
        }


def tokens_per_word_span(text: str, offsets: Offsets) -> list[int]:
    """For each word of `text`, how many tokens overlap it.

    A token (s, e) overlaps word (ws, we) when s < we and e > ws; with offsets in order (as
    tokenizers give them) that count is bisect_left(starts, we) - bisect_right(ends, ws).
    """
    offsets = [o for o in offsets if o[1] > o[0]]
    starts = [o[0] for o in offsets]
    ends = [o[1] for o in offsets]
    return [bisect_left(starts, we) - bisect_right(ends, ws) for ws, we in (m.span() for m in _WORD.finditer(text))]


def measure(texts: Iterable[str], encode: EncodeOffsets, batch_size: int = 256) -> TokenStats:
    """TokenStats of a text set under a tokenizer given as `encode` (see EncodeOffsets)."""
    total = TokenStats()
    batch: list[str] = []

    def flush() -> None:
        for text, offsets in zip(batch, encode(batch), strict=False):
            per_word = tokens_per_word_span(text, offsets)
            total.num_texts += 1
            total.num_words += len(per_word)
            total.num_tokens += len(offsets)
            total.num_bytes += len(text.encode("utf-8"))
            total.num_words_3plus += sum(1 for c in per_word if c >= 3)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    return total


def tokenizers_encoder(tokenizer) -> EncodeOffsets:
    """EncodeOffsets for a `tokenizers.Tokenizer` (no special tokens added)."""

    def encode(texts: list[str]) -> list[Offsets]:
        return [enc.offsets for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return encode
