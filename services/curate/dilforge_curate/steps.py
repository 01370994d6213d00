"""The datatrove pipeline steps datatrove lacks for this stage, and faster equivalents of three of its own.

Readers of dilforge's corpora (s3fs cannot sit beside the pinned boto3), encoding and whitespace repair, lingua
with bundled models, contact redaction; `RepetitionFilter`, `QualityFilter` and `MinhashSignature` decide as
datatrove's own at less CPU (tests/unit/test_curate_steps.py)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import operator
import re
import unicodedata
from collections import Counter

import ftfy
import numpy as np
import regex
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.filters.gopher_quality_filter import GopherQualityFilter
from datatrove.pipeline.filters.gopher_repetition_filter import (
    GopherRepetitionFilter,
    find_all_duplicate,
    find_duplicates,
)
from datatrove.pipeline.formatters.base import BaseFormatter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.readers.base import BaseReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.text import PUNCTUATION_SET, simplify_text, split_into_words
from datatrove.utils.word_tokenizers import WhitespaceTokenizer
from dilforge_shared import CONTROL_TOKEN
from dilforge_shared.corpus import iter_located_texts
from dilforge_shared.errors import DilforgeError
from ftfy.badness import BADNESS_RE, MOJIBAKE_CATEGORIES
from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

from .config import LanguageConfig, RawSource, RedactConfig

# ---- reading ------------------------------------------------------------------------------------------


class SourceReadError(Exception):
    """A source that cannot be read (file and line), as one message that crosses process boundaries."""


class SourceReader(BaseReader):
    """Documents of every source in order; task `rank` of `world_size` keeps those at positions ≡ rank, so the
    output does not depend on the worker count."""

    name = "📖 dilforge sources"

    def __init__(self, sources: list[RawSource], endpoint_url: str | None = None):
        super().__init__()
        self.sources = sources
        self.endpoint_url = endpoint_url

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        position = 0
        for source in self.sources:
            start = position
            try:
                for uri, line, text in iter_located_texts(
                    source.uri, source.format, source.text_field, self.endpoint_url, "none", **source.bounds
                ):
                    position += 1
                    if (position - 1) % world_size != rank:
                        continue
                    self.stat_update("documents", f"source:{source.label}")
                    self.stat_update("bytes", value=len(text.encode("utf-8", "surrogatepass")))  # throughput per core
                    doc = Document(text, f"{source.label}:{position - 1}", metadata={"source": source.label})
                    doc.metadata["location"] = f"{uri}:{line}"
                    self.update_doc_stats(doc)
                    yield doc
            except DilforgeError as exc:
                raise SourceReadError(f"corpora[{source.label}]: {exc}") from None
            if position == start and rank == 0:
                self.stat_update(f"empty_source:{source.label}")


class RankFileReader(JsonlReader):
    """Task `rank` reads the file task `rank` of the filter phase wrote, if any: the MinHash filter matches
    documents to signatures by their position in it."""

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        name = f"{rank:05d}.jsonl"
        if self.data_folder.isfile(name):
            yield from self.read_file(name)


class ExampleWriter(JsonlWriter):
    """An exclusion writer keeping only the first `limit` documents per task: the report's examples of what a
    step removed (datatrove's stats count them all)."""

    def __init__(self, output_folder: str, limit: int):
        super().__init__(output_folder, output_filename="${rank}.jsonl", compression=None)
        self.limit = limit
        self._written = 0

    def write(self, document: Document, rank: int = 0, **kwargs):
        if self._written < self.limit:
            self._written += 1
            super().write(document, rank, **kwargs)


# ---- normalising --------------------------------------------------------------------------------------

_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")
_BLANK_LINES = re.compile(r"\n{3,}")


class Normaliser(BaseFormatter):
    name = "🔧 Normalise"

    def __init__(self, fix_encoding: bool, unicode_form: str, whitespace: bool):
        super().__init__()
        self.fix_encoding = fix_encoding
        self.unicode_form = unicode_form
        self.whitespace = whitespace

    def format(self, text: str) -> str:
        if self.fix_encoding and ftfy_may_change(text):
            fixed = ftfy.fix_text(text, config=FTFY_CONFIG)
            if fixed != text:
                self.stat_update("encoding_repaired")
            text = fixed
        if self.unicode_form != "none":
            normal = unicodedata.normalize(self.unicode_form, text)
            if normal != text:
                self.stat_update("unicode_normalised")
            text = normal
        if self.whitespace:
            spaced = _BLANK_LINES.sub("\n\n", "\n".join(_SPACES.sub(" ", line).strip() for line in text.splitlines()))
            spaced = _ZERO_WIDTH.sub("", spaced).strip()
            if spaced != text:
                self.stat_update("whitespace_normalised")
            text = spaced
        return strip_control_tokens(text, self.stat_update)


def strip_control_tokens(text: str, count=None) -> str:
    """`text` without strings shaped like a control token, removed until none is left (removing one may join the
    halves of another: `<|eot<|x|>_id|>`)."""
    removed = 0
    while True:
        text, n = CONTROL_TOKEN.subn("", text)
        if not n:
            break
        removed += n
    if removed and count is not None:
        count("control_tokens_removed", value=removed)
    return text


# datatrove FTFYFormatter's choices: repair encodings, never enforce a display format
FTFY_CONFIG = ftfy.TextFixerConfig(
    unescape_html=False, fix_latin_ligatures=False, fix_character_width=False, uncurl_quotes=False,
    fix_line_breaks=False, normalization=None,
)  # fmt: skip
# What ftfy (with `FTFY_CONFIG`) changes without its mojibake heuristic: C1 controls, surrogates, terminal escapes,
# `ftfy.chardata.CONTROL_CHARS`; and its one anchored pattern (`^[ÃÂ] `), which it matches per line.
_FTFY_FIXES = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u206a-\u206f\ufeff\ufff9-\ufffc\ud800-\udfff]|\n[ÃÂ] ")
_FTFY_SEGMENT = 1_000_000  # TextFixerConfig.max_decode_length: a longer line is cut where the anchor can match


