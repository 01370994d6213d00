"""The curate stage's faster steps against the library code they replace, on the same documents.

Builds bench/curate.py's web-like input (`--size-mb`, one file), runs the stage's filter-phase steps over it once
to collect the documents each step receives, then times, one after the other in this process (`--rounds`, best
of), datatrove's or ftfy's own code and the stage's step on every `--every`-th of those documents, and counts the
outputs that differ: ftfy's `fix_text` then the rest of the Normaliser vs the Normaliser; datatrove's
`GopherRepetitionFilter` vs `RepetitionFilter`; `GopherQualityFilter` vs `QualityFilter` (which differs on
purpose: docs/curate.md); datatrove's MinHash shingles vs `MinhashSignature`'s. Prints CPU seconds per MB of the
input, as `bench/curate.py --steps`.

    python bench/curate_steps.py --data ../shared/data --size-mb 10 --every 4 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "curate"))
from curate import make_input  # noqa: E402
from hardware import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def step_inputs(source: str, work: Path) -> dict[str, list[str]]:
    """The texts entering each filter-phase step, by step name (and `minhash`: those the signatures get)."""
    from dilforge_curate import stage
    from dilforge_curate.config import CurateConfig

    config = CurateConfig(corpora=[{"uri": source, "name": "web"}], output={"num_shards": 1})
    steps = stage.build(config, stage.Folders(work, work))["filter"].pipeline
    docs = list(steps[0].run(None, 0, 1))
    texts = {}
    for step in steps[1:-2]:
        texts[type(step).__name__] = [d.text for d in docs]
        if hasattr(step, "_build"):
            step._build()
        docs = list(step.run(iter(docs), 0, 1))
    texts["minhash"] = [d.text for d in docs]
    return texts


def main() -> None:
    import ftfy
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.utils.hashing import HashConfig
    from dilforge_curate.config import CurateConfig
    from dilforge_curate.steps import (
        FTFY_CONFIG,
        MinhashSignature,
        Normaliser,
        QualityFilter,
        RepetitionFilter,
        WordSplitter,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", ROOT.parent / "shared/data")))
    ap.add_argument("--size-mb", type=float, default=10)
    ap.add_argument("--every", type=int, default=1, help="time every N-th document only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dilforge-bench-curate-steps-ab"))
    args = ap.parse_args()
    print(describe("datatrove", "ftfy"), flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    docs, size = make_input(args.data, args.workdir / "input", args.size_mb, 1)
    texts = {
        k: v[:: args.every] for k, v in step_inputs(str(args.workdir / "input" / "in-*.jsonl"), args.workdir).items()
    }
    mb = size / args.every / 1e6
    print(f"input: {docs:,} documents, {size / 1e6:,.1f} MB; every {args.every}: {mb:.2f} MB timed", flush=True)

    words = WordSplitter()
    plain = Normaliser(fix_encoding=False, unicode_form="NFC", whitespace=True)
    q = CurateConfig(corpora=[{"uri": "x"}]).quality
    rep = {"dup_line_frac": q.dup_line_frac, "top_n_grams": tuple(q.top_n_grams), "dup_n_grams": tuple(q.dup_n_grams)}
    rep_docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts["RepetitionFilter"])]
    quality = {
        "min_doc_words": q.min_words, "max_doc_words": q.max_words, "min_avg_word_length": q.min_avg_word_length,
        "max_avg_word_length": q.max_avg_word_length, "max_symbol_word_ratio": q.max_symbol_word_ratio,
        "max_non_alpha_words_ratio": q.max_non_alpha_words_ratio, "min_stop_words": q.min_stop_words,
        "stop_words": q.stop_words,
    }  # fmt: skip
    quality_docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts["QualityFilter"])]
    minhash = MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"))
    signatures = [
        cls(str(args.workdir / cls.__name__), config=minhash, language=words)
        for cls in (MinhashDedupSignature, MinhashSignature)
    ]
    signatures[1].get_shingles("ə")  # the mark class is built once per process, as before the stage's workers fork
    cases = [
        ("normalise (ftfy, NFC, whitespace)", texts["Normaliser"],
         lambda t: plain.format(ftfy.fix_text(t, config=FTFY_CONFIG)), Normaliser(True, "NFC", True).format),
        ("Gopher repetition", rep_docs,
         GopherRepetitionFilter(language=words, **rep).filter, RepetitionFilter(language=words, **rep).filter),
        ("Gopher quality", quality_docs,
         GopherQualityFilter(language=words, **quality).filter, QualityFilter(language=words, **quality).filter),
        ("MinHash shingles", texts["minhash"], lambda t: signatures[0].get_shingles(t).tolist(),
         lambda t: signatures[1].get_shingles(t).tolist()),
    ]  # fmt: skip
    print("| step | documents | library, CPU s per MB | stage | outputs |\n|---|---:|---:|---:|---|")
    for name, items, library, stage_step in cases:
        best, outputs = {}, {}
        for _ in range(args.rounds):
            for label, fn in (("library", library), ("stage", stage_step)):
                t = time.process_time()
                outputs[label] = [str(fn(x)) for x in items]
                best[label] = min(best.get(label, 1e9), time.process_time() - t)
        differ = sum(a != b for a, b in zip(outputs["library"], outputs["stage"], strict=True))
        same = f"{differ:,} differ" if differ else "identical"
        print(
            f"| {name} | {len(items):,} | {best['library'] / mb:.3f} | {best['stage'] / mb:.3f} | {same} |", flush=True
        )
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
