"""The curate stage, top to bottom.

parse (sources, the tokenizer that counts tokens, the work folder) → build four datatrove pipelines
(1 filter: read → normalise → redact → language ID → quality → kept documents + MinHash signatures;
2 buckets; 3 clusters; 4 write: drop duplicates → count tokens → shards) → run them with datatrove's local
executor (tasks = `output.num_shards`, processes = `num_workers`; a rerun skips finished tasks) → publish the
shards, report.md, the data card (README.md) and metrics.

The work folder lives under /opt/ml/checkpoints, which the local backend keeps after a failure and SageMaker
syncs: a rerun resumes from the tasks that finished.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.configs.curate import CurateConfig
from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.errors import DilforgeError, InputError

from . import report
from .steps import (
    ContactRedactor,
    EmptyFilter,
    ExampleWriter,
    LinguaFilter,
    Normaliser,
    RankFileReader,
    SourceCounter,
    SourceReader,
    SourceReadError,
    WordSplitter,
)

log = logging.getLogger("dilforge.curate")

PHASES = ("filter", "buckets", "cluster", "write")


@dataclass
class Inputs:
    sources: list[dict]
    tokenizer_file: str | None
    work: Path
    endpoint_url: str | None = None  # the S3 endpoint the sources are read from


class Stopped(DilforgeError):
    """SIGTERM (SageMaker stop, spot interruption, Ctrl-C of the coordinator): datatrove's pool is terminated."""


def _stop(signum, frame):
    raise Stopped(
        f"stopped by {signal.Signals(signum).name}; finished tasks are kept in the work folder, a rerun resumes"
    )


def run(config: CurateConfig, ctx: StageContext) -> StageResult:
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)  # raised in the main thread: the pool's `with` terminates its workers
    log_config(config, {"num_tasks": config.output.num_shards, "num_workers": config.num_workers})
    inputs = parse(config, ctx)
    executors = build(config, inputs, Folders(inputs.work, inputs.work), ctx.model_dir)
    seconds = execute(executors, inputs.work)
    return finish(config, ctx.model_dir, inputs.work, seconds, t0)


def finish(config: CurateConfig, out_dir: Path, work: Path, seconds: dict[str, float], t0: float) -> StageResult:
    """Counts from the finished work folder → never an empty corpus → report.md, README.md, metrics."""
    counts = report.collect(work, config)
    report.check_not_empty(counts, config)
    report.write(out_dir, config, counts)
    return StageResult(
        metrics=report.metrics(config, counts, seconds, time.perf_counter() - t0).model_dump(mode="json")
    )


def reader_sources(config: CurateConfig) -> list[dict]:
    """The corpora as SourceReader takes them (plain values: the reader is pickled into datatrove's workers)."""
    return [
        {"uri": s.uri, "format": s.format, "text_field": s.text_field, "label": s.label, "bounds": s.bounds}
        for s in config.corpora
    ]


def parse(config: CurateConfig, ctx: StageContext) -> Inputs:
    sources = reader_sources(config)
    tokenizer_file = None
    if config.tokenizer:
        tokenizer_file = str(Path(config.tokenizer.removeprefix("file://")) / "tokenizer.json")
    elif ctx.has_input("model"):
        tokenizer_file = str(ctx.input("model").path / "tokenizer.json")
    if tokenizer_file and not Path(tokenizer_file).is_file():
        raise InputError("no tokenizer.json to count tokens with", path=tokenizer_file)
    work = ctx.checkpoint_dir / "curate"
    work.mkdir(parents=True, exist_ok=True)
    return Inputs(sources=sources, tokenizer_file=tokenizer_file, work=work, endpoint_url=ctx.endpoint_url)


@dataclass
class Folders:
    """Where the phases read earlier phases' folders and write their own: one folder when every task runs here;
    on several hosts, each host writes its own folder and the next phase reads their union."""

    read: Path
    write: Path
    shared: bool = False  # every host writes to the same folder (SageMaker local mode mounts one for all hosts)