def ftfy_may_change(text: str) -> bool:
    """False when ftfy's `fix_text` would return `text` unchanged (none of its fixes applies, `mojibake_in` finds
    nothing): one regex pass over the document instead of ftfy's several per line."""
    return len(text) > _FTFY_SEGMENT or bool(_FTFY_FIXES.search(text)) or mojibake_in(text)


@functools.cache
def _mojibake_marks() -> re.Pattern:
    """A character every match of ftfy's `BADNESS_RE` holds: one of its rarer categories, a letter its literal
    sequences turn on (Œ œ Ø Ù Ђ Â Ã Î Ð °), or a lowercase letter before an uppercase accented one (its one
    alternative of common letters only)."""
    cat = MOJIBAKE_CATEGORIES
    rare = "".join(cat[k] for k in ("c1", "bad", "box", "end_punctuation", "currency", "numeric", "law"))
    rare += cat["start_punctuation"] + "\u0152\u0153\u00d8\u00d9\u0402\u00c2\u00c3\u00ce\u00d0\u00b0"
    return re.compile(f"[{rare}]|[{cat['lower_accented']}{cat['lower_common']}](?=[{cat['upper_accented']}])")


_MOJIBAKE_REACH = 7  # the longest match of ftfy's pattern (`ГўВЂВ.x`) less one: how far a match reaches past a mark


def mojibake_in(text: str) -> bool:
    """ftfy's `is_bad(text)`, its pattern searched only around the marks a match must hold (`_mojibake_marks`)."""
    return any(
        BADNESS_RE.search(text, max(0, m.start() - _MOJIBAKE_REACH), m.start() + _MOJIBAKE_REACH + 1)
        for m in _mojibake_marks().finditer(text)
    )


class EmptyFilter(BaseFilter):
    """Documents with no text left after normalising (an empty line of a .txt, a blank record)."""

    name = "🫙 Empty"

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        return bool(doc.text.strip()) or (False, "empty")


# ---- language -----------------------------------------------------------------------------------------


# Letters the target writes and its close relatives do not (Turkish has no ə): evidence lingua's confidence can miss
# on a short text full of names.
OWN_LETTERS = {"az": "əƏ"}
OWN_LETTER_SHARE = 0.02  # far above a name or two in a Turkish text, far below Azerbaijani prose (docs/curate.md)


_DETECTORS: dict[tuple[str, ...], object] = {}


def lingua_language(code: str) -> Language:
    return Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper()))


def lingua_detector(codes: tuple[str, ...]):
    """One lingua detector per candidate set and process, its models loaded at once: built before datatrove forks
    its workers, which then share them."""
    if codes not in _DETECTORS:
        languages = map(lingua_language, codes)
        _DETECTORS[codes] = LanguageDetectorBuilder.from_languages(*languages).with_preloaded_language_models().build()
    return _DETECTORS[codes]


