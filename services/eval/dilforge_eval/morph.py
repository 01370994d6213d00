"""Morpheme alignment (docs/eval.md): do token boundaries, taken in bytes, fall on the gold morpheme boundaries of
segmented words, lemma/form pairs or glossed CoNLL-U?"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate, pairwise

from dilforge_shared.corpus import iter_located_texts
from dilforge_shared.errors import InputError
from tokenizers.pre_tokenizers import ByteLevel

from .config import MorphResources
from .metrics import MorphFigures

ALTERNATIONS = {"k": "yğ", "q": "ğ", "p": "b", "ç": "c", "t": "d"}
BYTE_ALPHABET = frozenset(ByteLevel.alphabet())  # byte-level BPE (GPT-2, Llama 3): one character per byte


def az_lower(s: str) -> str:
    return s.replace("I", "ı").replace("İ", "i").lower()


@dataclass(frozen=True)
class GoldWord:
    word: str
    boundaries: tuple[int, ...]  # character offsets, 0 < b < len(word)
    known: tuple[tuple[int, int], ...]  # character spans known to be one morpheme each


def from_segments(word: str, parts: list[str]) -> GoldWord:
    offsets = list(accumulate(len(part) for part in parts[:-1]))
    edges = [0, *offsets, len(word)]
    return GoldWord(word, tuple(offsets), tuple(pairwise(edges)))


def stem_boundary(lemma: str, form: str) -> int | None:
    """Length of the stem in `form` when `lemma` is its prefix (allowing a final-consonant alternation)."""
    lemma, low = az_lower(lemma), az_lower(form)
    if not lemma or len(low) != len(form) or len(low) < len(lemma):
        return None
    stem = low[: len(lemma)]
    if stem == lemma or (stem[:-1] == lemma[:-1] and stem[-1] in ALTERNATIONS.get(lemma[-1], "")):
        return len(lemma)
    return None


def from_lemma(form: str, lemma: str, num_morphemes: int | None = None) -> GoldWord | None:
    """A gold word from a lemma/form pair; `num_morphemes` from a gloss, when there is one."""
    b = stem_boundary(lemma, form)
    if b is None:
        return None
    if b == len(form):
        if num_morphemes not in (None, 1):
            return None  # a fused or zero-marked form: nothing reliable to say
        return GoldWord(form, (), ((0, len(form)),))
    if num_morphemes == 1:
        return None  # gloss says one morpheme but the form is longer than its lemma
    known = ((0, b), (b, len(form))) if num_morphemes == 2 else ((0, b),)
    return GoldWord(form, (b,), known)


def _lines(uri: str, endpoint_url: str | None) -> Iterable[tuple[int, str]]:
    """(line number, line) of every non-blank line, through the shared corpus reader (local, gz or s3://)."""
    return ((n, line) for _, n, line in iter_located_texts(uri, "txt", endpoint_url=endpoint_url, skip_empty=True))


def _rows(uri: str, endpoint_url: str | None) -> Iterable[tuple[int, list[str]]]:
    """TSV rows (tab-separated, no quoting: a quote is a letter here) with their line numbers."""
    return ((lineno, line.split("\t")) for lineno, line in _lines(uri, endpoint_url))


def load_segmented(path: str, endpoint_url: str | None = None) -> list[GoldWord]:
    words = []
    for lineno, cells in _rows(path, endpoint_url):
        if lineno == 1 and cells[0].strip().lower() == "word":
            continue
        if len(cells) < 2:
            raise InputError("expected word<TAB>segmentation", path=path, line=lineno)
        word, seg = cells[0].strip(), cells[1].strip() or cells[0].strip()
        parts = [p for p in re.split(r"[+]", seg) if p]
        if "".join(parts) != word or not word:
            continue  # segmentation does not spell the word (an alternation written as the lemma's form)
        words.append(from_segments(word, parts))
    return words


def load_lemma_forms(path: str, endpoint_url: str | None = None) -> list[GoldWord]:
    words, lemma_col, form_col = [], 0, 1
    for lineno, cells in _rows(path, endpoint_url):
        low = [c.strip().lower() for c in cells]
        if lineno == 1 and "lemma" in low and "form" in low:
            lemma_col, form_col = low.index("lemma"), low.index("form")
            continue
        if len(cells) <= max(lemma_col, form_col):
            raise InputError(f"expected at least {max(lemma_col, form_col) + 1} columns", path=path, line=lineno)
        lemma, form = cells[lemma_col].strip(), cells[form_col].strip()
        if " " in form or " " in lemma or not form:
            continue
        if (gw := from_lemma(form, lemma)) is not None:
            words.append(gw)
    return words


def load_conllu(path: str, endpoint_url: str | None = None) -> list[GoldWord]:
    """Words of a CoNLL-U file (no CoNLL-U library is a dependency: only FORM, LEMMA, UPOS and comments are read)."""
    words: list[GoldWord] = []
    tokens: list[tuple[str, str, str]] = []
    glossing: str | None = None

    def flush() -> None:
        content = [t for t in tokens if t[2] != "PUNCT"]
        glosses = glossing.split() if glossing else []
        aligned = len(glosses) == len(content)
        for i, (form, lemma, _) in enumerate(content):
            n = glosses[i].count("-") + 1 if aligned else None
            gw = from_lemma(form, lemma, n)
            if gw is not None and re.fullmatch(r"\w+", form):
                words.append(gw)

    for lineno, line in _lines(path, endpoint_url):
        if line.startswith("#"):
            if line.startswith("# sent_id"):
                if tokens:
                    flush()
                tokens, glossing = [], None
            if m := re.match(r"#\s*glossing\s*=\s*(.*)", line):
                glossing = m.group(1).strip()
            continue
        if len(cells := line.split("\t")) < 4:
            raise InputError("expected a CoNLL-U token line (10 tab-separated columns)", path=path, line=lineno)
        if "-" in cells[0] or "." in cells[0]:
            continue  # multiword range or empty node
        tokens.append((cells[1], cells[2], cells[3]))
    if tokens:
        flush()
    return words


def load_gold(resources: MorphResources, seed: int, endpoint_url: str | None = None) -> dict[str, list[GoldWord]]:
    """Gold words per source file (named by its file name), deduplicated and sampled with `seed`."""
    out: dict[str, list[GoldWord]] = {}
    r, n = resources, resources.num_words_per_source
    for loader, paths in ((load_segmented, r.segmented), (load_lemma_forms, r.lemma_forms), (load_conllu, r.conllu)):
        for path in paths:
            unique = list({w.word: w for w in loader(path, endpoint_url)}.values())
            if len(unique) > n:
                unique = random.Random(seed).sample(unique, n)
            if not unique:
                raise InputError("no usable gold words in this morphology resource", path=path)
            out[path.rstrip("/").rsplit("/", 1)[-1]] = unique
    return out


def token_byte_boundaries(tokenizer, text: str) -> list[int]:
    """Internal token boundaries of `text` as byte offsets, for a `tokenizers.Tokenizer`: exact for byte-level BPE
    (one alphabet character per byte), else from the character offsets."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    if all(ch in BYTE_ALPHABET for tok in enc.tokens for ch in tok):
        lengths = [len(tok) for tok in enc.tokens]
        if sum(lengths) == len(text.encode("utf-8")):
            return list(accumulate(lengths[:-1]))
    ends = sorted({end for _, end in enc.offsets})
    return [len(text[:e].encode("utf-8")) for e in ends if 0 < e < len(text)]


def alignment(tokenizer, words: Iterable[GoldWord]) -> Counter[str]:
    """Each word's token boundaries (after a leading space, as in running text) against its gold ones, in bytes:
    the counts `figures` reads (`num_words_exact`: fully known words whose token boundaries are the gold ones)."""
    n: Counter[str] = Counter()
    for gold in words:
        word_bytes = len(gold.word.encode("utf-8"))
        token_b = {b - 1 for b in token_byte_boundaries(tokenizer, " " + gold.word) if 1 < b < word_bytes + 1}
        gold_b = {len(gold.word[:b].encode("utf-8")) for b in gold.boundaries}
        known = [(len(gold.word[:s].encode("utf-8")), len(gold.word[:e].encode("utf-8"))) for s, e in gold.known]
        inside = [b for b in token_b - gold_b if any(s < b < e for s, e in known)]
        n["num_words"] += 1
        n["num_gold_boundaries"] += len(gold_b)
        n["num_gold_hit"] += len(gold_b & token_b)
        n["num_token_boundaries_decidable"] += len(token_b & gold_b) + len(inside)
        n["num_token_boundaries_inside"] += len(inside)
        if sum(e - s for s, e in known) == word_bytes:
            n["num_words_fully_known"] += 1
            n["num_words_exact"] += token_b == gold_b
    return n


def figures(n: Counter[str]) -> MorphFigures:
    """The counts of `alignment` and their ratios, None where undefined."""

    def ratio(a: str, b: str) -> float | None:
        return round(n[a] / n[b], 4) if n[b] else None

    return MorphFigures(
        boundary_recall=ratio("num_gold_hit", "num_gold_boundaries"),
        inside_morpheme_rate=ratio("num_token_boundaries_inside", "num_token_boundaries_decidable"),
        exact_segmentation_rate=ratio("num_words_exact", "num_words_fully_known"),
        **{k: n[k] for k in MorphFigures.model_fields if k.startswith("num_")},
    )
