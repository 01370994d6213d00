#!/usr/bin/env python
"""Tokenizer stage vs a bare `tokenizers` BPE training on the same files and vocab size.

Both run as fresh processes, alternately, `--repeats` times each: the stage through its real
entrypoint (`python -m dilforge_tokenizer train`: config parsing, one streamed pass with held-out
slice, training, the sweep metrics, writing and publishing the artifact) and the baseline as
`Tokenizer.train(files)` with the same pre-tokenizer, trainer settings and vocab size, saving
tokenizer.json. Reported: wall time and peak RSS of each process (min over repeats) and their
ratio, then encode throughput of the stage's tokenizer (and of --base, e.g. Llama 3.2).

    python bench/tokenizer.py --data ../shared/data [--vocab-size 50000] [--repeats 2] [--base DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hardware  # bench/hardware.py

REPO = Path(__file__).resolve().parents[1]

BASELINE = """
import sys
from dilforge_shared.families import LLAMA3
from dilforge_tokenizer import bpe, family_out, llama3
files, size, out = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
tok = llama3.empty_bpe()
tok.train(files, bpe.trainer(size, 2))
family_out.finish(tok, LLAMA3).save(out)
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds (user + system) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def stage_cmd(files: list[str], size: int, validation: str, work: Path, i: int) -> tuple[list[str], dict]:
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_shared.contract import OptMl

    config = {
        "strategy": "replace",
        "corpora": [{"uri": f} for f in files],
        "vocab_sizes": [size],
        "validation": [{"uri": validation, "text_field": "azj_Latn", "name": "flores_dev"}],
    }
    opt = OptMl(work / f"optml-{i}")
    write_inputs(
        opt,
        {
            "stage_config": json.dumps(config),
            "artifact_uri": str(work / f"store/artifacts/tokenizer/{i}"),
            "run_id": "bench",
        },
    )
    return [sys.executable, "-m", "dilforge_tokenizer", "train"], {**os.environ, "DILFORGE_OPT_ML": str(opt.root)}


def throughput(tokenizer_json: Path, texts: list[str], rounds: int = 5) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    nbytes = sum(len(t.encode()) for t in texts)
    tok.encode_batch(texts[:100])
    start = time.perf_counter()
    ntok = 0
    for _ in range(rounds):
        ntok += sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    batch_s = time.perf_counter() - start
    start = time.perf_counter()
    for t in texts:
        tok.encode(t, add_special_tokens=False)
    single_s = time.perf_counter() - start
    return {
        "batch_mb_s": rounds * nbytes / batch_s / 1e6,
        "batch_tok_s": ntok / batch_s,
        "single_mb_s": nbytes / single_s / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", REPO.parent / "shared/data")))
    parser.add_argument("--vocab-size", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--base", type=Path, help="A base HF tokenizer folder to compare encode throughput with.")
    args = parser.parse_args()
    train = args.data / "az" / "train"
    files = sorted(glob.glob(str(train / "az_legal_codes.part*.txt"))) + [
        str(train / n) for n in ("azwiki_sentences_cv_extractor.txt", "tatoeba_aze_sentences.txt", "udhr_azj_latn.txt")
    ]
    validation = str(args.data / "az/dev/flores200.dev.partial_from_sib200.tsv")
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(
        f"# tokenizer bench\n{hardware.describe('tokenizers')}\ninput: {len(files)} files, {mb:.1f} MB; vocab size {args.vocab_size}; "
        f"min_frequency 2; RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}\n"
    )
    runs: dict[str, list[tuple[float, float, float]]] = {"bare": [], "stage": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.repeats):
            runs["bare"].append(
                timed(
                    [
                        sys.executable,
                        "-c",
                        BASELINE,
                        ",".join(files),
                        str(args.vocab_size),
                        str(work / f"bare-{i}.json"),
                    ]
                )
            )
            cmd, env = stage_cmd(files, args.vocab_size, validation, work, i)
            runs["stage"].append(timed(cmd, env))
            print(
                f"repeat {i}: bare {runs['bare'][-1][0]:.2f} s wall / {runs['bare'][-1][2]:.2f} s CPU, "
                f"stage {runs['stage'][-1][0]:.2f} s wall / {runs['stage'][-1][2]:.2f} s CPU",
                flush=True,
            )
        bare = [min(r[k] for r in runs["bare"]) for k in range(3)]
        stage = [min(r[k] for r in runs["stage"]) for k in range(3)]
        print("\n| process | wall s (min) | CPU s (min) | peak RSS MiB |\n|---|---:|---:|---:|")
        print(f"| bare tokenizers training | {bare[0]:.2f} | {bare[2]:.2f} | {bare[1]:.0f} |")
        print(f"| tokenizer stage (entrypoint, publish included) | {stage[0]:.2f} | {stage[2]:.2f} | {stage[1]:.0f} |")
        print(
            f"| ratio stage / bare | {stage[0] / bare[0]:.3f} | {stage[2] / bare[2]:.3f} | {stage[1] / bare[1]:.2f} |"
        )
        print(f"\nload average at the end: {os.getloadavg()}")

        from dilforge_shared.corpus import iter_texts

        texts = list(iter_texts(validation, text_field="azj_Latn"))
        texts += list(iter_texts(str(train / "azwiki_sentences_cv_extractor.txt")))[:5000]
        out = next((work / "store/artifacts/tokenizer/0").glob("data-*"))
        rows = {
            "stage tokenizer": throughput(out / "tokenizer.json", texts),
            "bare training's tokenizer": throughput(work / "bare-0.json", texts),
        }
        if args.base:
            rows[f"base {args.base.name}"] = throughput(args.base / "tokenizer.json", texts)
        print(f"\nencode throughput on {len(texts)} lines (FLORES dev + wiki), no special tokens:\n")
        print(
            "| tokenizer | encode_batch MB/s | encode_batch tokens/s | encode (one by one) MB/s |\n|---|---:|---:|---:|"
        )
        for name, r in rows.items():
            print(f"| {name} | {r['batch_mb_s']:.2f} | {r['batch_tok_s']:,.0f} | {r['single_mb_s']:.2f} |")
        metrics = json.loads(next((work / "store/artifacts/tokenizer/0").glob("manifest.json")).read_text())["metrics"]
        print(f"\nstage phases (repeat 0): {metrics['seconds']}")


if __name__ == "__main__":
    main()