class LinguaFilter(BaseFilter):
    """Keep documents whose lingua confidence in `language` is at least `min_score`, or whose most likely language
    is one of `relatives` while the target is within `relative_margin` of it or written in its OWN_LETTERS; the
    score and the most likely language go into the metadata."""

    name = "🌍 Language ID (lingua)"

    def __init__(self, language: str, config: LanguageConfig, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.language = language
        self.candidates = sorted({language, *config.candidates, *config.relatives})
        self.min_score = config.min_score
        self.max_chars = config.max_chars
        self.relatives = set(config.relatives) - {language}
        self.margin = config.relative_margin
        self.own_letters = OWN_LETTERS.get(language, "")
        self._detector = None

    def _build(self):
        self._target = lingua_language(self.language)
        self._detector = lingua_detector(tuple(self.candidates))

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._detector is None:
            self._build()
        text = doc.text[: self.max_chars]
        values = self._detector.compute_language_confidence_values(text)
        best = values[0] if values else None
        score = next((v.value for v in values if v.language == self._target), 0.0)
        doc.metadata["language"] = best.language.iso_code_639_1.name.lower() if best else "unknown"
        doc.metadata["language_score"] = round(score, 4)
        if score >= self.min_score:
            return True
        if doc.metadata["language"] in self.relatives and (
            score >= best.value - self.margin or self._own_letter_share(text) >= OWN_LETTER_SHARE
        ):
            self.stat_update(f"kept_over_{doc.metadata['language']}")
            return True
        return False, f"language_{doc.metadata['language']}"

    def _own_letter_share(self, text: str) -> float:
        if not self.own_letters:
            return 0.0
        letters = sum(c.isalpha() for c in text)
        return sum(text.count(c) for c in self.own_letters) / letters if letters else 0.0


class WordSplitter(WhitespaceTokenizer):
    """Words and runs of punctuation, by regex (Latin, Cyrillic and other space-separated scripts)."""

    _WORDS = regex.compile(r"\w+(?:[-'’]\w+)*|[^\w\s]+")

    def word_tokenize(self, text) -> list[str]:
        return self._WORDS.findall(text)


_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible modulo 2**64
_BASE_INVERSE = np.uint64(pow(int(_BASE), -1, 2**64))


def _substring_hashes(text: str):
    """`hash(a, b)`: a polynomial hash modulo 2**64 (numpy wraps around) of `text[a:b]` for arrays of offsets,
    equal for equal substrings wherever they stand."""
    chars = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)
    prefix = np.zeros(len(chars) + 1, np.uint64)
    np.cumsum(chars * np.cumprod(np.full(len(chars), _BASE)), out=prefix[1:])
    inverses = np.ones(len(chars) + 1, np.uint64)
    np.cumprod(np.full(len(chars), _BASE_INVERSE), out=inverses[1:])

    def hashes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (prefix[b] - prefix[a]) * inverses[a]

    return hashes


