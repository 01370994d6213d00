"""Curate stage config: raw web text → a clean, deduplicated, contact-free corpus (a `corpus` artifact).

Defaults for Azerbaijani start from FineWeb-2's (configs/azj_Latn.yml); the language-ID threshold: docs/curate.md."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from dilforge_shared.configs import RUN_ONLY, DataSource, StageConfig, StrictModel, check_unique_labels
from dilforge_shared.configs.language import CANDIDATES, LinguaCode
from pydantic import Field, field_validator, model_validator

from .metrics import CurateMetrics

# FineWeb-2's Azerbaijani stop words (configs/azj_Latn.yml)
AZ_STOPWORDS = (
    "və", "ilə", "ildə", "bir", "bu", "azərbaycan", "olan", "üçün", "sonra", "də", "kimi", "il", "isə", "o",
    "görə", "da", "tərəfindən", "çox", "ki", "onun", "edir", "idi",
)  # fmt: skip


NGram = Annotated[int, Field(ge=1, le=32)]  # words per n-gram; Gopher uses 2..10


class LanguageConfig(StrictModel):
    min_score: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Keep a document when lingua's confidence in the target language is at least this "
        "(0-1, over the candidate languages; Turkish, English and Russian are among them).",
    )
    candidates: list[LinguaCode] = Field(
        default_factory=lambda: list(CANDIDATES),
        min_length=2,
        description="ISO 639-1 codes lingua chooses among (the target language is added); fewer is faster.",
    )
    max_chars: int = Field(
        default=250,
        ge=100,
        le=100_000,
        description="Characters of each document the detector reads, from its start (measured: docs/curate.md).",
    )
    relatives: list[LinguaCode] = Field(
        default_factory=lambda: ["tr"],
        description="Close relatives lingua confuses the target with (Azerbaijani → Turkish on short texts, names "
        "and quotes). A document whose most likely language is one of them is still kept when the target's "
        "confidence is within relative_margin of it, or when at least 2 % of its letters are ones only the target "
        "writes among the candidates (Azerbaijani's ə; Turkish has none).",
    )
    relative_margin: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="How far below a relative's confidence the target's may be and the document still be kept.",
    )


class RawSource(DataSource):
    """A raw corpus to curate; its licence is carried into the artifact's data card."""

    format: Literal["auto", "txt", "jsonl", "tsv", "parquet"] = Field(
        default="auto", description="File format; 'auto' decides by extension (txt: one document per line)."
    )
    max_document_bytes: int = Field(
        default=2 << 20,
        ge=64,
        le=1 << 30,
        description="Longest document read, in UTF-8 bytes (default above quality.max_words); a longer one is "
        "handled by on_oversize in the reader, before any costlier step reads it.",
    )
    on_oversize: Literal["error", "split", "truncate", "skip"] = Field(
        default="skip",
        description="A document longer than max_document_bytes: skip it (logged), or error / split / truncate.",
    )
    name: str | None = Field(
        default=None,
        description="Short name: each output document's `source` and id prefix (defaults to the file name).",
    )
    licence: str | None = Field(default=None, description="Licence of the source, copied into the data card.")

    @field_validator("weight")
    @classmethod
    def _no_weight(cls, weight: float) -> float:
        """Curate mixes nothing: a weight would change the artifact id and nothing else."""
        if weight != 1.0:
            raise ValueError("curate reads every corpus whole (no mixture); remove `weight` (it is for the tokenizer "
                             "and CPT corpora)")  # fmt: skip
        return weight


class NormaliseConfig(StrictModel):
    fix_encoding: bool = Field(
        default=True, description="Repair mis-decoded text (UTF-8 read as Latin-1/cp1252, 'É™' → 'ə') with ftfy."
    )
    unicode_form: Literal["NFC", "NFKC", "none"] = Field(default="NFC", description="Unicode normal form.")
    whitespace: bool = Field(
        default=True, description="Strip lines, collapse runs of spaces and of blank lines, drop zero-width marks."
    )


class QualityConfig(StrictModel):
    """Gopher repetition and quality, and FineWeb line-level filters (FineWeb-2 azj_Latn values)."""

    min_words: int = Field(
        default=20,
        ge=0,
        description="Fewest words a document may have (shown in the data card). Gopher and FineWeb use 50, for "
        "English web pages; 20 keeps a low-resource language's short news paragraphs (docs/curate.md), the "
        "fewest the other filters can judge.",
    )
    max_words: int = Field(default=100_000, ge=1, description="Most words a document may have.")
    min_avg_word_length: float = Field(default=3, ge=0, description="Shortest mean word length (characters).")
    max_avg_word_length: float = Field(default=13, ge=1, description="Longest mean word length (characters).")
    max_symbol_word_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Most '#' and '...' per word (symbol spam)."
    )
    max_non_alpha_words_ratio: float = Field(
        default=0.725,
        ge=0,
        le=1,
        description="Fewest share of words that contain a letter (datatrove's name, despite the 'max').",
    )
    min_stop_words: int = Field(default=2, ge=0, description="Fewest stop words a document must contain.")
    stop_words: list[str] = Field(default_factory=lambda: list(AZ_STOPWORDS), description="The language's stop words.")
    dup_line_frac: float = Field(default=0.879, ge=0, le=1, description="Most share of duplicated lines.")
    top_n_grams: list[tuple[NGram, float]] = Field(
        default_factory=lambda: [(2, 0.514), (3, 0.475), (4, 0.405)],
        description="(n, most share of characters in the most frequent n-gram): word spam.",
    )
    dup_n_grams: list[tuple[NGram, float]] = Field(
        default_factory=lambda: [(5, 0.3), (6, 0.271), (7, 0.252), (8, 0.227), (9, 0.202), (10, 0.179)],
        description="(n, most share of characters in duplicated n-grams).",
    )
    line_punct_thr: float = Field(
        default=0.188,
        ge=0,
        le=1,
        description="Fewest share of a document's lines that end a sentence (menus end none; shown in the data "
        "card): a lone headline is dropped.",
    )
    line_end_closers: str = Field(
        default='»”"’)…',
        max_length=32,
        description="Characters that end a sentence besides datatrove's terminal punctuation: closing quotes and "
        "brackets after it (`«Bu, yaxşıdır.»`) and the ellipsis.",
    )
    short_line_thr: float = Field(default=0.67, ge=0, le=1, description="Most share of lines shorter than 30 chars.")
    char_duplicates_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Most share of characters in repeated lines."
    )
    new_line_ratio: float = Field(default=0.179, ge=0, le=1, description="Most line breaks per word (lists).")


