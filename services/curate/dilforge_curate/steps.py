"""The datatrove pipeline steps datatrove lacks for this stage (docs/architecture.md, "Curate on datatrove").

- `SourceReader`: datatrove's readers open files through fsspec, whose S3 filesystem (s3fs) cannot be installed
  beside the pinned boto3; this reader streams through dilforge's own corpus readers (local, S3 via boto3, gzip,
  parquet, bounded line length, errors naming file and line) and stripes documents over the tasks by their
  position, so one large file still spreads over every task and the output does not depend on how many
  workers run them.
- `Normaliser`: ftfy's encoding repair (as datatrove's FTFYFormatter), Unicode normal form and whitespace, with
  the repairs counted.
- `LinguaFilter`: datatrove's LanguageFilter downloads a fastText model at run time; lingua bundles its models.
- `ContactRedactor`: datatrove's PIIFormatter covers e-mails and IPs; phones and card numbers are added here,
  in one regex pass per kind that also counts.
- `WordSplitter`: datatrove assigns Azerbaijani a spaCy word tokenizer; a regex split is enough for the
  Latin-script heuristics and needs no model.
"""

from __future__ import annotations

import re
import unicodedata

import regex
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.formatters.base import BaseFormatter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.readers.base import BaseReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.word_tokenizers import WhitespaceTokenizer

# ---- reading ------------------------------------------------------------------------------------------


class SourceReadError(Exception):
    """A source that cannot be read (named file and line): one message, so it crosses process boundaries."""


class SourceReader(BaseReader):
    """Documents of every source in order; task `rank` of `world_size` keeps those at positions ≡ rank."""

    name = "📖 dilforge sources"

    def __init__(self, sources: list[dict], endpoint_url: str | None = None):
        super().__init__()
        self.sources = sources  # [{uri, format, text_field, label, bounds}]
        self.endpoint_url = endpoint_url

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from dilforge_shared.corpus import iter_located_texts
        from dilforge_shared.errors import DilforgeError

        position = 0
        for source in self.sources:
            read = 0
            texts = iter_located_texts(
                source["uri"], source["format"], source["text_field"], self.endpoint_url, "none", **source["bounds"]
            )
            while True:
                try:
                    uri, line, text = next(texts)
                except StopIteration:
                    break
                except DilforgeError as exc:
                    raise SourceReadError(f"corpora[{source['label']}]: {exc}") from None
                read += 1
                position += 1
                if (position - 1) % world_size != rank:
                    continue
                self.stat_update("documents", f"source:{source['label']}")
                doc = Document(text=text, id=f"{source['label']}:{position - 1}", metadata={"source": source["label"]})
                doc.metadata["location"] = f"{uri}:{line}"
                self.update_doc_stats(doc)
                yield doc
            if read == 0 and rank == 0:
                self.stat_update(f"empty_source:{source['label']}")


class RankFileReader(JsonlReader):
    """Task `rank` reads exactly the file task `rank` of the filter phase wrote (none if it kept nothing): the
    MinHash filter matches documents to signatures by their position in that task's stream."""

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        name = f"{rank:05d}.jsonl"
        if self.data_folder.isfile(name):
            yield from self.read_file(name)


class ExampleWriter(JsonlWriter):
    """A filter's exclusion writer that keeps only its first `limit` documents per task: the report shows a few
    examples of what each step removed (counted in full by datatrove's stats); writing every removed document
    would cost as much I/O as the output."""

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
        self.ftfy_config = _ftfy_config() if fix_encoding else None

    def format(self, text: str) -> str:
        if self.fix_encoding:
            import ftfy

            fixed = ftfy.fix_text(text, config=self.ftfy_config)
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
        return text


def _ftfy_config():
    from ftfy import TextFixerConfig

    # datatrove FTFYFormatter's choices: repair encodings, never enforce a display format
    return TextFixerConfig(
        unescape_html=False, fix_latin_ligatures=False, fix_character_width=False, uncurl_quotes=False,
        fix_line_breaks=False, normalization=None,
    )  # fmt: skip