def _first_occurrences(values: np.ndarray) -> np.ndarray | None:
    """For each position, the first position holding the same value; None when all values differ."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new = np.empty(len(values), bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    if new.all():
        return None
    firsts = np.empty(len(values), np.int64)
    firsts[order] = order[new][np.cumsum(new) - 1]
    return firsts


class NGrams:
    """A document's word n-grams for the Gopher repetition checks, found by hashes over their characters (numpy,
    every position at once) instead of a string per n-gram; what the hashes group is compared as text, and a
    collision falls back to datatrove's loop. Joined without a separator (datatrove's duplicate n-grams) or with
    one space (its top n-grams)."""

    def __init__(self, words: list[str]):
        self.words = words
        ends = np.fromiter(itertools.accumulate(map(len, words), initial=0), np.int64, len(words) + 1)
        self.joined, self.spaced = "".join(words), " ".join(words)
        self.joined_offsets, self.spaced_offsets = ends, ends + np.arange(len(words) + 1)
        self.joined_hash, self.spaced_hash = _substring_hashes(self.joined), _substring_hashes(self.spaced)

    def repeated_chars(self, n: int) -> int:
        """datatrove's `find_all_duplicate`: characters of the joined n-grams met again, left to right, skipping a
        repeated n-gram's words."""
        count = len(self.words) - n + 1
        if count <= 0:
            return 0
        a, b = self.joined_offsets[:count], self.joined_offsets[n:]
        firsts = _first_occurrences(self.joined_hash(a, b))
        if firsts is None:
            return 0
        again = np.flatnonzero(firsts != np.arange(count)).tolist()
        text, a, b, firsts = self.joined, a.tolist(), b.tolist(), firsts.tolist()
        repeated = end = 0
        skipped: set[int] = set()
        seen_again: set[int] = set()
        # a repeat: an n-gram seen earlier at a position the scan did not skip
        for p in again:
            f = firsts[p]
            if text[a[p] : b[p]] != text[a[f] : b[f]]:
                return find_all_duplicate(self.words, n)
            if p < end:
                continue
            if f in seen_again or f not in skipped:
                repeated += b[p] - a[p]
                skipped.update(range(p + 1, p + n))
                end = p + n
            seen_again.add(f)
        return repeated

    def top_chars(self, n: int) -> int:
        """Characters of the most common n-gram (the first among equals, as `Counter.most_common`) times its count."""
        count = len(self.words) - n + 1
        a, b = self.spaced_offsets[:count], self.spaced_offsets[n:] - 1
        firsts = _first_occurrences(self.spaced_hash(a, b))
        if firsts is None:  # every n-gram once: the first
            return int(b[0] - a[0])
        times = np.bincount(firsts, minlength=count)
        top = int(times.argmax())  # the first of the most common
        text, start, stop = self.spaced, a.tolist(), b.tolist()
        gram = text[start[top] : stop[top]]
        if any(text[start[p] : stop[p]] != gram for p in np.flatnonzero(firsts == top).tolist()):
            words, most = Counter(_n_gram_tuples(self.words, n)).most_common(1)[0]
            return (sum(map(len, words)) + n - 1) * most
        return len(gram) * int(times[top])


def _n_gram_tuples(words: list[str], n: int):
    return zip(*(words[i:] for i in range(n)), strict=False)


class RepetitionFilter(GopherRepetitionFilter):
    """Datatrove's Gopher repetition filter, the same checks and results, its n-grams found by `NGrams`."""

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        paragraphs = self.paragraph_exp.split(text.strip())
        duplicates, chars = find_duplicates(paragraphs)
        if self.dup_para_frac and duplicates / len(paragraphs) > self.dup_para_frac:
            return False, "dup_para_frac"
        if self.dup_para_char_frac and chars / len(text) > self.dup_para_char_frac:
            return False, "dup_para_char_frac"
        lines = self._line_splitter.split(text)
        duplicates, chars = find_duplicates(lines)
        if self.dup_line_frac and duplicates / len(lines) > self.dup_line_frac:
            return False, "dup_line_frac"
        if self.dup_line_char_frac and chars / len(text) > self.dup_line_char_frac:
            return False, "dup_line_char_frac"
        words = split_into_words(text, self.language)
        grams = NGrams(words)
        for n, n_frac in self.top_n_grams:
            if len(words) >= n and grams.top_chars(n) / len(text) > n_frac:
                return False, f"top_{n}_gram"
        for n, n_frac in self.dup_n_grams:
            if grams.repeated_chars(n) / len(text) > n_frac:
                return False, f"duplicated_{n}_n_grams"
        return True


@functools.cache
def has_letter():
    """`search` for a character `str.isalpha` accepts (datatrove's test of a word), as one regex class."""
    return _char_class([cp for cp in range(0x110000) if chr(cp).isalpha()]).search


_HAS_NON_PUNCTUATION = re.compile("[^" + "".join(map(re.escape, sorted(PUNCTUATION_SET))) + "]").search