class DedupConfig(StrictModel):
    """MinHash near-duplicate removal across every input (exact duplicates are the similarity-1 case)."""

    n_grams: int = Field(default=5, ge=1, le=32, description="Word n-gram (shingle) size.")
    num_buckets: int = Field(default=14, ge=1, le=64, description="LSH bands.")
    hashes_per_bucket: int = Field(default=8, ge=1, le=64, description="Rows per band.")


class RedactConfig(StrictModel):
    emails: bool = Field(default=True, description="Replace e-mail addresses.")
    phones: bool = Field(
        default=True,
        description="Replace phone numbers: Azerbaijani (+994 50 123 45 67, 050-123-45-67, (012) 493-12-34) and "
        "international (+ or 00 and 9-15 digits).",
    )
    cards: bool = Field(
        default=True,
        description="Replace payment card numbers (13-19 digits as cards print them, passing Luhn's check).",
    )
    email_placeholder: str = Field(default="<EMAIL>", min_length=1, max_length=32, description="E-mail replacement.")
    phone_placeholder: str = Field(default="<PHONE>", min_length=1, max_length=32, description="Phone replacement.")
    card_placeholder: str = Field(default="<CARD>", min_length=1, max_length=32, description="Card replacement.")

    @field_validator("email_placeholder", "phone_placeholder", "card_placeholder")
    @classmethod
    def _check_placeholder(cls, value: str) -> str:
        """A placeholder is written into every redacted document: not a control token (a turn boundary in
        training), nor '@' or digits (contact-like text)."""
        if "<|" in value or "|>" in value:
            raise ValueError(f"{value!r} is shaped like a control token; use plain text such as <EMAIL>")
        if "@" in value or "\uff20" in value or any(c.isdigit() for c in value):
            raise ValueError(f"{value!r} holds '@' or digits, as contact details do; use plain text such as <EMAIL>")
        if not value.isprintable() or value != value.strip():
            raise ValueError(f"{value!r} holds control characters or surrounding spaces")
        return value


class OutputConfig(StrictModel):
    format: Literal["jsonl", "parquet"] = Field(
        default="jsonl",
        description="Shard format, field `text`; uncompressed, so shards are byte-identical wherever they are made.",
    )
    num_shards: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Datatrove tasks, and so output shards, documents striped over them in input order (the output "
        "does not depend on how many workers or instances run them).",
    )
    num_examples: int = Field(default=3, ge=0, le=50, description="Removed documents the report shows per step.")


class CurateConfig(StageConfig):
    stage: ClassVar[str] = "curate"
    metrics_model: ClassVar[type[CurateMetrics]] = CurateMetrics
    artifact_kind: ClassVar[str] = "corpus"
    # optional upstream: a `model` artifact whose tokenizer counts the output's tokens (else `tokenizer`)
    consumes: ClassVar[tuple[str, ...]] = ("model",)

    corpora: list[RawSource] = Field(min_length=1, description="Raw corpora, read in order and curated together.")
    language: LinguaCode = Field(default="az", description="Target language, ISO 639-1 (lingua's codes).")
    normalise: NormaliseConfig = Field(default_factory=NormaliseConfig, description="Encoding and Unicode repair.")
    language_id: LanguageConfig = Field(default_factory=LanguageConfig, description="Language identification.")
    quality: QualityConfig = Field(default_factory=QualityConfig, description="Quality heuristics.")
    dedup: DedupConfig = Field(default_factory=DedupConfig, description="Near-duplicate removal.")
    redact: RedactConfig = Field(default_factory=RedactConfig, description="Contact details replaced.")
    output: OutputConfig = Field(default_factory=OutputConfig, description="Shards and report.")
    tokenizer: str | None = Field(
        default=None,
        description="HF tokenizer folder (tokenizer.json) counting the output's tokens; default: the pipeline's "
        "`model` artifact's tokenizer, else no token counts.",
    )
    num_workers: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        json_schema_extra=RUN_ONLY,
        description="Processes running the datatrove tasks on each machine; default one per core this process may "
        "use (its CPU affinity), at most the tasks of the widest phase.",
    )

    @field_validator("seed")
    @classmethod
    def _no_seed(cls, seed: int) -> int:
        """Curate makes no random choice: a seed would change the artifact id and nothing else."""
        if seed != 0:
            raise ValueError("curate makes no random choice (fixed MinHash hashes, documents striped by position); "
                             "remove `seed`")  # fmt: skip
        return seed

    @model_validator(mode="after")
    def _check(self) -> CurateConfig:
        check_unique_labels(self.corpora, "corpora")
        if self.quality.min_words > self.quality.max_words:
            raise ValueError("quality.min_words exceeds quality.max_words")
        return self

    def data_sources(self) -> list[DataSource]:
        return list(self.corpora)

    def model_uris(self) -> list[str]:
        return [self.tokenizer] if self.tokenizer else []
