"""Clean Azerbaijani news paragraphs among English and junk: the share of each the curate stage's filters keep,
with the defaults before and after quality.min_words 20, line-ending closers and the relatives rule of language
ID (docs/curate.md, "Short documents").

Clean: X-WMT news sentences and FLORES-200 dev sentences (../shared/data, held out from every stage), joined 1-5
at a time into paragraphs as a news page has them (seed 0); English: the X-WMT English side, joined the same way;
junk: bench/dirty_corpus.py's navigation, symbol spam, keyword spam and tiny documents. Each document runs
through the filter phase's steps in order (normalise, redact, language ID, repetition, lines, quality; no
deduplication: the paragraphs are distinct), configured from CurateConfig. Then language ID alone on the 600
X-WMT sentences (the short texts lingua most often calls Turkish).

    python bench/curate_paragraphs.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dirty_corpus import _detok, _junk  # noqa: E402
from hardware import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The settings before: FineWeb-2's / Gopher's as the stage had them (no relatives rule, no closers, 50 words).
BEFORE = {
    "quality": {"min_words": 50, "line_end_closers": ""},
    "language_id": {"relatives": []},
}


def paragraphs(sentences: list[str], rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(sentences):
        n = rng.randint(1, 5)
        out.append(" ".join(sentences[i : i + n]))
        i += n
    return out


def corpus(data: Path) -> dict[str, list[str]]:
    rng = random.Random(0)
    dev = data / "az/dev"
    xaz = [_detok(s) for s in (dev / "xwmt_test.az-en.az.txt").read_text(encoding="utf-8").splitlines()]
    xen = [_detok(s) for s in (dev / "xwmt_test.az-en.en.txt").read_text(encoding="utf-8").splitlines()]
    with open(dev / "flores200.dev.partial_from_sib200.tsv", encoding="utf-8") as f:
        flores = [r["azj_Latn"] for r in csv.DictReader(f, delimiter="\t")]
    junk = [_junk(kind, rng) for kind in ("boilerplate", "symbols", "spam", "tiny") for _ in range(20)]
    return {"az": paragraphs(xaz, rng) + paragraphs(flores, rng), "en": paragraphs(xen, rng), "junk": junk}


def steps(config):
    """The filter phase's steps as services/curate/dilforge_curate/stage.py builds them."""
    from datatrove.pipeline.filters import FineWebQualityFilter
    from datatrove.utils.text import TERMINAL_PUNCTUATION
    from dilforge_curate.steps import (
        ContactRedactor,
        LinguaFilter,
        Normaliser,
        QualityFilter,
        RepetitionFilter,
        WordSplitter,
    )

    q, words = config.quality, WordSplitter()
    return [
        ("normalise", Normaliser(**config.normalise.model_dump())),
        ("redact", ContactRedactor(config.redact)),
        ("language", LinguaFilter(config.language, config.language_id)),
        ("repetition", RepetitionFilter(dup_line_frac=q.dup_line_frac, top_n_grams=tuple(q.top_n_grams),
                                              dup_n_grams=tuple(q.dup_n_grams), language=words)),
        ("lines", FineWebQualityFilter(line_punct_thr=q.line_punct_thr,
                                       stop_chars=(*TERMINAL_PUNCTUATION, *q.line_end_closers),
                                       short_line_thr=q.short_line_thr, char_duplicates_ratio=q.char_duplicates_ratio,
                                       new_line_ratio=q.new_line_ratio, language=words)),
        ("quality", QualityFilter(min_doc_words=q.min_words, max_doc_words=q.max_words,
                                        min_avg_word_length=q.min_avg_word_length,
                                        max_avg_word_length=q.max_avg_word_length,
                                        max_symbol_word_ratio=q.max_symbol_word_ratio,
                                        max_non_alpha_words_ratio=q.max_non_alpha_words_ratio,
                                        min_stop_words=q.min_stop_words, stop_words=q.stop_words, language=words)),
    ]  # fmt: skip


def keep_rate(chain, texts: list[str]) -> tuple[float, Counter]:
    from datatrove.data import Document

    kept, dropped = 0, Counter()
    for i, text in enumerate(texts):
        doc = Document(text=text, id=str(i))
        for name, step in chain:
            if hasattr(step, "format"):
                doc.text = step.format(doc.text)
                continue
            verdict = step.filter(doc)
            if verdict is not True:
                dropped[f"{name}: {verdict[1] if isinstance(verdict, tuple) else 'dropped'}"] += 1
                break
        else:
            kept += 1
    return kept / len(texts), dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", ROOT.parent / "shared/data")))
    args = ap.parse_args()
    from dilforge_curate.config import CurateConfig

    print(describe("datatrove", "lingua-language-detector"))
    sets = corpus(args.data)
    short = sum(len(p.split()) < 50 for p in sets["az"])
    print(f"az paragraphs {len(sets['az'])} ({short} under 50 words), en {len(sets['en'])}, junk {len(sets['junk'])}")
    print("| settings | az kept | en kept | junk kept | what dropped az paragraphs |")
    print("|---|---:|---:|---:|---|")
    for name, overrides in (("before", BEFORE), ("after (defaults)", {})):
        chain = steps(CurateConfig(corpora=[{"uri": "x"}], **overrides))
        rates = {k: keep_rate(chain, v) for k, v in sets.items()}
        why = ", ".join(f"{k} {n}" for k, n in rates["az"][1].most_common())
        print(f"| {name} | {rates['az'][0]:.1%} | {rates['en'][0]:.1%} | {rates['junk'][0]:.1%} | {why} |")
    lines = (args.data / "az/dev/xwmt_test.az-en.az.txt").read_text(encoding="utf-8").splitlines()
    sentences = [_detok(s) for s in lines]
    for name, overrides in (("before", BEFORE), ("after (defaults)", {})):
        language = dict(steps(CurateConfig(corpora=[{"uri": "x"}], **overrides)))["language"]
        kept, _ = keep_rate([("language", language)], sentences)
        print(f"language ID alone, {name}: {kept * len(sentences):.0f} of {len(sentences)} X-WMT sentences kept")


if __name__ == "__main__":
    main()
