"""One pass over the corpora: interleave sources, hold out a hashed slice, dedup, upsample by weight.

Word-frequency lists go to `fed_words` as counts, never as repeated lines. Memory: the capped held-out slice, the
word lists, and with `dedup` a digest per distinct line."""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

from dilforge_shared.configs import DataSource, Oversize
from dilforge_shared.corpus import iter_lines, iter_located_texts
from dilforge_shared.errors import InputError
from dilforge_shared.identity import source_files
from dilforge_shared.prefetch import read_ahead
from dilforge_shared.progress import Progress

log = logging.getLogger("dilforge.tokenizer")


@dataclass
class SourceStats:
    lines_read: int = 0
    lines_heldout: int = 0
    lines_duplicate: int = 0
    lines_trained: int = 0
    lines_fed: int = 0  # after upsampling by weight
    bytes_fed: int = 0
    words_recased: int = 0  # word lists with recase: entries fed in the text's usual casing


@dataclass
class CorpusStream:
    """Batches of training lines (`batches`); `heldout` fills up on the way: a line is held out when a seeded
    CRC-32 of its text falls below `validation_fraction`, so duplicates land on the same side whatever the order."""

    sources: Sequence[DataSource]
    seed: int = 0
    validation_fraction: float = 0.02
    num_validation_lines: int = 2000
    max_lines: int | None = None
    dedup: bool = False
    normalization: str = "NFC"
    endpoint_url: str | None = None
    progress: bool = True
    heldout: list[str] = field(default_factory=list)
    stats: dict[str, SourceStats] = field(default_factory=dict)
    fed_words: Counter = field(default_factory=Counter)  # word lists: " word" -> times fed (count x weight)
    _text_done: bool = field(default=False, init=False, repr=False)  # max_lines reached: the text stops, lists go on

    def _interleaved(self, chunk: int) -> Iterator[tuple[DataSource, SourceStats, list]]:
        """Round-robin over the text sources, `chunk` lines at a time, so max_lines and the held-out cap see
        every source; then over the word lists (`recase` needs the text read first)."""
        text = [s for s in self.sources if s.format != "word_counts"]
        for group in (text, [s for s in self.sources if s.format == "word_counts"]):
            iters = [(s, self.stats[s.label], self._reader(s)) for s in group]
            while iters and not (group is text and self._text_done):
                alive = []
                for source, st, it in iters:
                    texts = [item[2] for item in itertools.islice(it, chunk)]
                    if texts:
                        yield source, st, texts
                        if group is text and self._text_done:
                            break
                    if len(texts) == chunk:
                        alive.append((source, st, it))
                    elif st.lines_read == 0 and not texts:
                        raise InputError("corpus is empty: no non-blank text in it", path=source.uri)
                iters = alive

    def _reader(self, s: DataSource) -> Iterator[tuple]:
        """(file, line, text) of a text source; (file, line, (word, count)) of a word_counts list."""
        if s.format == "word_counts":
            return iter_word_counts(s.uri, self.endpoint_url, self.normalization, **s.bounds)
        return iter_located_texts(s.uri, s.format, s.text_field, self.endpoint_url, self.normalization, **s.bounds)

    def _scan(self) -> Iterator[list[str]]:
        """Lists of training lines (each repeated by its source's weight), one per source chunk; word lists
        go to `fed_words`. Dedup by an 8-byte keyed BLAKE2b (no false duplicates)."""
        for s in self.sources:
            self.stats.setdefault(s.label, SourceStats())
        threshold = int(self.validation_fraction * 2**32)
        crc_seed = zlib.crc32(self.seed.to_bytes(8, "little"))
        key = self.seed.to_bytes(8, "little")
        seen: set[bytes] = set()
        rng = random.Random(self.seed)
        heldout = self.heldout
        self._text_done = False
        # word forms of the trained text, for word lists that take their casing from it (recase)
        forms: Counter | None = Counter() if any(getattr(s, "recase", False) for s in self.sources) else None
        casing: dict[str, str] | None = None
        crc32, blake2b = zlib.crc32, hashlib.blake2b
        chunk = 256 if self.max_lines is None else max(1, min(256, self.max_lines // (10 * len(self.sources))))
        read = 0
        bar = Progress("corpus", unit="lines", log=log, enabled=self.progress)
        try:
            for source, st, texts in self._interleaved(chunk):
                is_list = source.format == "word_counts"
                if self.max_lines is not None and not is_list:
                    texts = texts[: max(0, self.max_lines - read)]
                    self._text_done = read + len(texts) >= self.max_lines  # the text sources stop here
                    if not texts:
                        continue
                read += 0 if is_list else len(texts)
                st.lines_read += len(texts)
                bar.update(len(texts))
                weight = source.weight
                out: list[str] = []
                if is_list:
                    recase = getattr(source, "recase", False)  # a plain DataSource has no such field
                    if recase and casing is None:
                        casing = usual_casing(forms)
                    _feed_words(texts, weight, st, rng, self.fed_words, casing if recase else None)
                    continue
                for text in texts:
                    data = text.encode("utf-8")
                    if self.dedup:
                        digest = blake2b(data, digest_size=8, key=key).digest()
                        if digest in seen:
                            st.lines_duplicate += 1
                            continue
                        seen.add(digest)
                    if crc32(data, crc_seed) < threshold:
                        st.lines_heldout += 1
                        if len(heldout) < self.num_validation_lines:
                            heldout.append(text)
                        continue
                    reps = 1 if weight == 1.0 else _times(weight, rng)
                    st.lines_trained += 1
                    st.lines_fed += reps
                    st.bytes_fed += reps * len(data)
                    out.append(text)
                    if reps != 1:
                        out.extend([text] * (reps - 1))
                    if forms is not None:  # each trained line once: upsampling does not change a word's casing
                        forms.update(WORD.findall(SENTENCE_START.sub(" ", text)))
                if out:
                    yield out
        finally:
            bar.close()

    def lines(self) -> Iterator[str]:
        """Training lines, one by one."""
        for batch in self._scan():
            yield from batch

    def batches(self, min_lines: int = 4096, depth: int = 4) -> Iterator[list[str]]:
        """Training lines in lists of at least `min_lines`, read ahead by a background thread (overlapping the
        reading with the counting workers). Stats and `heldout` are final once it is exhausted or closed."""
        return read_ahead(_regrouped(self._scan(), min_lines), depth, name="corpus-read-ahead")

    def summary(self) -> dict:
        total = SourceStats(**{k: sum(getattr(st, k) for st in self.stats.values()) for k in asdict(SourceStats())})
        return {
            "total": asdict(total),
            "sources": {k: asdict(v) for k, v in self.stats.items()},
            "heldout_lines_measured": len(self.heldout),
        }


WORD = re.compile(r"\w+(?:[-'’]\w+)*")  # a word of running text, as a frequency list spells one
# the first word of a line or of a sentence: capitalised by position, so it says nothing of the word's casing
SENTENCE_START = re.compile(r"(?:^|[.!?…])[\s\"'«“(\[-]*\w+(?:[-'’]\w+)*")


def usual_casing(forms: Counter) -> dict[str, str]:
    """Lowercased word -> the form the text uses most often inside sentences, lowercase or capitalised (ties: the
    first seen). Plain and Turkic lowercasing (I -> ı, İ -> i) both key a form: 'iraq' finds 'İraq'."""
    best: dict[str, str] = {}
    for form, count in forms.items():
        if any(ch.isupper() for ch in form[1:]):  # ALL-CAPS headings, acronyms: not how a word is usually written
            continue
        for key in {form.lower(), form.replace("I", "ı").replace("İ", "i").lower()}:
            if key not in best or count > forms[best[key]]:
                best[key] = form
    return best


def _times(expected: float, rng: random.Random) -> int:
    """`expected` rounded down or up at random, so the mean is `expected` (seeded: the same every run)."""
    whole = int(expected)
    return whole + (1 if rng.random() < expected - whole else 0)


def _feed_words(
    entries: list[tuple[str, int]],
    weight: float,
    st: SourceStats,
    rng: random.Random,
    fed: Counter,
    casing: dict[str, str] | None = None,
) -> None:
    """Each (word, count) as " word" into `fed`, count x weight times (the fraction by seeded sampling);
    with `casing`, in the form the text corpora use most often for it."""
    for word, count in entries:
        if casing is not None:
            usual = casing.get(word, word)
            if usual != word:
                st.words_recased += 1
                word = usual
        text = " " + word
        reps = _times(count * weight, rng)
        st.lines_trained += 1
        st.lines_fed += reps
        st.bytes_fed += reps * len(text.encode("utf-8"))
        if reps:
            fed[text] += reps


def iter_word_counts(
    uri: str, endpoint_url: str | None, normalization: str, max_document_bytes: int, on_oversize: Oversize
) -> Iterator[tuple[str, int, tuple[str, int]]]:
    """(file, line, (word, count)) of every entry of a word-frequency list behind `uri`: one `WORD COUNT` per line
    (a positive count; blank lines and a BOM skipped); any other layout is an error naming the file and line."""
    for file_uri in source_files(uri, endpoint_url):
        for lineno, line in iter_lines(file_uri, endpoint_url, max_document_bytes, on_oversize, splittable=False):
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            parts = line.split()
            if not parts:
                continue
            count = parts[-1]
            if len(parts) != 2 or not (count.isascii() and count.isdigit()) or int(count) == 0:
                raise InputError(
                    f"expected 'WORD COUNT' (two fields: a word, then a positive integer), got {line.strip()[:60]!r}",
                    path=file_uri,
                    line=lineno,
                )
            word = parts[0]
            if normalization == "NFC":
                word = unicodedata.normalize("NFC", word)
            yield file_uri, lineno, (word, int(count))


def _regrouped(batches: Iterator[list[str]], min_lines: int) -> Iterator[list[str]]:
    """The same lines, in the same order, in lists of at least `min_lines` (the last may be shorter)."""
    out: list[str] = []
    for batch in batches:
        out.extend(batch)
        if len(out) >= min_lines:
            yield out
            out = []
    if out:
        yield out
