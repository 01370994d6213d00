"""Tokenizer stage config."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from dilforge_shared.configs import DataSource, StageConfig, check_unique_labels
from pydantic import Field, ValidationInfo, field_validator, model_validator

from .metrics import TokenizerMetrics

# 256 byte symbols + Llama 3's 256 reserved/special tokens: the least a byte-level vocab can hold.
NUM_BYTE_SYMBOLS = 256
NUM_LLAMA3_SPECIAL_TOKENS = 256
MAX_VOCAB = 1_048_576  # far above any real vocabulary: a typo such as 1e9 is refused


class CorpusSource(DataSource):
    """A tokenizer training corpus: any text format, or a word-frequency list (`word_counts`)."""

    format: Literal["auto", "txt", "jsonl", "tsv", "parquet", "word_counts"] = Field(
        default="auto",
        description="File format; 'auto' decides by extension. word_counts: one `WORD COUNT` per line, each word "
        "fed as inside running text, count x weight times; never held out, deduplicated or cut by max_lines.",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        description="Upsampling factor: each training line is fed weight times (fractions by seeded sampling); for a "
        "word_counts list, the factor on its counts.",
    )
    recase: bool = Field(
        default=False,
        description="word_counts only, for a lowercased list: feed each word in the form the text corpora use most "
        "often inside sentences ('rusiya' as 'Rusiya'; I/ı and İ/i matched as in Azerbaijani); other words as listed.",
    )

    @model_validator(mode="after")
    def _check_recase(self) -> CorpusSource:
        if self.recase and self.format != "word_counts":
            raise ValueError(f"recase applies to word_counts lists only (format is {self.format!r})")
        return self


class TokenizerConfig(StageConfig):
    stage: ClassVar[str] = "tokenizer"
    metrics_model: ClassVar[type[TokenizerMetrics]] = TokenizerMetrics
    artifact_kind: ClassVar[str] = "tokenizer"
    # optional upstream: a `model` artifact whose HF folder's tokenizer is the base (else base_tokenizer)
    consumes: ClassVar[tuple[str, ...]] = ("model",)

    strategy: Literal["base", "extend", "replace"] = Field(
        default="replace",
        description="The strategy whose tokenizer is published. base: measure the base tokenizer only; extend: "
        "continue the base's BPE training on the corpus (new merges learned over the base's own segmentation, "
        "appended after its merges) keeping every existing id; replace: a new byte-level BPE with Llama 3's "
        "pre-tokenizer and the base family's special tokens and chat template (Llama 3 without a base).",
    )
    compare_with: list[Literal["base", "extend", "replace"]] = Field(
        default_factory=list,
        description="Other strategies to train and measure beside `strategy` (not published), at their sizes "
        "(`vocab_sizes` for replace, `num_new_tokens` for extend), for the side-by-side comparison table.",
    )
    corpora: list[CorpusSource] = Field(
        default_factory=list,
        description="Training corpora, streamed once and interleaved line by line, each line fed `weight` times "
        "(held-out lines are never weighted).",
    )
    validation: list[DataSource] = Field(
        default_factory=list,
        description="Language sets to report every figure on, one per language (e.g. FLORES dev, text_field "
        "azj_Latn, name az; the same file, text_field eng_Latn, name en); read whole, never trained on. The held-out "
        "slice of the corpora is also reported, as set 'heldout'.",
    )
    base_tokenizer: str | None = Field(
        default=None,
        description="HF tokenizer folder (with tokenizer.json) or s3:// prefix of one. The base for base and "
        "extend (else the upstream `model` artifact's tokenizer); with replace, its figures are reported beside "
        "the new tokenizer's and its family's special tokens and chat template are used.",
    )
    vocab_sizes: list[Annotated[int, Field(le=MAX_VOCAB)]] = Field(
        default=[50_000],
        description="replace: sweep of BPE vocab sizes (regular tokens incl. the 256 byte symbols; special "
        "tokens not counted). One training at the largest size serves every size (BPE merges are a prefix).",
    )
    num_new_tokens: list[Annotated[int, Field(le=MAX_VOCAB)]] = Field(
        default=[32_000],
        description="extend: sweep of the number of new tokens appended to the base. One continued training at "
        "the largest serves every size (each is a prefix of the same merge list).",
    )
    selection: Literal["smallest_within_tolerance", "largest"] = Field(
        default="smallest_within_tolerance",
        description="Rule that picks the published size from the sweep: the smallest size whose fertility on "
        "selection_set is at most (1 + selection_tolerance) x the sweep's best, or simply the largest; both "
        "among the sizes that pass retain_set.",
    )
    selection_tolerance: float = Field(default=0.02, ge=0, le=1, description="Relative fertility slack for the rule.")
    selection_set: str = Field(
        default="heldout",
        description="Text set whose fertility the rule reads: 'heldout' or the name of a validation set.",
    )
    retain_set: str | None = Field(
        default=None,
        description="A language set that must not get worse, e.g. 'en': only sizes whose tokens/word on it are "
        "at most (1 + retain_tolerance) x the base tokenizer's are eligible (needs a base). When no size passes, "
        "the one closest to the bound is published and metrics.selection.retain_met is false.",
    )
    retain_tolerance: float = Field(default=0.01, ge=0, le=10, description="Relative slack of retain_set.")
    prune_dead: bool = Field(
        default=False,
        description="Drop new tokens never produced on the training corpus before publishing (and their merges), "
        "unless a kept token is built from them; for extend also rarely used tokens that alone hold such dead "
        "intermediates, then refill with further merges up to the size. Kept base ids never change, new ids "
        "stay in order.",
    )
    digit_tokens: Literal["as_base", "learn"] = Field(
        default="as_base",
        description="extend: 'as_base' learns no merge involving a base token that holds a digit, so numbers encode "
        "exactly as the base encodes them in every language (new digit tokens re-encode English numbers: "
        "docs/cpt.md, leakage). 'learn': digits merge like any other text. replace ignores it.",
    )
    min_frequency: int = Field(
        le=1_000_000, default=2, ge=1, description="BPE merges need at least this many occurrences."
    )
    validation_fraction: float = Field(
        default=0.02,
        gt=0,
        lt=0.5,
        description="Share of corpus lines held out (chosen by a seeded hash of the line, so duplicates land on "
        "the same side); held-out lines are never trained on.",
    )
    num_validation_lines: int = Field(
        le=10_000_000, default=2000, ge=1, description="At most this many held-out lines are measured."
    )
    max_lines: int | None = Field(
        default=None, ge=1, description="Read at most this many corpus text lines (demos); word lists are read whole."
    )
    dedup: bool = Field(
        default=False,
        description="Drop exact duplicate lines (after normalisation); holds a digest per distinct line in memory, "
        "so on a corpus of many GB prefer the curate stage's deduplication.",
    )
    max_pretokens: int = Field(
        default=1_000_000,
        ge=1000,
        le=1_000_000_000,
        description="Memory budget of the corpus pass and of training, in distinct pre-tokens per pre-tokenizer, "
        "whatever the corpus size (docs/tokenizer.md: memory). Past it the rarest are dropped (those "
        "counted at most t times, t = 1, 2, ... until half the budget remains), logged and recorded in "
        "metrics.corpus.pretokens.",
    )
    normalization: Literal["NFC", "none"] = Field(default="NFC", description="Unicode normalisation of the corpus.")

    @field_validator("vocab_sizes", "num_new_tokens")
    @classmethod
    def _check_sizes(cls, sizes: list[int], info: ValidationInfo) -> list[int]:
        if not sizes:
            raise ValueError("give at least one size")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"{sizes} lists a size twice")
        floor = NUM_BYTE_SYMBOLS + NUM_LLAMA3_SPECIAL_TOKENS
        replace = "replace" in [info.data.get("strategy"), *(info.data.get("compare_with") or [])]
        for size in sizes:
            if info.field_name == "vocab_sizes" and replace and size <= floor:
                raise ValueError(
                    f"{size} is not above the byte alphabet + special tokens ({NUM_BYTE_SYMBOLS} + "
                    f"{NUM_LLAMA3_SPECIAL_TOKENS} = {floor})"
                )
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
        # base/extend without base_tokenizer need the upstream `model` input: checked when the stage starts
        for strategy in self.strategies:
            if strategy in ("extend", "replace") and not self.corpora:
                raise ValueError(f"corpora: at least one corpus is needed with strategy {strategy!r}")
        check_unique_labels(self.corpora, "corpora")
        if self.retain_set is not None:
            names = [v.label for v in self.validation]
            if self.retain_set not in names:
                raise ValueError(f"retain_set {self.retain_set!r} is not a validation set name ({names})")
        return self

    @property
    def strategies(self) -> list[str]:
        """The published strategy first, then the compared ones (each once)."""
        return list(dict.fromkeys([self.strategy, *self.compare_with]))

    def model_uris(self) -> list[str]:
        return [self.base_tokenizer] if self.base_tokenizer else []

    def needed_inputs(self) -> tuple[str, ...]:
        """base/extend without base_tokenizer read the tokenizer of the pipeline's `model` artifact."""
        if {"base", "extend"} & set(self.strategies) and not self.base_tokenizer:
            return (*super().needed_inputs(), "model")
        return super().needed_inputs()

    def missing_inputs_message(self, missing: list[str]) -> str:
        if "model" in missing:
            strategy = next(s for s in self.strategies if s in ("base", "extend"))
            return (
                f"tokenizer.base_tokenizer: strategy {strategy!r} needs a base tokenizer: set base_tokenizer "
                "or run a model stage upstream (input 'model')"
            )
        return super().missing_inputs_message(missing)

    def data_sources(self) -> list[DataSource]:
        return [*self.corpora, *self.validation]
