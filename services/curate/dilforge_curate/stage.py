"""The curate stage, top to bottom.

Four datatrove pipelines (filter: read, normalise, redact, language ID, quality, MinHash signatures;
buckets; clusters; write: drop duplicates, count tokens, shards) → datatrove's local executor → publish shards,
report.md, the data card and metrics. The work folder lives under /opt/ml/checkpoints, so a rerun resumes from
the tasks it can verify."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.errors import DilforgeError, InputError
from dilforge_shared.workers import available_cpus, die_with_parent

from . import report
from .config import CurateConfig
from .steps import (
    ContactRedactor,
    EmptyFilter,
    ExampleWriter,
    LinguaFilter,
    MinhashSignature,
    Normaliser,
    QualityFilter,
    RankFileReader,
    RepetitionFilter,
    SourceCounter,
    SourceReader,
    SourceReadError,
    WordSplitter,
    preload,
)

log = logging.getLogger("dilforge.curate")

PHASES = ("filter", "buckets", "cluster", "write")


class Stopped(DilforgeError):
    """SIGTERM (SageMaker stop, spot interruption, Ctrl-C of the coordinator): datatrove's pool is terminated."""


def _stop(signum, frame):
    raise Stopped(
        f"stopped by {signal.Signals(signum).name}; finished tasks are kept in the work folder, a rerun resumes"
    )


