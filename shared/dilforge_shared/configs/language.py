"""Language identification (lingua): curate's language filter, SFT's target language and eval's assistant figures
name languages with the same codes and settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from . import StrictModel

# the ISO 639-1 codes lingua-language-detector 2.1 detects
LinguaCode = Literal[
    "af", "ar", "az", "be", "bg", "bn", "bs", "ca", "cs", "cy", "da", "de", "el", "en", "eo", "es", "et", "eu", "fa", "fi", "fr", "ga", "gu", "he", "hi", "hr", "hu", "hy", "id", "is", "it", "ja", "ka", "kk", "ko", "la", "lg", "lt", "lv", "mi", "mk", "mn", "mr", "ms", "nb", "nl", "nn", "pa", "pl", "pt", "ro", "ru", "sk", "sl", "sn", "so", "sq", "sr", "st", "sv", "sw", "ta", "te", "th", "tl", "tn", "tr", "ts", "uk", "ur", "vi", "xh", "yo", "zh", "zu",
]  # fmt: skip


class LanguageConfig(StrictModel):
    min_score: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Keep a document when lingua's confidence in the target language is at least this "
        "(0-1, over the candidate languages; Turkish, English and Russian are among them).",
    )
    candidates: list[LinguaCode] = Field(
        default_factory=lambda: ["az", "tr", "en", "ru", "kk", "fa", "ar", "de", "fr", "es", "uk"],
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