def host_slice(num_tasks: int, host: int, num_hosts: int) -> range:
    """The contiguous range of a phase's datatrove tasks that host `host` of `num_hosts` runs."""
    return range(num_tasks * host // num_hosts, num_tasks * (host + 1) // num_hosts)


def num_tasks(config: CurateConfig, phase: str) -> int:
    """How many datatrove tasks a phase has, whatever the number of hosts (so the output does not depend on it)."""
    return {"buckets": config.dedup.num_buckets, "cluster": 1}.get(phase, config.output.num_shards)


def unfinished(folder: Path, config: CurateConfig, phase: str) -> list[int]:
    """The tasks of `phase` with no datatrove completion mark under `folder` (which holds every host's marks)."""
    done = folder / "logs" / phase / "completions"
    return [rank for rank in range(num_tasks(config, phase)) if not (done / f"{rank:05d}").is_file()]


def require_finished(folder: Path, config: CurateConfig, phases: tuple[str, ...]) -> None:
    """A host that stopped early (a lost instance, a killed container) must fail the next job in one line, not
    leave it to run on part of the data."""
    for phase in phases:
        if missing := unfinished(folder, config, phase):
            raise InputError(
                f"curate: {len(missing)} task(s) of phase {phase} did not finish (first: {missing[0]}); rerun the "
                "stage to resume them",
                path=str(folder),
            )


def build(
    config: CurateConfig, inputs: Inputs, folders: Folders, out_dir: Path, host: int = 0, num_hosts: int = 1
) -> dict:
    """The four datatrove executors, each step built from its own config section; with several hosts, each
    phase's executor runs this host's slice of its tasks (datatrove's `local_rank_offset`/`local_tasks`): a
    phase whose slice is empty here is None."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
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
        SourceReader(inputs.sources, inputs.endpoint_url),
        Normaliser(**config.normalise.model_dump()),
        EmptyFilter(exclusion_writer=removed("empty")),
        ContactRedactor(
            emails=config.redact.emails,
            phones=config.redact.phones,
            cards=config.redact.cards,
            placeholders={
                "email": config.redact.email_placeholder,
                "phone": config.redact.phone_placeholder,
                "card": config.redact.card_placeholder,
            },
        ),
        LinguaFilter(
            config.language,
            config.language_id.candidates,
            config.language_id.min_score,
            config.language_id.max_chars,
            exclusion_writer=removed("language"),
            relatives=config.language_id.relatives,
            margin=config.language_id.relative_margin,
        ),
        GopherRepetitionFilter(
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
        GopherQualityFilter(
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
        MinhashDedupSignature(output_folder=str(work / "signatures"), config=minhash, language=words),
    ]
    writer = (
        ParquetWriter(str(out_dir), output_filename="shard-${rank}.parquet", adapter=report.record, compression=None)
        if config.output.format == "parquet"
        else JsonlWriter(str(out_dir), output_filename="shard-${rank}.jsonl", adapter=report.record, compression=None)
    )
    write_steps = [
        RankFileReader(str(read / "filtered")),
        MinhashDedupFilter(input_folder=str(read / "remove_ids"), exclusion_writer=removed("duplicates")),
        *([TokensCounter(inputs.tokenizer_file, batch_size=256)] if inputs.tokenizer_file else []),
        SourceCounter(),
        writer,
    ]

    def executor(phase: str, steps: list) -> LocalPipelineExecutor | None:
        tasks = num_tasks(config, phase)
        mine = host_slice(tasks, host, num_hosts)
        if not mine:
            return None
        return LocalPipelineExecutor(
            steps,
            tasks=tasks,
            workers=min(config.num_workers, len(mine)),
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
    """Datatrove logs every task's pipeline and stats to stderr (fd 2, inherited by its worker processes); they go
    to `path` instead, and the stage prints one line per phase. Per-task logs stay in logs/<phase>/logs/."""
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
    """Run the phases in order (each this host's slice of tasks); a source that cannot be read fails the stage in
    one line naming file and line."""
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
        resumed = f", {len(mine) - todo} already done" if todo < len(mine) else ""
        print(f"[curate] {phase}: {todo} task(s) on {executor.workers} process(es){resumed}", flush=True)
        try:
            with datatrove_console(console):
                executor.run()
        except SourceReadError as exc:
            raise InputError(str(exc)) from None
        failed = executor.get_incomplete_ranks(mine)
        if failed:
            logs = work / "logs" / phase / "logs"
            raise InputError(
                f"curate {phase}: {len(failed)} task(s) did not finish (first: {failed[0]}); their logs are in "
                f"{logs}; a rerun resumes the unfinished tasks"
            )
        seconds[phase] = round(time.perf_counter() - t, 2)
        print(f"[curate] {phase}: done in {seconds[phase]:.1f} s", flush=True)
    return seconds


# ---- one phase on one of several hosts ----------------------------------------------------------------


def run_phase(config: CurateConfig, ctx: StageContext, phase: str, folders: Folders) -> None:
    """One phase, this host's slice of its tasks (`ctx.resources`: SageMaker's resourceconfig.json), reading the
    union of every host's earlier outputs from `folders.read`, writing to `folders.write` (shards to `out/`)."""
    signal.signal(signal.SIGTERM, _stop)
    earlier = folders.read / "logs" / phase
    if earlier.is_dir() and folders.read != folders.write:  # an earlier attempt's finished tasks are not redone
        shutil.copytree(earlier, folders.write / "logs" / phase, dirs_exist_ok=True)
    inputs = parse(config, ctx)
    host, num_hosts = ctx.resources.node_rank, len(ctx.resources.hosts)
    print(f"[curate] {phase} on host {host + 1} of {num_hosts}", flush=True)
    require_finished(folders.read, config, PHASES[: PHASES.index(phase)])
    executors = build(config, inputs, folders, folders.write / "out", host, num_hosts)
    execute(executors, folders.write, (phase,))
    if folders.shared and num_hosts > 1:
        # Local mode stops every host's container when the first one exits: wait for the others' tasks.
        last = 0.0
        while missing := unfinished(folders.write, config, phase):
            if time.monotonic() - last >= 30:
                print(f"[curate] {phase}: waiting for {len(missing)} task(s) of the other hosts", flush=True)
                last = time.monotonic()
            time.sleep(1)


def publish_phases(config: CurateConfig, ctx: StageContext, work: Path) -> StageResult:
    """After every host ran every phase: the shards (`work/out`) into the artifact, with report, card, metrics."""
    t0 = time.perf_counter()
    require_finished(work, config, PHASES)
    for shard in sorted((work / "out").glob("shard-*")):
        shutil.copyfile(shard, ctx.model_dir / shard.name)
    return finish(config, ctx.model_dir, work, {}, t0)
