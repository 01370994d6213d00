"""Tokenizer stage config."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .base import DataSource, StageConfig

# 256 byte symbols + Llama 3's 256 reserved/special tokens: the least a byte-level vocab can hold.
NUM_BYTE_SYMBOLS = 256
NUM_LLAMA3_SPECIAL_TOKENS = 256


class TokenizerConfig(StageConfig):
    stage: ClassVar[str] = "tokenizer"
    artifact_kind: ClassVar[str] = "tokenizer"
    consumes: ClassVar[tuple[str, ...]] = ("model",)

    strategy: Literal["base", "extend", "replace"] = Field(
        default="replace",
        description="base: measure base_tokenizer only; extend: append tokens learned on the corpus to "
        "base_tokenizer keeping every existing id; replace: a new byte-level BPE with Llama 3's "
        "pre-tokenizer, special tokens and chat template.",
    )
    corpora: list[DataSource] = Field(
        default_factory=list,
        description="Training corpora, streamed once and interleaved line by line. A source's `weight` is its "
        "upsampling factor: each training line is fed weight times (fractions by seeded sampling), e.g. weight 3 on "
        "general-domain files to offset a legal-heavy corpus. Held-out lines are never weighted.",
    )
    validation: list[DataSource] = Field(
        default_factory=list,
        description="Extra text sets to report fertility on (e.g. FLORES dev, text_field azj); read whole, never "
        "trained on. The held-out slice of the corpora is always reported as set 'heldout'.",
    )
    base_tokenizer: str | None = Field(
        default=None,
        description="HF tokenizer folder (with tokenizer.json), s3:// prefix or model artifact URI. Needed for base "
        "and extend unless the pipeline has a `model` stage (then its tokenizer is the base); with replace, its "
        "figures are reported beside the new tokenizer's.",
    )
    vocab_sizes: list[int] = Field(
        default=[50_000],
        description="Sweep of BPE vocab sizes (regular tokens incl. the 256 byte symbols; special tokens not "
        "counted). With extend, the size of the corpus BPE whose tokens missing from the base are appended. "
        "One training at the largest size serves every size (BPE merges are a prefix). Ignored by base.",
    )
    selection: Literal["smallest_within_tolerance", "largest"] = Field(
        default="smallest_within_tolerance",
        description="Rule that picks the published size from the sweep: the smallest size whose fertility on "
        "selection_set is at most (1 + selection_tolerance) x the sweep's best, or simply the largest.",
    )
    selection_tolerance: float = Field(default=0.02, ge=0, le=1, description="Relative fertility slack for the rule.")
    selection_set: str = Field(
        default="heldout",
        description="Text set whose fertility the rule reads: 'heldout' or the name of a validation set.",
    )
    min_frequency: int = Field(default=2, ge=1, description="BPE merges need at least this many occurrences.")
    validation_fraction: float = Field(
        default=0.02, gt=0, lt=0.5,
        description="Share of corpus lines held out (chosen by a seeded hash of the line, so duplicates land on "
        "the same side); held-out lines are never trained on.",
    )
    num_validation_lines: int = Field(default=2000, ge=1, description="At most this many held-out lines are measured.")
    max_lines: int | None = Field(default=None, ge=1, description="Read at most this many corpus lines (demos).")
    dedup: bool = Field(default=False, description="Drop exact duplicate lines (after normalisation).")
    normalization: Literal["NFC", "none"] = Field(default="NFC", description="Unicode normalisation of the corpus.")

    @field_validator("vocab_sizes")
    @classmethod
    def _check_sizes(cls, sizes: list[int], info: ValidationInfo) -> list[int]:
        strategy = info.data.get("strategy")
        if not sizes:
            raise ValueError("give at least one size")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"{sizes} lists a size twice")
        floor = NUM_BYTE_SYMBOLS + NUM_LLAMA3_SPECIAL_TOKENS
        for size in sizes:
            if strategy == "replace" and size <= floor:
                raise ValueError(f"{size} is not above the byte alphabet + special tokens ({NUM_BYTE_SYMBOLS} + "
                                 f"{NUM_LLAMA3_SPECIAL_TOKENS} = {floor})")
            if strategy == "extend" and size <= NUM_BYTE_SYMBOLS:
                raise ValueError(f"{size} is not above the byte alphabet ({NUM_BYTE_SYMBOLS})")
            if size <= 0:
                raise ValueError(f"{size} must be positive")
        return sizes

    @field_validator("selection_set")
    @classmethod
    def _check_selection_set(cls, name: str, info: ValidationInfo) -> str:
        names = ["heldout", *(v.label for v in info.data.get("validation") or [])]
        if len(set(names)) != len(names):
            raise ValueError(f"validation set names must be unique and not 'heldout' (got {names}); set `name`")
        if name not in names:
            raise ValueError(f"{name!r} is not one of {names}")
        return name

    @model_validator(mode="after")
    def _check(self) -> TokenizerConfig:
        if self.strategy in ("extend", "replace") and not self.corpora:
            raise ValueError(f"corpora: at least one corpus is needed with strategy {self.strategy!r}")
        return self

    def model_uris(self) -> list[str]:
        return [self.base_tokenizer] if self.base_tokenizer else []

    def needed_inputs(self) -> tuple[str, ...]:
        """base/extend without base_tokenizer read the tokenizer of the pipeline's `model` artifact."""
        if self.strategy in ("base", "extend") and not self.base_tokenizer:
            return (*self.required_inputs, "model")
        return self.required_inputs

    def data_sources(self) -> list[DataSource]:
        return [*self.corpora, *self.validation]