class EmptyFilter(BaseFilter):
    """Documents with no text left after normalising (an empty line of a .txt, a blank record)."""

    name = "🫙 Empty"

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        return bool(doc.text.strip()) or (False, "empty")


# ---- language -----------------------------------------------------------------------------------------


class LinguaFilter(BaseFilter):
    """Keep documents whose lingua confidence in `language` is at least `min_score`; the score and the most
    likely language go into the document's metadata."""

    name = "🌍 Language ID (lingua)"

    def __init__(self, language: str, candidates: list[str], min_score: float, max_chars: int, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.language = language
        self.candidates = sorted({language, *candidates})
        self.min_score = min_score
        self.max_chars = max_chars
        self._detector = None

    def _build(self):
        from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

        self._target = Language.from_iso_code_639_1(getattr(IsoCode639_1, self.language.upper()))
        languages = [Language.from_iso_code_639_1(getattr(IsoCode639_1, c.upper())) for c in self.candidates]
        self._detector = LanguageDetectorBuilder.from_languages(*languages).build()

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
        return False, f"language_{doc.metadata['language']}"


class WordSplitter(WhitespaceTokenizer):
    """Words and runs of punctuation, by regex (Latin, Cyrillic and other space-separated scripts)."""

    _WORDS = regex.compile(r"\w+(?:[-'’]\w+)*|[^\w\s]+")

    def word_tokenize(self, text) -> list[str]:
        return self._WORDS.findall(text)


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

EMAIL = (
    r"\b[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,}\b"
)
# A phone number: '+' or '00' and a country code, or Azerbaijan's trunk '0' and an area or mobile code
# (12 Baku, 10/50/51/55/60/70/77/99 mobile, 2x regional), then digit groups joined by spaces, dots, dashes or
# parentheses. Plain digit runs without such a start (sums, years, '1 500 000 manat') are never touched.
_SEP = r"[ .\-\u00a0]?"
PHONE = (
    r"(?<![\w+])(?:"
    rf"\(?(?:\+|\b00)[1-9]\d{{0,2}}\)?{_SEP}\(?\d{{1,4}}\)?(?:{_SEP}\d{{2,4}}){{2,4}}"
    rf"|\(?\b0(?:1[02]|2\d|40|50|51|55|60|70|77|99)\)?{_SEP}\d{{3}}(?:{_SEP}\d{{2}}){{2}}"
    rf"|\b994{_SEP}\(?\d{{2}}\)?{_SEP}\d{{3}}(?:{_SEP}\d{{2}}){{2}}"
    r")(?!\w)"
)
CARD = r"(?<!\d)(?:\d[ \-]?){12,18}\d(?!\d)"


def _phone_digits_ok(match: str) -> bool:
    return 9 <= sum(c.isdigit() for c in match) <= 15


def luhn_ok(match: str) -> bool:
    digits = [int(c) for c in match if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


class ContactRedactor(BaseFormatter):
    """E-mail addresses, phone numbers and card numbers → placeholders, replaced and counted in one pass per kind."""

    name = "📞 Redact contacts"

    def __init__(self, emails: bool, phones: bool, cards: bool, placeholders: dict[str, str]):
        super().__init__()
        # (kind, pattern, validator, placeholder); cards first: a 16-digit card would half-match a phone pattern
        kinds = (
            ("card", cards, CARD, luhn_ok),
            ("email", emails, EMAIL, None),
            ("phone", phones, PHONE, _phone_digits_ok),
        )
        self.kinds = [
            (kind, re.compile(pattern), check, placeholders[kind]) for kind, on, pattern, check in kinds if on
        ]

    def format(self, text: str) -> str:
        for kind, pattern, check, placeholder in self.kinds:
            count = 0

            def replace(match: re.Match, check=check, placeholder=placeholder) -> str:
                nonlocal count
                if check is not None and not check(match.group(0)):
                    return match.group(0)
                count += 1
                return placeholder

            text = pattern.sub(replace, text)
            if count:
                self.stat_update(f"documents_with_{kind}")
                self.stat_update(f"{kind}s_replaced", value=count)
        return text
