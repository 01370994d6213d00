"""Assistant measures on held-out user turns (docs/eval.md): answers in the prompt's language (lingua), ending
the turn, looping, parroting, each a share with its 95 % Wilson interval, and chrF++ where references exist."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib.resources import files

from dilforge_shared.corpus import iter_records
from dilforge_shared.errors import InputError

from .metrics import AssistantFigures, ChrfFigures, Share
from .morph import az_lower

LOOP_RATE = 0.3
PARROT_SHARE = 0.8
CHRF_BOOTSTRAP = 1000
PLAIN_SUFFIX = "-no-diacritics"
_WORDS = re.compile(r"\w+")
_PLAIN = str.maketrans("əıışçğöüƏİŞÇĞÖÜ", "eiiscgouEISCGOU")


@dataclass(frozen=True)
class AssistantPrompt:
    """One held-out user turn: its language and an optional reference answer."""

    id: str
    language: str
    prompt: str
    reference: str | None = None


@dataclass(frozen=True)
class Answer:
    """A model's answer to one prompt, as `score` reads it."""

    prompt: str
    answer: str
    language: str
    ended_turn: bool
    reference: str | None = None


def prompt_records(uri: str, endpoint_url: str | None) -> Iterator[tuple[str, int, dict, str, str]]:
    """(file, line, record, id, prompt) of a JSONL prompts file, each prompt non-empty and each id unique; a file
    without a prompt is an error. `builtin:NAME` is one shipped in this package (in every image and job)."""
    if uri.startswith("builtin:"):
        shipped = files("dilforge_eval") / "prompts"
        name = uri.removeprefix("builtin:")
        path = shipped / f"{name}.jsonl"
        if not path.is_file():
            names = sorted(p.name.removesuffix(".jsonl") for p in shipped.iterdir())
            raise InputError(f"no built-in prompts {name!r}; built-in: {names}", path=uri)
        uri = str(path)
    seen: set[str] = set()
    for lineno, rec in iter_records(uri, endpoint_url):
        text = rec.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise InputError("field 'prompt' missing or empty", path=uri, line=lineno)
        pid = str(rec.get("id", f"line{lineno}"))
        if pid in seen:
            raise InputError(f"duplicate prompt id {pid!r}", path=uri, line=lineno)
        seen.add(pid)
        yield uri, lineno, rec, pid, text
    if not seen:
        raise InputError("prompts file holds no prompt", path=uri)


def load_prompts(uri: str, per_language: int | None = None, endpoint_url: str | None = None) -> list[AssistantPrompt]:
    """JSONL {id, language, prompt, reference?}, the first `per_language` of each language; errors name the file
    and line."""
    out: list[AssistantPrompt] = []
    counts: Counter[str] = Counter()
    for path, lineno, rec, pid, text in prompt_records(uri, endpoint_url):
        lang, ref = rec.get("language"), rec.get("reference")
        if not isinstance(lang, str) or not re.fullmatch(r"[a-z]{2}", lang):
            raise InputError(f"field 'language' must be a 2-letter code, got {lang!r}", path=path, line=lineno)
        if ref is not None and (not isinstance(ref, str) or not ref.strip()):
            raise InputError("field 'reference' must be a non-empty string when given", path=path, line=lineno)
        if per_language is None or counts[lang] < per_language:
            counts[lang] += 1
            out.append(AssistantPrompt(pid, lang, text, ref))
    return out


def without_diacritics(text: str) -> str:
    """The text typed on a keyboard without Azerbaijani letters: ə→e, ı→i, ş→s, ç→c, ğ→g, ö→o, ü→u."""
    return text.translate(_PLAIN)


def plain_variant(prompts: Iterable[AssistantPrompt], language: str = "az") -> list[AssistantPrompt]:
    """The `language` prompts typed without diacritics (ids suffixed); references are kept as written."""
    return [
        replace(p, id=p.id + PLAIN_SUFFIX, prompt=without_diacritics(p.prompt))
        for p in prompts
        if p.language == language
    ]


def groups(
    prompts: Sequence[AssistantPrompt], target_language: str = "az", no_diacritics: bool = True
) -> dict[str, list[AssistantPrompt]]:
    """Prompt group -> prompts: one group per language, then (`no_diacritics`) the target language without them."""
    out: dict[str, list[AssistantPrompt]] = {}
    for p in prompts:
        out.setdefault(p.language, []).append(p)
    if no_diacritics and (plain := plain_variant(out.get(target_language, []), target_language)):
        out[target_language + PLAIN_SUFFIX] = plain
    return out