class QualityFilter(GopherQualityFilter):
    """Datatrove's Gopher quality filter, the same checks, its per-word tests by one regex search per word. One
    difference: the share of words holding a letter is over words, not runs of punctuation (the splitter makes
    each comma a word, so a news paragraph of dates and sums fell under the bound)."""

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        words = split_into_words(text, self.language)
        n_words = len(words)
        non_symbol_words = list(filter(_HAS_NON_PUNCTUATION, words))
        n_non_symbol = len(non_symbol_words)
        if self.min_doc_words and n_non_symbol < self.min_doc_words:
            return False, "gopher_short_doc"
        if self.max_doc_words and n_non_symbol > self.max_doc_words:
            return False, "gopher_long_doc"
        mean_length = sum(map(len, non_symbol_words)) / n_non_symbol if n_non_symbol else math.nan
        if self.min_avg_word_length and mean_length < self.min_avg_word_length:
            return False, "gopher_below_avg_threshold"
        if self.max_avg_word_length and mean_length > self.max_avg_word_length:
            return False, "gopher_above_avg_threshold"
        if self.max_symbol_word_ratio and text.count("#") / n_words > self.max_symbol_word_ratio:
            return False, "gopher_too_many_hashes"
        if self.max_symbol_word_ratio and (text.count("...") + text.count("…")) / n_words > self.max_symbol_word_ratio:
            return False, "gopher_too_many_ellipsis"
        lines = text.splitlines()
        if (
            self.max_bullet_lines_ratio
            and sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines) > self.max_bullet_lines_ratio
        ):
            return False, "gopher_too_many_bullets"
        if (
            self.max_ellipsis_lines_ratio
            and sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines) > self.max_ellipsis_lines_ratio
        ):
            return False, "gopher_too_many_end_ellipsis"
        if (
            self.max_non_alpha_words_ratio
            and (len(list(filter(has_letter(), non_symbol_words))) / n_non_symbol if n_non_symbol else 0.0)
            < self.max_non_alpha_words_ratio
        ):
            return False, "gopher_below_alpha_threshold"
        if self.min_stop_words and len(self.stop_words.intersection(words)) < self.min_stop_words:
            return False, "gopher_enough_stop_words"
        return True


@functools.cache
def nonspacing_marks() -> re.Pattern:
    """The nonspacing marks (Mn, what `simplify_text` drops after NFD) below U+10000 as one regex class, which `re`
    tests by bitmap (a class past U+FFFF is a list of ranges tried in turn)."""
    return _char_class([cp for cp in range(0x10000) if unicodedata.category(chr(cp)) == "Mn"])


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


def without_nonspacing_marks(text: str) -> str:
    text = nonspacing_marks().sub("", text)
    if _ASTRAL.search(text):  # an emoji or a rare script: datatrove's own test for the marks past U+FFFF
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    return text


class MinhashSignature(MinhashDedupSignature):
    """Datatrove's MinHash signatures from the same shingles: diacritics dropped by one regex pass, and sha1
    digests read by numpy from one buffer instead of one by one."""

    @functools.cached_property
    def _norm_but_diacritics(self):
        return dataclasses.replace(self.config.norm_config, norm_unicode_diacritics=False)

    def get_shingles(self, text: str) -> np.ndarray:
        if self.config.norm_config.norm_unicode_diacritics:
            text = simplify_text(text, self._norm_but_diacritics)
            text = without_nonspacing_marks(unicodedata.normalize("NFD", text)).strip()
        else:
            text = simplify_text(text, self.config.norm_config)
        words = self.word_tokenizer.word_tokenize(text)
        grams = map(" ".join, _n_gram_tuples(words, self.config.n_grams))
        # datatrove's sha1_hash64/32 (the stage's hash): the digest's first 8 or 4 bytes, little-endian
        digests = b"".join(map(operator.methodcaller("digest"), map(hashlib.sha1, map(str.encode, grams))))
        width = self.config.hash_config.precision // 8
        head = np.frombuffer(digests, np.dtype([("head", f"<u{width}"), ("rest", f"V{20 - width}")]))["head"]
        return head.astype(np.uint64).reshape((-1, 1))


def preload(step: PipelineStep) -> None:
    """What `step` would build on its first document, built now, before datatrove forks the workers that share it."""
    if isinstance(step, LinguaFilter):
        lingua_detector(tuple(step.candidates))
    elif isinstance(step, Normaliser) and step.fix_encoding:
        _mojibake_marks()
    elif isinstance(step, QualityFilter):
        has_letter()
    elif isinstance(step, MinhashSignature):
        nonspacing_marks()


class SourceCounter(PipelineStep):
    """Kept documents, characters and words, in total and per source (for the report and data card)."""

    name = "🧮 Source counter"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            self.stat_update("kept", f"kept:{doc.metadata.get('source')}")
            self.stat_update("chars", value=len(doc.text))
            self.stat_update("words", value=len(doc.text.split()))
            yield doc


