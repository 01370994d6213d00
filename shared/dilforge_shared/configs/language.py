"""Language identification (lingua): curate's language filter, SFT's target language and eval's assistant figures
name languages with the same codes and choose among the same default candidates."""

from __future__ import annotations

from typing import Literal

# the ISO 639-1 codes lingua-language-detector 2.1 detects
LinguaCode = Literal[
    "af", "ar", "az", "be", "bg", "bn", "bs", "ca", "cs", "cy", "da", "de", "el", "en", "eo", "es", "et", "eu", "fa", "fi", "fr", "ga", "gu", "he", "hi", "hr", "hu", "hy", "id", "is", "it", "ja", "ka", "kk", "ko", "la", "lg", "lt", "lv", "mi", "mk", "mn", "mr", "ms", "nb", "nl", "nn", "pa", "pl", "pt", "ro", "ru", "sk", "sl", "sn", "so", "sq", "sr", "st", "sv", "sw", "ta", "te", "th", "tl", "tn", "tr", "ts", "uk", "ur", "vi", "xh", "yo", "zh", "zu",
]  # fmt: skip

# the languages lingua chooses among by default (curate adds its target language)
CANDIDATES = ("az", "tr", "en", "ru", "kk", "fa", "ar", "de", "fr", "es", "uk")
