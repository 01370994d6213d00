"""Curate stage throughput, memory and cost, against a plain datatrove pipeline doing the same steps.

Input: web-like documents (10 consecutive lines of the shared training text each, the dirty corpus of
bench/dirty_corpus.py mixed in) repeated to `--size-mb`, written as `--num-files` JSONL files (datatrove's stock
reader parallelises by file, so the plain pipeline gets its best case). Both pipelines run with the same tasks and
worker processes, one after the other, on the same input:

- stage: the curate stage's pipelines (services/curate stage.build/execute, report collected), as users run them;
- plain: datatrove's own steps in their usual order (JsonlReader, FTFYFormatter, PIIFormatter, the same lingua
  filter, Gopher repetition, FineWeb quality, Gopher quality, JsonlWriter, the four MinHash steps). It has no
  phone or card redaction (datatrove has none) and no report.

Prints MB/s and documents/s per core, MB and documents per CPU-second (user + system time of this process and the
worker processes it waited for, from `getrusage`: on a loaded machine the number to compare; also as sampled every
0.2 s, which misses what a worker spent after its last sample), peak memory of the process tree (PSS, sampled), the
ratio stage/plain, and the cost of 10 GB on N instances extrapolated from MB/s per core.
`--max-chars` sets `language_id.max_chars` (the stage's default otherwise). `--steps` prints instead the CPU
seconds per MB of each step of the filter phase and of the MinHash signatures, run one after the other over the
input in this process (where the stage's time goes).

    python bench/curate.py --data ../shared/data --size-mb 50
    python bench/curate.py --data ../shared/data --size-mb 1024 --skip-plain     # memory on a 1 GB input
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "curate"))
from dirty_corpus import build, score  # noqa: E402
from hardware import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# on-demand prices, us-east-1, for the extrapolation only (ml.m5.xlarge: 4 vCPU = 2 cores)
INSTANCE = ("ml.m5.xlarge", 2, 0.23)


def make_input(data: Path, out: Path, size_mb: float, num_files: int, seed: int = 0) -> tuple[int, int]:
    """Write `num_files` JSONL files of about size_mb in all; returns (documents, bytes)."""
    rng = random.Random(seed)
    lines = []
    for f in sorted((data / "az/train").glob("*.txt")):
        lines += [x.strip() for x in f.open(encoding="utf-8") if x.strip()]
    docs = ["\n".join(lines[i : i + 10]) for i in range(0, len(lines) - 9, 10)]
    build(data, out / "dirty")
    docs += [json.loads(x)["text"] for x in (out / "dirty" / "web.jsonl").open(encoding="utf-8")]
    rng.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    n = written = 0
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(out / f"in-{i:03d}.jsonl", "w", encoding="utf-8")) for i in range(num_files)]
        while written < size_mb * 1e6:
            for doc in docs:
                line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
                files[n % num_files].write(line)
                n += 1
                written += len(line.encode())
                if written >= size_mb * 1e6:
                    break
    return n, written


class PeakMemory:
    """Peak summed PSS (proportional set size: a page the stage shares with the workers it forked counts once) of
    this process and all its descendants, and the CPU seconds they used (each process's last sample, less this
    sampler's own), sampled every 0.2 s: forked or forkserver workers alike."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._rusage = _rusage_seconds()
        self.cpu: dict[int, float] = {}
        times = self.proc.cpu_times()
        self._start, self._sampler = times.user + times.system, 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            total = 0
            for p in [self.proc, *self.proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_full_info().pss
                    times = p.cpu_times()
                    self.cpu[p.pid] = times.user + times.system
            self.peak = max(self.peak, total)
            self._sampler = time.thread_time()
            time.sleep(0.2)

    @property
    def cpu_seconds(self) -> float:
        return sum(self.cpu.values()) - self._start - self._sampler

    @property
    def cpu_seconds_exact(self) -> float:
        """This process's CPU seconds and those of every child it waited for (`getrusage`), less the sampler's: the
        CPU a worker process spent after its last sample, which `cpu_seconds` misses, included."""
        return _rusage_seconds() - self._rusage - self._sampler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def _rusage_seconds() -> float:
    import resource

    return sum(
        r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


MAX_CHARS: dict = {}  # language_id.max_chars when --max-chars is given


def run_stage(inp: Path, work: Path, tasks: int, workers: int) -> dict:
    from dilforge_curate import report, stage
    from dilforge_curate.config import CurateConfig

    config = CurateConfig(
        corpora=[{"uri": str(inp), "name": "web"}],
        output={"num_shards": tasks},
        num_workers=workers,
        language_id=MAX_CHARS,
    )
    folder = work / "work"
    (work / "out").mkdir(parents=True)
    stage.execute(stage.build(config, stage.Folders(folder, folder)), folder)
    for shard in sorted((folder / "out").glob("shard-*")):  # published next to the report, as the stage's run does
        shutil.move(shard, work / "out" / shard.name)
    metrics = report.collect(folder, config, {})
    report.write(work / "out", config, metrics)
    return {"read": metrics.documents_read, "kept": metrics.documents_kept, "out": work / "out"}


def run_plain(inp: Path, work: Path, tasks: int, workers: int) -> dict:
    """The same steps from datatrove's catalogue, wired as its examples do."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.formatters import FTFYFormatter, PIIFormatter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig
    from dilforge_curate.config import CurateConfig, LanguageConfig
    from dilforge_curate.stage import datatrove_console
    from dilforge_curate.steps import LinguaFilter, WordSplitter

    q = CurateConfig(corpora=[{"uri": "x"}]).quality
    words = WordSplitter()
    mh = MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"))
    filtered = str(work / "filtered")
    steps1 = [
        JsonlReader(str(inp), glob_pattern="in-*.jsonl"),
        FTFYFormatter(),
        PIIFormatter(remove_ips=False),
        LinguaFilter("az", LanguageConfig(max_chars=2000)),
        GopherRepetitionFilter(
            dup_line_frac=q.dup_line_frac, top_n_grams=q.top_n_grams, dup_n_grams=q.dup_n_grams, language=words
        ),
        FineWebQualityFilter(line_punct_thr=q.line_punct_thr, new_line_ratio=q.new_line_ratio, language=words),
        GopherQualityFilter(
            min_avg_word_length=q.min_avg_word_length,
            max_avg_word_length=q.max_avg_word_length,
            max_non_alpha_words_ratio=q.max_non_alpha_words_ratio,
            stop_words=q.stop_words,
            language=words,
        ),
        JsonlWriter(filtered, output_filename="${rank}.jsonl", compression=None),
        MinhashDedupSignature(str(work / "sigs"), config=mh, language=words),
    ]
    phases = [
        (steps1, tasks),
        ([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=mh)], mh.num_buckets),
        ([MinhashDedupCluster(str(work / "buckets"), str(work / "ids"), config=mh)], 1),
        (
            [
                JsonlReader(filtered, compression=None),
                MinhashDedupFilter(str(work / "ids")),
                JsonlWriter(str(work / "out"), compression=None),
            ],
            tasks,
        ),
    ]
    (work / "logs").mkdir(parents=True)
    for i, (steps, n) in enumerate(phases):
        with datatrove_console(work / "logs" / "console.log"):
            LocalPipelineExecutor(steps, tasks=n, workers=min(workers, n), logging_dir=str(work / f"logs/{i}")).run()
    kept = sum(1 for f in (work / "out").glob("*.jsonl") for _ in f.open())
    return {"kept": kept}


def step_costs(source: str, size: int) -> None:
    """CPU seconds per MB of each filter-phase step, each run over the documents the step before it kept."""
    from dilforge_curate import stage
    from dilforge_curate.config import CurateConfig

    config = CurateConfig(corpora=[{"uri": source, "name": "web"}], output={"num_shards": 1}, language_id=MAX_CHARS)
    work = Path("/tmp/dilforge-bench-curate-steps")
    steps = stage.build(config, stage.Folders(work, work))["filter"].pipeline
    mb = size / 1e6
    t = time.process_time()
    docs = list(steps[0].run(None, 0, 1))
    print(f"| read | {len(docs):,} | {(time.process_time() - t) / mb:.3f} |")
    for step in steps[1:-2]:  # the writer and the signatures last
        if hasattr(step, "_build"):
            step._build()  # models loaded before timing, as the stage does before forking
        t = time.process_time()
        kept = list(step.run(iter(docs), 0, 1))
        print(f"| {step.name} | {len(docs):,} | {(time.process_time() - t) / mb:.3f} |", flush=True)
        docs = kept
    t = time.process_time()
    for doc in docs:
        steps[-1].get_signature(steps[-1].get_shingles(doc.text))
    print(f"| MinHash signatures | {len(docs):,} | {(time.process_time() - t) / mb:.3f} |")
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", ROOT.parent / "shared/data")))
    ap.add_argument("--size-mb", type=float, default=50)
    ap.add_argument("--num-files", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--max-chars", type=int, help="language_id.max_chars of the stage (default: the config's)")
    ap.add_argument("--steps", action="store_true", help="CPU seconds per MB of each filter-phase step, then stop")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dilforge-bench-curate"))
    args = ap.parse_args()
    if args.max_chars:
        MAX_CHARS["max_chars"] = args.max_chars
    print(describe("datatrove", "lingua-language-detector", "ftfy"), flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    docs, size = make_input(args.data, args.workdir / "input", args.size_mb, args.num_files)
    source = str(args.workdir / "input" / "in-*.jsonl")
    cores = len(os.sched_getaffinity(0))
    print(f"input: {docs:,} documents, {size / 1e6:,.1f} MB in {args.num_files} files; {args.tasks} tasks, "
          f"{args.workers} workers, {cores} cores", flush=True)  # fmt: skip
    if args.steps:
        print("| step | documents in | CPU s per MB |\n|---|---:|---:|")
        step_costs(source, size)
        return
    dirty = run_stage(args.workdir / "input" / "dirty" / "web.jsonl", args.workdir / "dirty", args.tasks, args.workers)
    labels = json.loads((args.workdir / "input" / "dirty" / "labels.json").read_text())
    kept = [json.loads(x) for f in sorted(dirty["out"].glob("shard-*.jsonl")) for x in f.open(encoding="utf-8")]
    print(f"dirty corpus ({len(labels)} documents, bench/dirty_corpus.py): {json.dumps(score(kept, labels))}")
    results = {}
    for name, fn in (("stage", run_stage), ("plain", run_plain)):
        if name == "plain" and args.skip_plain:
            continue
        t = time.perf_counter()
        with PeakMemory() as mem:
            out = fn(Path(source) if name == "stage" else args.workdir / "input", args.workdir / name, args.tasks,
                     args.workers)  # fmt: skip
        s, cpu, sampled = time.perf_counter() - t, mem.cpu_seconds_exact, mem.cpu_seconds
        results[name] = s
        print(
            f"{name}: {cpu:,.1f} CPU-s (process tree, getrusage), {size / 1e6 / cpu:.3f} MB per CPU-second, "
            f"{docs / cpu:,.0f} documents per CPU-second (sampled every 0.2 s: {sampled:,.1f} CPU-s, "
            f"{size / 1e6 / sampled:.3f} MB per CPU-second)",
            flush=True,
        )
        print(
            f"{name}: {s:,.1f} s, {size / 1e6 / s / cores:.2f} MB/s per core, {docs / s / cores:,.0f} docs/s per "
            f"core, peak memory {mem.peak / 2**30:.2f} GiB (PSS, process tree), kept {out['kept']:,}",
            flush=True,
        )
        shutil.rmtree(args.workdir / name, ignore_errors=True)
    if "plain" in results:
        print(f"throughput ratio stage/plain: {results['plain'] / results['stage']:.2f}x")
    per_core = size / 1e6 / results["stage"] / cores  # MB/s per core
    name, inst_cores, price = INSTANCE
    for n in (1, 4, 16):
        hours = 10_000 / (per_core * inst_cores * n) / 3600
        print(
            f"10 GB on {n} x {name} ({inst_cores} cores each, ${price}/h): {hours:.2f} h, ${hours * n * price:.2f} "
            "(linear in MB/s per core; MinHash buckets and cluster phases included in the measured rate)"
        )


if __name__ == "__main__":
    main()
