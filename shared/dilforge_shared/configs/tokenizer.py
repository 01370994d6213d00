"""Tokenizer stage config."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from .base import DataSource, StageConfig

# 256 byte symbols + Llama 3's 256 reserved/special tokens: the least a byte-level vocab can hold.
NUM_BYTE_SYMBOLS = 256
NUM_LLAMA3_SPECIAL_TOKENS = 256


class TokenizerConfig(StageConfig):
    stage: ClassVar[str] = "tokenizer"
    artifact_kind: ClassVar[str] = "tokenizer"

    strategy: Literal["base", "extend", "replace"] = Field(
        default="replace",
        description="base: measure base_tokenizer only; extend: append tokens learned on the corpus to "
        "base_tokenizer keeping every existing id; replace: a new byte-level BPE with Llama 3's "
        "pre-tokenizer, special tokens and chat template.",
    )
    corpora: list[DataSource] = Field(default_factory=list, description="Training corpora (streamed).")
    validation: list[DataSource] = Field(
        default_factory=list,
        description="Extra text sets to report fertility on (e.g. FLORES dev); the held-out slice is always reported.",
    )
    base_tokenizer: str | None = Field(
        default=None,
        description="HF tokenizer folder or s3:// prefix. Required for base and extend; with replace, its "
        "figures are reported beside the new tokenizer's.",
    )
    vocab_sizes: list[int] = Field(
        default=[50_000],
        description="Sweep of BPE vocab sizes (regular tokens, special tokens not counted). With extend, "
        "the size of the corpus BPE whose tokens missing from the base are appended.",
    )
    selection: Literal["smallest_within_tolerance", "largest"] = Field(
        default="smallest_within_tolerance",
        description="Rule that picks the published size from the sweep: the smallest size whose fertility on "
        "the held-out slice is within selection_tolerance of the sweep's best, or simply the largest.",
    )
    selection_tolerance: float = Field(default=0.02, ge=0, le=1, description="Relative fertility slack for the rule.")
    min_frequency: int = Field(default=2, ge=1, description="BPE merges need at least this many occurrences.")
    num_validation_lines: int = Field(default=2000, ge=0, description="Lines held out from the corpus for metrics.")
    max_lines: int | None = Field(default=None, ge=1, description="Read at most this many corpus lines (demos).")
    dedup: bool = Field(default=False, description="Drop exact duplicate lines (after normalisation).")
    normalization: Literal["NFC", "none"] = Field(default="NFC", description="Unicode normalisation of the corpus.")

    @model_validator(mode="after")
    def _check(self) -> "TokenizerConfig":
        if self.strategy in ("base", "extend") and not self.base_tokenizer:
            raise ValueError(f"base_tokenizer is required with strategy {self.strategy!r}")
        if self.strategy in ("extend", "replace") and not self.corpora:
            raise ValueError(f"corpora: at least one corpus is needed with strategy {self.strategy!r}")
        if not self.vocab_sizes:
            raise ValueError("vocab_sizes: give at least one size")
        floor = NUM_BYTE_SYMBOLS + NUM_LLAMA3_SPECIAL_TOKENS
        for size in self.vocab_sizes:
            if self.strategy == "replace" and size <= floor:
                raise ValueError(
                    f"vocab_sizes: {size} is not above the byte alphabet + special tokens ({NUM_BYTE_SYMBOLS} + "
                    f"{NUM_LLAMA3_SPECIAL_TOKENS} = {floor})"
                )
            if size <= 0:
                raise ValueError(f"vocab_sizes: {size} must be positive")
        return self

    def data_sources(self) -> list[DataSource]:
        return [*self.corpora, *self.validation]