class StageExecutor(LocalPipelineExecutor):
    """Datatrove's local executor recording each task's CPU seconds beside its completion mark
    (`logs/<phase>/cpu/NNNNN`, for the metrics)."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        self._cpu_start = time.process_time()
        return super()._run_for_rank(rank, local_rank, node_rank)

    def mark_rank_as_completed(self, rank: int) -> None:
        with self.logging_dir.open(f"cpu/{rank:05d}", "w") as f:
            f.write(f"{time.process_time() - self._cpu_start:.3f}\n")
        super().mark_rank_as_completed(rank)


_FORKING: dict[str, int] = {}  # the pid of the process about to fork, seen by its child


def children_die_with_the_stage() -> None:
    """Every process this one forks (datatrove's workers and Manager, which inherit the work-folder lock) dies
    with its parent, even on `kill -9`, and on SIGTERM (the pool's terminate) as usual instead of raising
    `Stopped`: a killed stage leaves no orphan writing to the work folder or holding its lock."""

    def in_child() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent(_FORKING["parent"])

    if not _FORKING:
        _FORKING["parent"] = os.getpid()
        os.register_at_fork(before=lambda: _FORKING.update(parent=os.getpid()), after_in_child=in_child)


def run(config: CurateConfig, ctx: StageContext) -> StageResult:
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)  # raised in the main thread: the pool's `with` terminates its workers
    children_die_with_the_stage()
    log_config(config, {"num_tasks": config.output.num_shards, "num_workers": workers(config)})
    tokenizer = counting_tokenizer(config, ctx)  # a missing tokenizer is refused before the work folder is touched
    work = ctx.opt.checkpoint_dir / "curate"
    work.mkdir(parents=True, exist_ok=True)
    resume(work, config)
    seconds = execute(build(config, Folders(work, work), tokenizer, ctx.endpoint_url), work)
    for shard in sorted((work / "out").glob("shard-*")):  # a rerun after a failed publish rewrites them
        shutil.move(shard, ctx.opt.model_dir / shard.name)
    return finish(config, ctx.opt.model_dir, work, seconds, t0)


def workers(config: CurateConfig) -> int:
    """`num_workers`, or one process per core this process may run on, at most the tasks of the widest phase."""
    cores = config.num_workers or available_cpus()
    return max(1, min(cores, max(config.output.num_shards, config.dedup.num_buckets)))


def finish(config: CurateConfig, out_dir: Path, work: Path, seconds: dict[str, float], t0: float) -> StageResult:
    """Counts from the finished work folder; refuse an empty corpus or shards not holding exactly the documents
    counted; write report.md, README.md, metrics (`seconds.total`: the whole stage, these checks included)."""
    metrics = report.collect(work, config, seconds)
    report.check_not_empty(metrics, config)
    check_shards(out_dir, config, metrics.documents_kept)
    report.write(out_dir, config, metrics)
    metrics.seconds["total"] = round(time.perf_counter() - t0, 2)
    if metrics.mb_per_cpu_second:
        print(
            f"[curate] {metrics.mb_per_cpu_second:.2f} MB and {metrics.documents_per_cpu_second:,.0f} documents per "
            f"CPU-second ({metrics.cpu_seconds['total']:,.1f} CPU-s over every task)",
            flush=True,
        )
    return StageResult(metrics=metrics.model_dump(mode="json"))


# ---- resume: what a rerun can verify ------------------------------------------------------------------


def documents_in(path: Path) -> int:
    """Documents in a shard (JSONL lines, or Parquet rows from the file's footer); 0 when missing."""
    if not path.is_file():
        return 0
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _written(work: Path, phase: str, rank: int, step: int) -> int | None:
    """Documents the `step`-th pipeline step of task `rank` counted (datatrove's stats), None without stats."""
    try:
        steps = json.loads((work / "logs" / phase / "stats" / f"{rank:05d}.json").read_text())
        total = steps[step].get("stats", {}).get("total", 0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return total["total"] if isinstance(total, dict) else total


def task_problem(work: Path, config: CurateConfig, phase: str, rank: int) -> str | None:
    """Why a task datatrove marked complete cannot be trusted (outputs missing, cut short or not matching its
    stats); None when whole."""
    if phase in ("filter", "write"):  # the documents its last writer counted are all in its output file
        kept = _written(work, phase, rank, -2 if phase == "filter" else -1)
        if kept is None:
            return "no stats"
        out = work / "filtered" / f"{rank:05d}.jsonl"
        if phase == "write":
            out = work / "out" / f"shard-{rank:05d}.{config.output.format}"
        if documents_in(out) != kept:
            return f"{out.name} holds {documents_in(out)} of {kept} documents"
    if phase == "filter":
        record = struct.calcsize(f"<{config.dedup.hashes_per_bucket}QI")
        sizes = set()
        for bucket in range(config.dedup.num_buckets):
            sig = work / "signatures" / f"bucket_{bucket:03d}" / f"{rank:05d}.minhash.sig"
            if not sig.is_file():
                return f"{sig.parent.name}/{sig.name} missing"
            sizes.add(sig.stat().st_size)
        if len(sizes) != 1 or (size := sizes.pop()) % record or size // record > kept:
            return "MinHash signatures cut short"
    elif phase == "buckets":
        dups = work / "buckets" / f"{rank:05d}_00.dups"
        if not dups.is_file() or dups.stat().st_size % 16:
            return f"{dups.name} missing or cut short"
    elif phase == "cluster" and any(f.stat().st_size % 4 for f in (work / "remove_ids").glob("*.remove")):
        return "a .remove file cut short"
    return None


def resume(work: Path, config: CurateConfig, phases: tuple[str, ...] = PHASES) -> None:
    """Remove the completion marks of tasks whose outputs are not whole, so they rerun, and every later phase
    reruns in full."""
    later = False
    for phase in phases:
        dropped: list[str] = []
        for mark in sorted((work / "logs" / phase / "completions").glob("*")):  # none when the phase never ran
            problem = "an earlier phase reruns" if later else task_problem(work, config, phase, int(mark.name))
            if problem:
                mark.unlink()
                dropped.append(f"{int(mark.name)}: {problem}")
        if dropped:
            later = True
            print(
                f"[curate] {phase}: {len(dropped)} finished task(s) cannot be verified and rerun ({dropped[0]}"
                + (", …" if len(dropped) > 1 else "")
                + ")",
                flush=True,
            )


def check_shards(out_dir: Path, config: CurateConfig, kept: int) -> None:
    """Publish only a whole corpus: the shards must hold exactly the documents the write phase counted."""
    shards = sorted(out_dir.glob("shard-*"))
    held = sum(documents_in(s) for s in shards)
    if held != kept:
        raise DilforgeError(
            f"curate: the {len(shards)} shard(s) hold {held:,} documents but the write phase kept {kept:,} "
            f"(documents_kept); nothing published, a rerun rewrites the shards it cannot verify"
        )


def counting_tokenizer(config: CurateConfig, ctx: StageContext) -> str | None:
    """The tokenizer.json counting the output's tokens: `tokenizer`'s, else the upstream model's, else none."""
    if config.tokenizer:
        path = Path(config.tokenizer.removeprefix("file://")) / "tokenizer.json"
    elif ctx.has_input("model"):
        path = ctx.input("model").path / "tokenizer.json"
    else:
        return None
    if not path.is_file():
        raise InputError("no tokenizer.json to count tokens with", path=str(path))
    return str(path)


@dataclass
class Folders:
    """Where phases read earlier phases' outputs and write their own: one folder on one host; on several, each
    host writes its own and the next phase reads their union."""

    read: Path
    write: Path
    shared: bool = False  # every host writes to the same folder (SageMaker local mode mounts one for all hosts)


def num_tasks(config: CurateConfig, phase: str) -> int:
    """A phase's datatrove tasks, whatever the number of hosts."""
    return {"buckets": config.dedup.num_buckets, "cluster": 1}.get(phase, config.output.num_shards)


def unfinished(folder: Path, config: CurateConfig, phase: str) -> list[int]:
    """The tasks of `phase` with no datatrove completion mark under `folder` (which holds every host's marks)."""
    done = folder / "logs" / phase / "completions"
    return [rank for rank in range(num_tasks(config, phase)) if not (done / f"{rank:05d}").is_file()]


def require_finished(folder: Path, config: CurateConfig, phases: tuple[str, ...]) -> None:
    """A host that stopped early, or a task whose outputs are not whole, fails the next phase in one line rather
    than leave it to run on part of the data."""
    for phase in phases:
        todo = set(unfinished(folder, config, phase))
        missing = [r for r in range(num_tasks(config, phase)) if r in todo or task_problem(folder, config, phase, r)]
        if missing:
            raise InputError(
                f"curate: {len(missing)} task(s) of phase {phase} did not finish (first: {missing[0]}); rerun the "
                "stage to resume them",
                path=str(folder),
            )


def build(
    config: CurateConfig,
    folders: Folders,
    tokenizer_file: str | None = None,
    endpoint_url: str | None = None,
    host: int = 0,
    num_hosts: int = 1,
) -> dict:
    """The four datatrove executors, shards written to `folders.write / "out"`; with several hosts each runs this
    host's slice of its phase's tasks (None where the slice is empty). `endpoint_url`: the sources' S3 endpoint."""
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.filters import FineWebQualityFilter
    from datatrove.pipeline.tokens import TokensCounter
    from datatrove.pipeline.writers import JsonlWriter, ParquetWriter
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.text import TERMINAL_PUNCTUATION

    read, work, q, words = folders.read, folders.write, config.quality, WordSplitter()

    def removed(step: str):  # the first few documents a step drops, for the report's examples
        return ExampleWriter(str(work / "removed" / step), config.output.num_examples)

    minhash = MinhashConfig(
        n_grams=config.dedup.n_grams,
        num_buckets=config.dedup.num_buckets,
        hashes_per_bucket=config.dedup.hashes_per_bucket,
        hash_config=HashConfig(precision=64, hash_fc="sha1"),  # xxhash 4 (pinned for datasets) takes bytes only
    )
    filtered = str(work / "filtered")
    filter_steps = [
        SourceReader(config.corpora, endpoint_url),
        Normaliser(**config.normalise.model_dump()),
        EmptyFilter(exclusion_writer=removed("empty")),
        ContactRedactor(config.redact),
        LinguaFilter(config.language, config.language_id, exclusion_writer=removed("language")),
        RepetitionFilter(
            dup_line_frac=q.dup_line_frac,
            top_n_grams=tuple(q.top_n_grams),
            dup_n_grams=tuple(q.dup_n_grams),
            exclusion_writer=removed("repetition"),
            language=words,
        ),
        FineWebQualityFilter(
            line_punct_thr=q.line_punct_thr,
            stop_chars=(*TERMINAL_PUNCTUATION, *q.line_end_closers),
            short_line_thr=q.short_line_thr,
            char_duplicates_ratio=q.char_duplicates_ratio,
            new_line_ratio=q.new_line_ratio,
            exclusion_writer=removed("lines"),
            language=words,
        ),
        QualityFilter(
            min_doc_words=q.min_words,
            max_doc_words=q.max_words,
            min_avg_word_length=q.min_avg_word_length,
            max_avg_word_length=q.max_avg_word_length,
            max_symbol_word_ratio=q.max_symbol_word_ratio,
            max_non_alpha_words_ratio=q.max_non_alpha_words_ratio,
            min_stop_words=q.min_stop_words,
            stop_words=q.stop_words,
            exclusion_writer=removed("quality"),
            language=words,
        ),
        JsonlWriter(filtered, output_filename="${rank}.jsonl", compression=None),
        MinhashSignature(output_folder=str(work / "signatures"), config=minhash, language=words),
    ]
    writer = (
        ParquetWriter(
            str(work / "out"), output_filename="shard-${rank}.parquet", adapter=report.record, compression=None
        )
        if config.output.format == "parquet"
        else JsonlWriter(
            str(work / "out"), output_filename="shard-${rank}.jsonl", adapter=report.record, compression=None
        )
    )
    write_steps = [
        RankFileReader(str(read / "filtered")),
        MinhashDedupFilter(input_folder=str(read / "remove_ids"), exclusion_writer=removed("duplicates")),
        *([TokensCounter(tokenizer_file, batch_size=256)] if tokenizer_file else []),
        SourceCounter(),
        writer,
    ]

    def executor(phase: str, steps: list) -> LocalPipelineExecutor | None:
        tasks = num_tasks(config, phase)
        mine = range(tasks * host // num_hosts, tasks * (host + 1) // num_hosts)  # this host's tasks
        if not mine:
            return None
        return StageExecutor(
            steps,
            tasks=tasks,
            workers=min(workers(config), len(mine)),
            start_method="fork",  # workers forked, so they die with the stage
            logging_dir=str(work / "logs" / phase),
            local_tasks=len(mine),
            local_rank_offset=mine.start,
        )

    return {
        "filter": executor("filter", filter_steps),
        "buckets": executor(
            "buckets", [MinhashDedupBuckets(str(read / "signatures"), str(work / "buckets"), config=minhash)]
        ),
        "cluster": executor(
            "cluster", [MinhashDedupCluster(str(read / "buckets"), str(work / "remove_ids"), config=minhash)]
        ),
        "write": executor("write", write_steps),
    }


@contextlib.contextmanager
def datatrove_console(path: Path):
    """Datatrove's console output (fd 2, inherited by its workers) into `path`; the stage prints a line per phase."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def execute(executors: dict, work: Path, phases: tuple[str, ...] = PHASES) -> dict[str, float]:
    """Run the phases in order; a source that cannot be read fails the stage in one line naming file and line."""
    seconds = {}
    console = work / "logs" / "datatrove.log"
    console.parent.mkdir(parents=True, exist_ok=True)
    for phase in phases:
        t = time.perf_counter()
        executor = executors[phase]
        if executor is None:
            print(f"[curate] {phase}: no task on this host", flush=True)
            continue
        mine = range(executor.local_rank_offset, executor.local_rank_offset + executor.local_tasks)
        todo = len(executor.get_incomplete_ranks(mine))
        for step in executor.pipeline if todo else ():
            preload(step)  # built here once, shared by the forked workers
        resumed = f", {len(mine) - todo} already done" if todo < len(mine) else ""
        print(f"[curate] {phase}: {todo} task(s) on {executor.workers} process(es){resumed}", flush=True)
        try:
            with datatrove_console(console):
                executor.run()
        except SourceReadError as exc:
            raise InputError(str(exc)) from None
        if failed := executor.get_incomplete_ranks(mine):
            raise InputError(
                f"curate {phase}: {len(failed)} task(s) did not finish (first: {failed[0]}); their logs are in "
                f"{work / 'logs' / phase / 'logs'}; a rerun resumes the unfinished tasks"
            )
        seconds[phase] = round(time.perf_counter() - t, 2)
        print(f"[curate] {phase}: done in {seconds[phase]:.1f} s", flush=True)
    return seconds


# ---- one phase on one of several hosts ----------------------------------------------------------------


def run_phase(config: CurateConfig, ctx: StageContext, phase: str, folders: Folders) -> None:
    """One phase, this host's slice of its tasks (`ctx.resources`), reading every host's earlier outputs from
    `folders.read`, writing to `folders.write`."""
    signal.signal(signal.SIGTERM, _stop)
    children_die_with_the_stage()
    tokenizer = counting_tokenizer(config, ctx)
    earlier = folders.read / "logs" / phase
    if earlier.is_dir() and folders.read != folders.write:  # an earlier attempt's finished tasks are not redone
        shutil.copytree(earlier, folders.write / "logs" / phase, dirs_exist_ok=True)
    host, num_hosts = ctx.resources.node_rank, len(ctx.resources.hosts)
    print(f"[curate] {phase} on host {host + 1} of {num_hosts}", flush=True)
    require_finished(folders.read, config, PHASES[: PHASES.index(phase)])
    executors = build(config, folders, tokenizer, ctx.endpoint_url, host, num_hosts)
    execute(executors, folders.write, (phase,))
    if folders.shared and num_hosts > 1:
        wait_for_other_hosts(folders.write, config, phase)


def wait_for_other_hosts(folder: Path, config: CurateConfig, phase: str) -> None:
    """Local mode stops every host when the first exits: wait for every host's tasks of `phase` in the shared
    `folder`. A SIGTERM once they all are is that stop, not a failure."""
    last = 0.0
    try:
        while missing := unfinished(folder, config, phase):
            if time.monotonic() - last >= 30:
                print(f"[curate] {phase}: waiting for {len(missing)} task(s) of the other hosts", flush=True)
                last = time.monotonic()
            time.sleep(1)
    except Stopped:
        if unfinished(folder, config, phase):
            raise


def publish_phases(config: CurateConfig, ctx: StageContext, work: Path) -> StageResult:
    """After every host ran every phase: the shards into the artifact, with report, card and metrics."""
    t0 = time.perf_counter()
    require_finished(work, config, PHASES)
    for shard in sorted((work / "out").glob("shard-*")):
        shutil.copyfile(shard, ctx.opt.model_dir / shard.name)
    return finish(config, ctx.opt.model_dir, work, {}, t0)
