"""Functions the dilforge task configs name with `!function utils.NAME` (lm-eval loads this file beside the YAML).

Standard library only, so the shipped configs run under a stock `lm_eval`. Language ID without a model:
Azerbaijani letters and each language's frequent function words (checked by bench/langid_check.py)."""

from __future__ import annotations

import re
from collections import Counter

_WORD = re.compile(r"[^\W\d_]+")
AZ_LETTERS = frozenset("əğışçöü")
# the most frequent Azerbaijani and English function words (no overlap between the lists)
AZ_WORDS = frozenset([
    "və", "bu", "bir", "ki", "ilə", "üçün", "də", "da", "olan", "olaraq", "isə", "ən", "daha", "çox", "kimi",
    "onun", "onlar", "o", "ya", "həm", "amma", "lakin", "belə", "sonra", "əvvəl", "görə", "qədər", "hər", "hansı",
    "nə", "niyə", "necə", "var", "yox", "deyil", "idi", "edir", "etdi", "olur", "oldu", "olub", "ola", "etmək",
    "bilər", "mən", "sən", "biz", "siz", "artıq", "yalnız", "bəzi", "bütün", "çünki", "əgər",
])  # fmt: skip
EN_WORDS = frozenset([
    "the", "of", "and", "to", "in", "is", "a", "that", "for", "it", "was", "on", "with", "as", "by", "are", "be",
    "this", "at", "from", "or", "an", "have", "has", "had", "which", "not", "but", "were", "they", "their", "its",
    "he", "she", "his", "her", "we", "you", "will", "would", "can", "been", "there", "who", "what", "when", "all",
    "more", "one", "about", "also", "into", "than", "some",
])  # fmt: skip


def az_lower(text: str) -> str:
    """Lowercase with Azerbaijani dotted/dotless i (I -> ı, İ -> i)."""
    return text.replace("I", "ı").replace("İ", "i").lower()


def language_scores(text: str) -> dict[str, float]:
    """Letter and function-word statistics of a text (lowercased, Azerbaijani-aware)."""
    low = az_lower(text)
    # letters without the I -> ı mapping: an English "I" or "It" is no Azerbaijani dotless i
    letters = [c for c in text.replace("İ", "i").lower() if c.isalpha()]
    words = _WORD.findall(low)
    latin = sum(1 for c in letters if c.isascii() or c in AZ_LETTERS)
    return {
        "num_letters": len(letters),
        "num_words": len(words),
        "latin": latin / len(letters) if letters else 0.0,
        "ascii": sum(1 for c in letters if c.isascii()) / len(letters) if letters else 0.0,
        "az_letters": sum(1 for c in letters if c in AZ_LETTERS) / len(letters) if letters else 0.0,
        "w": low.count("w") / len(letters) if letters else 0.0,
        "az_words": sum(1 for w in words if w in AZ_WORDS) / len(words) if words else 0.0,
        "en_words": sum(1 for w in words if w in EN_WORDS) / len(words) if words else 0.0,
    }


def detect_language(text: str) -> str:
    """'az', 'en' or 'other' (no letters, or mostly a non-Latin script).

    Azerbaijani when its letters (x10) and function words outweigh English function words and 'w' (absent
    from Azerbaijani, x5); a Latin text with neither signal is English when all its letters are ASCII (a
    sentence of Azerbaijani without one of ə ğ ı ş ç ö ü is rare: ə alone is about 8 % of its letters).
    """
    s = language_scores(text)
    if s["num_letters"] == 0 or s["latin"] < 0.5:
        return "other"
    az = 10 * s["az_letters"] + s["az_words"]
    en = s["en_words"] + 5 * s["w"]
    if az == en == 0:
        return "en" if s["ascii"] == 1.0 else "other"
    return "az" if az > en else "en"


def repeated_ngram_rate(text: str, n: int = 3) -> float:
    """Share of word n-gram occurrences repeating an n-gram seen earlier in the same text (0 = no loop)."""
    words = _WORD.findall(az_lower(text))
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return sum(c - 1 for c in Counter(grams).values()) / len(grams)


def _instruction_results(doc: dict, results: list[str], language: str) -> dict:
    answer = results[0]
    return {
        "chrf++": (doc["response"], answer),
        "answer_in_language": float(detect_language(answer) == language),
        "repetition_rate": repeated_ngram_rate(answer),
        "empty_answer": float(not answer.strip()),
    }


def process_instruction_az(doc: dict, results: list[str]) -> dict:
    return _instruction_results(doc, results, "az")


def process_instruction_en(doc: dict, results: list[str]) -> dict:
    return _instruction_results(doc, results, "en")


# TUMLU layout: question, choices (2-5), answer (letter); the prompt of the TUMLU paper's evaluation
TUMLU_PROMPT = {
    "az": ("Aşağıdakı sual çoxvariantlı sualdır. Düzgün cavabı seçin:\n\n", "Cavab:"),
    "en": ("The following is a multiple choice question. Choose the correct answer:\n\n", "Answer:"),
}
LETTERS = "ABCDE"


def _tumlu_text(doc: dict, language: str) -> str:
    instruction, answer = TUMLU_PROMPT.get(language, TUMLU_PROMPT["en"])
    options = "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(doc["choices"]))
    return f"{instruction}{doc['question']}\n{options}{answer}"


def tumlu_text_az(doc: dict) -> str:
    return _tumlu_text(doc, "az")


def tumlu_text_en(doc: dict) -> str:
    return _tumlu_text(doc, "en")


def tumlu_choices(doc: dict) -> list[str]:
    return list(LETTERS[: len(doc["choices"])])


def tumlu_target(doc: dict) -> int:
    return LETTERS.index(doc["answer"])