# ---- contact details ----------------------------------------------------------------------------------
# Patterns run on a shadow of the text, one character per character: Unicode digits, full-width '+@.()' and dashes
# as ASCII, spaces as a space and zero-width marks as _ZW; the original characters are replaced.
_ZW = "\x01"  # a zero-width mark in the shadow: joins digit groups, never separates them
_SHADOW = {ord(c): "@" for c in "\uff20\ufe6b"}
_SHADOW.update({ord(c): "+" for c in "\uff0b\ufe62"})
_SHADOW.update({ord(c): "." for c in "\uff0e\u2024\ufe52"})
_SHADOW.update({ord("\uff08"): "(", ord("\uff09"): ")"})
_SHADOW.update({ord(c): "-" for c in "\u2010\u2011\u2012\u2013\u2014\u2212\ufe63\uff0d"})
_SHADOW.update({ord(c): " " for c in "\t\u00a0\u1680\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))})
_SHADOW.update({ord(c): _ZW for c in "\u00ad\u180e\u200b\u200c\u200d\u2060\ufeff"})
_SHADOW.update(
    {cp: str(unicodedata.decimal(chr(cp))) for cp in range(0x80, 0x110000) if unicodedata.category(chr(cp)) == "Nd"}
)


def _char_class(codepoints: list[int]) -> re.Pattern:
    """A regex class of these code points as ranges."""
    ranges: list[list[int]] = []
    for c in sorted(codepoints):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return re.compile(
        "[" + "".join(re.escape(chr(a)) + (f"-{re.escape(chr(b))}" if b > a else "") for a, b in ranges) + "]"
    )


# those below U+10000 as one class, tested by bitmap; the class of all of them is a list of ranges tried in turn
_SHADOWED_BELOW = _char_class([cp for cp in _SHADOW if cp < 0x10000])
_SHADOWED_ASTRAL = _char_class([cp for cp in _SHADOW if cp >= 0x10000])


def shadow(text: str) -> str:
    """`text` with the same length, in the characters the contact patterns match (see above)."""
    if _SHADOWED_BELOW.search(text) or (_ASTRAL.search(text) and _SHADOWED_ASTRAL.search(text)):
        return text.translate(_SHADOW)
    return text


# An e-mail address: a dot-atom or quoted local part, '@', domain labels of Unicode letters and digits and a
# top-level domain of letters or punycode (a case ending after it, `ali@mail.az-a`, is not part of it).
_ATOM = r"[\w!#$%&'*+/=?^`{|}~\x01-]+"
EMAIL = (
    rf"(?<![\w.!#$%&'*+/=?^`{{|}}~\x01\\-])(?:{_ATOM}(?:\.{_ATOM})*|\"(?:[^\"\\\r\n]|\\.){{1,64}}\")"
    r"\x01*@\x01*(?:[^\W_](?:[\w\x01-]{0,62}[^\W_])?\.)+(?:xn--[a-z0-9-]{1,59}|[^\W\d_]{2,63})(?!\w)"
)
# A run of digit groups joined by up to four separators, maybe after '+'; which groups are phones is decided on
# their digits (`_phone_ok`): '+'/'00' and a country code (9-15 digits, +994 exactly 12), the trunk '0' and an
# Azerbaijani code (10 digits), `994` and 9 digits, or a mobile or Baku code as its own group before 7 digits.
PHONE_RUN = r"(?<![\w+\x01])(?:\(?\+[ .\-/()\x01]{0,4})?\(?\d(?:[ .\-/()\x01]{0,4}\d)*\)?(?![\w@])"
_AZ_CODES = {"10", "12", "18", "36", "40", "50", "51", "55", "60", "70", "77", "99", *(f"2{d}" for d in range(10))}
_AZ_BARE = {"10", "12", "50", "51", "55", "60", "70", "77", "99"}  # codes written without the trunk 0
_GROUP = re.compile(r"[\d\x01]+")
# A card number as cards print it: 13-19 digits in one group, groups of four, or 4-6-4/5, never starting with 0.
CARD = (
    r"(?<![\d\x01])(?:[1-9]\d{12,18}|[1-9]\d{3}([ \-\x01])\d{4}\1\d{4}\1\d{4}(?:\1\d{3})?"
    r"|[1-9]\d{3}([ \-\x01])\d{6}\2\d{4,5})(?![\d\x01])"
)


def _phone_ok(digits: str, plus: bool, groups: list[str], hidden: bool = False) -> bool:
    """`hidden`: zero-width marks inside the digits (nobody types them in a sum): a bare code and 7 digits then need
    no visible grouping."""
    if plus or digits.startswith("00"):
        rest = digits if plus else digits[2:]
        if rest.startswith("9940") and "0" in groups[1:3]:
            rest = "994" + rest[4:]  # the trunk written after the country code: `+994 (0) 50 …`
        if rest.startswith("994"):
            return len(rest) == 12 and rest[3:5] in _AZ_CODES
        return rest[:1] != "0" and 9 <= len(rest) <= 15
    sizes = tuple(len(g) for g in groups)
    # the trunk and code in one group, or `0 50 …` (a date `05.10.2023 14` is neither)
    trunk = (
        len(digits) == 10 and digits[0] == "0" and digits[1:3] in _AZ_CODES and (sizes[0] >= 3 or sizes[:2] == (1, 2))
    )
    country = len(digits) == 12 and digits[:3] == "994" and digits[3:5] in _AZ_CODES and sizes[0] in (3, 12)
    shaped = groups[0] in _AZ_BARE and sizes in ((2, 3, 2, 2), (2, 3, 4), (2, 7))
    bare = len(digits) == 9 and (shaped or (hidden and digits[:2] in _AZ_BARE))
    return trunk or country or bare


def phone_spans(match: str) -> list[tuple[int, int]]:
    """The phone numbers in a digit run (shadow form) as (start, end) offsets: from each group, the longest run of
    groups that passes `_phone_ok`; other numbers in the run are left alone."""
    if len(match) < 9:  # fewer than the 9 digits of the shortest phone: a year, a sum, a date
        return []
    groups = [(m.start(), m.end(), m.group(0).replace(_ZW, "")) for m in _GROUP.finditer(match)]
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(groups):
        # a run starts with its '+' (and '('), if any; a phone later in the run with its own '('
        plus = i == 0 and "+" in match[: groups[0][0]]
        start = 0 if i == 0 else groups[i][0] - (match[groups[i][0] - 1] == "(")
        found, digits = None, ""
        for j in range(i, len(groups)):
            digits += groups[j][2]
            if len(digits) > 16:  # no phone is longer (15 digits and a written trunk `(0)`)
                break
            end = groups[j][1]
            names = [g for _, _, g in groups[i : j + 1]]
            if len(digits) >= 9 and _phone_ok(digits, plus, names, _ZW in match[groups[i][0] : end]):
                found = (j, end + (1 if match[end : end + 1] == ")" and "(" in match[start:end] else 0))
        if found is None:
            i += 1
            continue
        spans.append((start, found[1]))
        i = found[0] + 1
    return spans


def _card_spans(match: str) -> list[tuple[int, int]]:
    return _whole(match) if luhn_ok(match) else []


def _whole(match: str) -> list[tuple[int, int]]:
    return [(0, len(match))]


def luhn_ok(match: str) -> bool:
    digits = [int(c) for c in reversed(match) if c.isdigit()]
    total = sum(digits[::2]) + sum(d * 2 - 9 if d > 4 else d * 2 for d in digits[1::2])
    return 13 <= len(digits) <= 19 and total % 10 == 0


class ContactRedactor(BaseFormatter):
    """E-mail addresses, phone numbers and card numbers → placeholders, replaced and counted in one pass per kind."""

    name = "📞 Redact contacts"

    def __init__(self, config: RedactConfig):
        super().__init__()
        # (kind, pattern, how much of a match to replace); cards first: a 16-digit card would half-match a phone,
        # e-mails before phones: digits in an address are not a phone number
        kinds = (("card", CARD, _card_spans), ("email", EMAIL, _whole), ("phone", PHONE_RUN, phone_spans))
        self.kinds = [
            (kind, re.compile(pattern), spans, getattr(config, f"{kind}_placeholder"))
            for kind, pattern, spans in kinds
            if getattr(config, f"{kind}s")
        ]

    def format(self, text: str) -> str:
        view = shadow(text)
        for kind, pattern, spans, placeholder in self.kinds:
            if kind == "email" and "@" not in view:
                continue
            out, pos, count = [], 0, 0
            for match in pattern.finditer(view):
                for start, end in spans(match.group(0)):
                    out += [text[pos : match.start() + start], placeholder]
                    pos = match.start() + end
                    count += 1
            if count:
                text = "".join(out) + text[pos:]
                view = shadow(text)
                self.stat_update(f"documents_with_{kind}")
                self.stat_update(f"{kind}s_replaced", value=count)
        return text