def words(text: str) -> list[str]:
    """Lower-cased words (Azerbaijani I → ı, İ → i)."""
    return _WORDS.findall(az_lower(text))


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def repeated_ngram_rate(tokens: list[str], n: int = 3) -> float | None:
    """Share of n-gram occurrences that repeat an n-gram seen earlier in the same text (None: no n-gram)."""
    grams = ngrams(tokens, n)
    if not grams:
        return None
    return sum(c - 1 for c in Counter(grams).values()) / len(grams)


def loops(answer: str) -> bool:
    """At least LOOP_RATE of the answer's word 3-grams repeat an earlier one."""
    rate = repeated_ngram_rate(words(answer), 3)
    return rate is not None and rate >= LOOP_RATE


def parrots(prompt: str, answer: str) -> bool:
    """At least PARROT_SHARE of the answer's words lie in a word 3-gram (under 3 words: the whole answer) that
    also occurs in the prompt."""
    ans, src = words(answer), words(prompt)
    if not ans:
        return False
    n = min(3, len(ans))
    known = set(ngrams(src, n))
    covered = [False] * len(ans)
    for i, gram in enumerate(ngrams(ans, n)):
        if gram in known:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(ans) >= PARROT_SHARE


@lru_cache(maxsize=1)
def _detector():
    """lingua over curate's candidate languages (built once: loading its models takes seconds)."""
    from dilforge_shared.configs.language import CANDIDATES
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

    codes = sorted(set(CANDIDATES) | {"az", "en"})
    languages = [Language.from_iso_code_639_1(getattr(IsoCode639_1, c.upper())) for c in codes]
    return LanguageDetectorBuilder.from_languages(*languages).build()


def detect_language(text: str) -> str | None:
    """The answer's most likely language (ISO 639-1), None for an empty or undecidable text."""
    if not text.strip():
        return None
    found = _detector().detect_language_of(text)
    return found.iso_code_639_1.name.lower() if found is not None else None


def wilson(count: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion count/n (95 % by default): inside [0, 1], sensible at 0 and n."""
    p = count / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def share(flags: Sequence[bool]) -> Share:
    """How many flags are true, as a share with its Wilson interval."""
    n, count = len(flags), sum(bool(f) for f in flags)
    if n == 0:
        return Share(count=0, n=0, value=None, low=None, high=None)
    low, high = wilson(count, n)
    return Share(count=count, n=n, value=round(count / n, 4), low=round(low, 4), high=round(high, 4))


def chrf(answers: Sequence[Answer]) -> ChrfFigures | None:
    """Corpus chrF++ of the answers with a reference, and its bootstrap 95 % interval (needs ≥ 2 of them)."""
    from sacrebleu.metrics import CHRF

    pairs = [(a.answer, a.reference) for a in answers if a.reference]
    if not pairs:
        return None
    hyps, refs = [h for h, _ in pairs], [r for _, r in pairs]
    metric = CHRF(word_order=2)
    if len(pairs) < 2:
        return ChrfFigures(score=round(metric.corpus_score(hyps, [refs]).score, 2), low=None, high=None, n=1)
    res = metric.corpus_score(hyps, [refs], n_bootstrap=CHRF_BOOTSTRAP)
    mean, half = float(res._mean), float(res._ci)  # sacrebleu's bootstrap: mean and 95 % half-width
    return ChrfFigures(
        score=round(res.score, 2),
        low=round(max(0.0, mean - half), 2),
        high=round(min(100.0, mean + half), 2),
        n=len(pairs),
    )


def score(answers: Sequence[Answer]) -> AssistantFigures:
    """Every measure over one group's answers (non-empty, all of them in the same expected language)."""
    return AssistantFigures(
        language=answers[0].language,
        n=len(answers),
        in_language=share([detect_language(a.answer) == a.language for a in answers]),
        ended_turn=share([a.ended_turn for a in answers]),
        looping=share([loops(a.answer) for a in answers]),
        parroting=share([parrots(a.prompt, a.answer) for a in answers]),
        chrf=chrf(answers),
    )
