#!/usr/bin/env python
"""CPT token cache build: MB of text per CPU-second and peak RSS of the whole process tree, by number of workers.

What is measured is the stage's own build (`dilforge_cpt.data.tokenize_to_file`: read, NFC, cut into shards,
tokenise on N spawned worker processes, pack, write each shard atomically, concatenate in order), run in a child
process per setting so that its CPU seconds (`RUSAGE_CHILDREN`: the child and its workers) and peak memory
(summed RSS of the child and its descendants, sampled every 0.2 s) are its own. Every setting must produce the
same bytes (checked: sha256 of the cache file).

Input: a deterministic synthetic Azerbaijani corpus of `--size-mb`, generated under `--work` from the shared
training text (lines drawn by a seeded RNG, words given inflectional suffixes and numbers, so distinct words keep
growing with the size); `--corpus FILE` uses a file instead. Tokenizer: `--tokenizer DIR` (a tokenizer.json), else
a 16k byte-level BPE with ChatML specials (SmolLM2's family, as the main job) trained here on 20,000 lines.

    OMP_NUM_THREADS=1 python bench/cpt_cache.py --data ../shared/data --size-mb 200 --workers 1 2

`measure(corpus, tokenizer_dir, workers, work)` is the reusable part (bench/scale.py may call it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402
from scale import TreeSampler, generate  # noqa: E402  the corpus and the process-tree sampler of bench/scale.py


def make_tokenizer(corpus: Path, out: Path, vocab: int = 16_000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (out / "tokenizer.json").is_file():
        return out
    with open(corpus, encoding="utf-8") as f:
        texts = [next(f) for _ in range(20_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


CHILD = """
import json, sys, time
from pathlib import Path
from dilforge_cpt import data
from dilforge_shared.configs import DataSource
corpus, tok_dir, cache, workers = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
tok = data.load_tokenizer(tok_dir)
ids = data.special_ids(tok, str(tok_dir))
start = time.perf_counter()
tf = data.tokenize_to_file(DataSource(uri=corpus), tok, ids, cache, "bench", None, 1000, None, workers=workers)
print(json.dumps({"wall_s": time.perf_counter() - start, "num_tokens": tf.num_tokens, "num_docs": tf.num_docs,
                  "sha256": json.loads((cache / "bench.json").read_text())["sha256"]}))
"""


def measure(corpus: Path, tokenizer_dir: Path, workers: int, work: Path) -> dict:
    """Build the cache of `corpus` from scratch with `workers` workers in a child process; its numbers."""
    cache = work / f"cache-w{workers}"
    if cache.exists():
        for p in sorted(cache.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", CHILD, str(corpus), str(tokenizer_dir), str(cache), str(workers)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    with TreeSampler(proc.pid) as sampler:
        stdout, _ = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"cache build with {workers} workers failed (exit {proc.returncode})")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(stdout.strip().splitlines()[-1])
    mb = corpus.stat().st_size / 1e6
    return {
        "workers": workers,
        "corpus_mb": round(mb, 1),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "mb_per_cpu_s": round(mb / cpu, 3),
        "mb_per_wall_s": round(mb / wall, 3),
        "peak_gib": round(sampler.peak / 2**30, 3),  # PSS of the tree (forked/spawned workers' shared pages once)
        "peak_rss_sum_gib": round(sampler.peak_rss / 2**30, 3),
        "num_tokens": result["num_tokens"],
        "num_docs": result["num_docs"],
        "sha256": result["sha256"],
    }


def reader_rate(corpus: Path) -> float:
    """MB per CPU-second of the build's reading process alone (read, NFC, cut into shards, pickle them for the
    workers): the rate past which more workers stop helping."""
    import pickle

    from dilforge_cpt.data import SHARD_CHARS, _cut
    from dilforge_shared.corpus import iter_texts

    start = time.process_time()
    for _, _, texts in _cut(iter_texts(str(corpus)), SHARD_CHARS):
        pickle.dumps(texts)
    return corpus.stat().st_size / 1e6 / (time.process_time() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--corpus", type=Path, help="a text file instead of the generated corpus")
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: trained here)")
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="none: only the reading process's rate")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dilforge-bench-cpt-cache"))
    args = ap.parse_args()
    print(describe("tokenizers"))
    corpus = args.corpus or generate(args.data, args.work / f"corpus-{args.size_mb:g}mb.txt", args.size_mb)
    tok_dir = args.tokenizer or make_tokenizer(corpus, args.work / "tokenizer")
    print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:.1f} MB), tokenizer {tok_dir}")
    print(f"reading process alone (read, NFC, cut, pickle): {reader_rate(corpus):.1f} MB per CPU-second")
    rows = [measure(corpus, tok_dir, w, args.work) for w in args.workers]
    if not rows:
        return
    print("| workers | corpus MB | wall s | CPU s | MB / CPU-s | MB / wall-s | peak PSS (tree) GiB | tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['corpus_mb']} | {r['wall_s']} | {r['cpu_s']} | {r['mb_per_cpu_s']} | "
            f"{r['mb_per_wall_s']} | {r['peak_gib']} | {r['num_tokens']:,} |"
        )
    same = len({r["sha256"] for r in rows}) == 1
    print(f"cache bytes identical across worker counts: {same} (sha256 {rows[0]['sha256'][:16]}…)")
    print(json.dumps(rows))
    if not same:
        raise SystemExit("the cache bytes depend on the number of workers")


if __name__ == "__main__":
    main()
