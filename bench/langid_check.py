"""Validate the eval stage's model-free language ID (dilforge_eval/tasks/utils.py: detect_language) on the
aligned FLORES dev and X-WMT sentences: accuracy per set and language, and every miss printed.

    python bench/langid_check.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.environ.get("DILFORGE_DATA", str(ROOT.parent / "shared" / "data")))
    args = ap.parse_args()
    from dilforge_eval.tasks.utils import detect_language
    from dilforge_shared.corpus import iter_texts

    data = Path(args.data)
    flores = str(data / "az/dev/flores200.dev.partial_from_sib200.tsv")
    sets = {
        "flores-dev": (
            list(iter_texts(flores, text_field="azj_Latn")),
            list(iter_texts(flores, text_field="eng_Latn")),
        ),
        "xwmt": (
            list(iter_texts(str(data / "az/dev/xwmt_test.az-en.az.txt"))),
            list(iter_texts(str(data / "az/dev/xwmt_test.az-en.en.txt"))),
        ),
    }
    print(describe())
    total = right = 0
    print("| set | language | sentences | right | accuracy |\n|---|---|---:|---:|---:|")
    misses = []
    for name, (az, en) in sets.items():
        for lang, texts in (("az", az), ("en", en)):
            ok = 0
            for t in texts:
                got = detect_language(t)
                ok += got == lang
                if got != lang:
                    misses.append(f"{name}/{lang} -> {got}: {t}")
            total, right = total + len(texts), right + ok
            print(f"| {name} | {lang} | {len(texts)} | {ok} | {ok / len(texts):.4f} |")
    print(f"\nall: {right} / {total} = {right / total:.4f}")
    for m in misses:
        print("miss:", m)


if __name__ == "__main__":
    main()
