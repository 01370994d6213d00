"""Scale: MB per CPU-second and peak memory of the whole process tree, per stage, at growing corpus sizes.

The corpus is generated deterministically from the shared Azerbaijani text (`generate`): a word-bigram model of
the training files whose words are inflected with random Azerbaijani suffix chains (-lar, -da, -ın, ...), so that,
as in real text, distinct words and distinct lines keep growing with the size (Heaps' law) instead of repeating.
Each stage runs through the coordinator (`coordinator run-all` on a one-stage config, a fresh store), as users run
it; a sampler sums the PSS (and, as an upper bound, the RSS) of the coordinator and every descendant every
0.2 s (peak of the process tree) and the
CPU seconds are those of the whole tree (os.wait4). Growth exponents are fitted between consecutive sizes:
log(y2 / y1) / log(size2 / size1) (1.0 = linear; 0 = flat).

    python bench/scale.py --data ../shared/data --stage tokenizer-extend --sizes 20 80
    python bench/scale.py --data ../shared/data --stage tokenizer-extend --stage tokenizer-replace --sizes 200 800 1600
    python bench/scale.py --data ../shared/data --generate-only --sizes 1600     # the corpus alone (cached)

Stages: tokenizer-extend (16k new tokens over SmolLM2, as the main job), tokenizer-replace (50k), cpt-cache (the CPT
stage's token cache build alone, through bench/cpt_cache.py, on every core), curate (datatrove, default tasks and workers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORD = re.compile(r"\w+(?:[-'’]\w+)*|[^\w\s]")
# Azerbaijani suffixes (plural, cases, possessives, copula, verb forms), both harmony variants
SUFFIXES = [
    "lar",
    "lər",
    "da",
    "də",
    "dan",
    "dən",
    "ın",
    "in",
    "un",
    "ün",
    "a",
    "ə",
    "ı",
    "i",
    "u",
    "ü",
    "nın",
    "nin",
    "ya",
    "yə",
    "dır",
    "dir",
    "dur",
    "dür",
    "mız",
    "miz",
    "muz",
    "müz",
    "sı",
    "si",
    "su",
    "sü",
    "ları",
    "ləri",
    "dakı",
    "dəki",
    "çı",
    "çi",
    "lı",
    "li",
    "sız",
    "siz",
    "maq",
    "mək",
    "ıb",
    "ib",
    "acaq",
    "əcək",
    "mış",
    "miş",
]


def generate(data: Path, out: Path, size_mb: float, seed: int = 0) -> Path:
    """`out` (a .txt of about size_mb MB, one document per line), made once per (size, seed) and reused."""
    if out.is_file() and out.stat().st_size >= size_mb * 1e6 * 0.99:
        return out
    rng = random.Random(seed)
    follow: dict[str, list[str]] = {}
    starts: list[str] = []
    for path in sorted((data / "az" / "train").glob("*.txt")):
        for line in path.open(encoding="utf-8"):
            words = WORD.findall(line)
            if len(words) < 3:
                continue
            starts.append(words[0])
            for a, b in zip(words, words[1:], strict=False):
                follow.setdefault(a, []).append(b)
    tmp = out.with_suffix(".part")
    written = 0
    with tmp.open("w", encoding="utf-8") as f:
        while written < size_mb * 1e6:
            word = rng.choice(starts)
            doc = []
            for _ in range(rng.randint(20, 400)):
                if word[0].isalpha() and rng.random() < 0.3:  # an inflected form: new distinct words keep coming
                    doc.append(word + "".join(rng.choice(SUFFIXES) for _ in range(rng.randint(1, 3))))
                else:
                    doc.append(word)
                options = follow.get(word)
                word = rng.choice(options) if options else rng.choice(starts)
            line = " ".join(doc).replace(" ,", ",").replace(" .", ".") + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    tmp.replace(out)
    return out


class TreeSampler:
    """Peaks of the summed memory of a process and all its descendants, sampled every `interval` seconds: PSS
    (each shared page divided among the processes sharing it: what the tree really holds, forked workers' shared
    pages once) and RSS (shared pages counted in every process: an upper bound)."""

    def __init__(self, pid: int, interval: float = 0.2):
        import psutil

        self.proc, self.peak, self.peak_rss, self.interval = psutil.Process(pid), 0, 0, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            pss = rss = 0
            with contextlib.suppress(psutil.Error):
                for p in [self.proc, *self.proc.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        info = p.memory_full_info()
                        pss, rss = pss + info.pss, rss + info.rss
            self.peak, self.peak_rss = max(self.peak, pss), max(self.peak_rss, rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Run `cmd`; wall seconds, CPU seconds of the whole tree, peak tree PSS and RSS (GiB), exit code."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with TreeSampler(proc.pid) as sampler:
            _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_gib": round(sampler.peak / 2**30, 3),
        "peak_rss_sum_gib": round(sampler.peak_rss / 2**30, 3),
    }


def smollm2_tokenizer(cache: Path) -> str:
    """SmolLM2-135M-Instruct's tokenizer folder, imported through the project's own recipe (cached)."""
    store = cache / "test-store"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilforge_coordinator.cli",
            "models",
            "import",
            "smollm2-135m-instruct",
            "--store",
            str(store),
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    from dilforge_shared.models import resolve
    from dilforge_shared.store import fetch

    return str(resolve(fetch(proc.stdout.strip().splitlines()[-1].split("artifact: ")[1]), "tokenizer").path)


def stage_config(stage: str, corpus: Path, data: Path, cache: Path, base_tokenizer: str | None = None) -> dict:
    flores = str(data / "az/dev/flores200.dev.partial_from_sib200.tsv")
    validation = [
        {"uri": flores, "text_field": "azj_Latn", "name": "az"},
        {"uri": flores, "text_field": "eng_Latn", "name": "en"},
    ]
    if stage == "tokenizer-extend":
        section = {
            "strategy": "extend",
            "base_tokenizer": base_tokenizer or smollm2_tokenizer(cache),
            "num_new_tokens": [16000],
            "corpora": [{"uri": str(corpus), "name": "corpus"}],
            "validation": validation,
            "selection_set": "az",
            "prune_dead": True,
        }
        return {"tokenizer": section}
    if stage == "tokenizer-replace":
        section = {"strategy": "replace", "vocab_sizes": [50000], "corpora": [{"uri": str(corpus), "name": "corpus"}]}
        return {"tokenizer": {**section, "validation": validation}}
    if stage == "curate":
        return {"curate": {"corpora": [{"uri": str(corpus), "name": "web"}]}}
    raise SystemExit(f"unknown stage {stage!r}")


def run_stage(stage: str, corpus: Path, data: Path, cache: Path, work: Path, **overrides) -> dict:
    """One stage on `corpus` through the coordinator (fresh store under `work`); `overrides` go into its section
    (`base_tokenizer` is a tokenizer-extend argument)."""
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DILFORGE_WORKDIR": str(work / "work"), "DILFORGE_CACHE": str(cache)}
    if stage == "cpt-cache":  # the stage's own build (bench/cpt_cache.py), SmolLM2's tokenizer, every core
        from cpt_cache import measure
        from dilforge_shared.workers import available_cpus

        tok = overrides.pop("base_tokenizer", None) or smollm2_tokenizer(cache)
        row = measure(corpus, Path(tok), available_cpus(), work)
        return {"rc": 0, **{k: row[k] for k in ("wall_s", "cpu_s", "peak_gib", "peak_rss_sum_gib", "num_tokens")}}
    sections = stage_config(stage, corpus, data, cache, overrides.pop("base_tokenizer", None))
    for section in sections.values():
        section.update(overrides)
    cfg = {"run_id": f"scale-{stage}", "store": {"uri": str(work / "store")}, **sections}
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    cmd = [sys.executable, "-m", "dilforge_coordinator.cli", "run-all", "-c", str(path)]
    row = measured(cmd, env, work / "log.txt")
    for metrics in (work / "store" / "artifacts").glob("tokenizer/*/data-*/metrics.json"):  # fertility, budget
        m = json.loads(metrics.read_text())
        row |= {f"tokens_per_word_{k}": v["tokens_per_word"] for k, v in m["languages"].items()}
        row["pretokens"] = m["corpus"].get("pretokens")
    return row


def exponent(rows: list[dict], key: str) -> list[float]:
    return [
        round(math.log(b[key] / a[key]) / math.log(b["mb"] / a["mb"]), 2)
        for a, b in zip(rows, rows[1:], strict=False)
        if a[key] > 0 and b[key] > 0
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="the shared data folder (../shared/data)")
    p.add_argument(
        "--stage", action="append", default=[], help="tokenizer-extend, tokenizer-replace, cpt-cache, curate"
    )
    p.add_argument("--sizes", type=float, nargs="+", default=[20, 80], help="corpus sizes in MB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-dir", type=Path, default=Path(tempfile.gettempdir()) / "dilforge-scale")
    p.add_argument("--generate-only", action="store_true")
    p.add_argument("--max-pretokens", type=int, default=None, help="tokenizer stages: override max_pretokens")
    p.add_argument(
        "--max-lines", type=int, default=None, help="tokenizer stages: train on the first N lines (the sampling choice)"
    )
    args = p.parse_args()
    from dilforge_shared.settings import cache_root

    print(describe("tokenizers", "datatrove"))
    args.corpus_dir.mkdir(parents=True, exist_ok=True)
    corpora = {}
    for size in args.sizes:
        t0 = time.process_time()
        corpora[size] = generate(args.data, args.corpus_dir / f"az-{size:g}mb-seed{args.seed}.txt", size, args.seed)
        print(f"corpus {size:g} MB: {corpora[size]} ({time.process_time() - t0:.0f} CPU-s to generate)", flush=True)
    if args.generate_only:
        return
    results = {}
    for stage in args.stage:
        rows = []
        for size in args.sizes:
            with tempfile.TemporaryDirectory(prefix=f"scale-{stage}-") as work:
                asked = {"max_pretokens": args.max_pretokens, "max_lines": args.max_lines}
                overrides = {k: v for k, v in asked.items() if v is not None} if "tokenizer" in stage else {}
                row = run_stage(stage, corpora[size], args.data, cache_root(), Path(work), **overrides)
                if row["rc"] != 0:
                    print((Path(work) / "log.txt").read_text()[-3000:])
            mb = corpora[size].stat().st_size / 1e6
            row = {"mb": round(mb, 1), **row, "mb_per_cpu_s": round(mb / max(row["cpu_s"], 1e-9), 3)}
            rows.append(row)
            print(f"{stage:18s} {json.dumps(row)}", flush=True)
        results[stage] = rows
        print(
            f"{stage:18s} growth exponents between sizes: CPU seconds {exponent(rows, 'cpu_s')}, "
            f"peak memory {exponent(rows, 'peak_gib')}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
