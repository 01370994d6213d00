"""The tokenizer stage's metrics: the strategies compared, the vocabulary sweep, the base's figures."""

from __future__ import annotations

from typing import Any

from dilforge_shared.fertility import SetFigures
from dilforge_shared.manifest import Metrics
from pydantic import Field


class LanguageFigures(Metrics):
    """The headline figures of one validation set (tokenizer report.language_figures)."""

    tokens_per_word: float
    bytes_per_token: float
    frac_words_3plus: float


class StrategyRow(Metrics):
    """One strategy's candidate in the side-by-side comparison (`languages`: per validation set)."""

    strategy: str
    vocab_size: int
    num_new_tokens: int
    selected: bool
    languages: dict[str, LanguageFigures]
    dead_new_tokens_frac: float | None = None


class SweepRow(Metrics):
    """One candidate size of the configured strategy: replace records its regular vocabulary, extend the
    number of tokens it added."""

    vocab_size: int
    vocab_size_total: int | None = None
    vocab_size_regular: int | None = None
    num_added_tokens: int | None = None
    sets: dict[str, SetFigures]


class TokenizerBase(Metrics):
    uri: str
    sets: dict[str, SetFigures]


class TokenizerMetrics(Metrics):
    strategy: str
    family: str
    selected_vocab_size: int | None
    selection: dict[str, Any]
    word_definition: str
    comparison: list[StrategyRow]
    languages: dict[str, LanguageFigures]
    dead_tokens: dict[str, Any] = Field(description="The dead-token audit of the published tokenizer.")
    sweep: list[SweepRow]
    base: TokenizerBase | None = None
    output: dict[str, Any]
    corpus: dict[str, Any]
    seconds: dict[str, float]
    peak_rss_mib: float
