"""Curate sized to the machine and resumed from what it can verify, without running datatrove: the worker count
from the cores, the per-core throughput in the metrics, and the checks a completion mark must pass."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from dilforge_curate import report, stage
from dilforge_curate.config import CurateConfig
from dilforge_shared.errors import DilforgeError


def config(**kw) -> CurateConfig:
    return CurateConfig(corpora=[{"uri": "web.jsonl", "name": "web"}], **kw)


def test_workers_default_to_the_cores_this_process_may_use_and_never_exceed_the_tasks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    assert stage.workers(config(output={"num_shards": 64})) == 6
    assert stage.workers(config(output={"num_shards": 4}, dedup={"num_buckets": 5})) == 5  # the widest phase
    assert stage.workers(config(output={"num_shards": 64}, num_workers=3)) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert stage.workers(config()) == 1


def _task(work: Path, phase: str, rank: int, totals: list[int], files: dict[str, str]) -> None:
    """A finished datatrove task: its stats (one `total` per step) and its outputs."""
    stats = work / "logs" / phase / "stats"
    stats.mkdir(parents=True, exist_ok=True)
    (stats / f"{rank:05d}.json").write_text(
        json.dumps([{"name": f"s{i}", "stats": {"total": t}} for i, t in enumerate(totals)])
    )
    marks = work / "logs" / phase / "completions"
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{rank:05d}").touch()
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)


def test_a_write_mark_counts_only_while_its_shard_holds_what_the_task_wrote(tmp_path):
    cfg = config(output={"num_shards": 2})
    _task(tmp_path, "write", 0, [3, 3], {"out/shard-00000.jsonl": "{}\n{}\n{}\n"})
    _task(tmp_path, "write", 1, [0, 0], {})  # kept nothing: no shard is right
    assert stage.task_problem(tmp_path, cfg, "write", 0) is None
    assert stage.task_problem(tmp_path, cfg, "write", 1) is None
    (tmp_path / "out/shard-00000.jsonl").write_text("{}\n")
    assert stage.task_problem(tmp_path, cfg, "write", 0) == "shard-00000.jsonl holds 1 of 3 documents"
    (tmp_path / "out/shard-00000.jsonl").unlink()
    stage.resume(tmp_path, cfg)
    assert sorted(p.name for p in (tmp_path / "logs/write/completions").iterdir()) == ["00001"]


def test_a_filter_mark_needs_its_kept_documents_and_whole_signatures(tmp_path):
    cfg = config(output={"num_shards": 1}, dedup={"num_buckets": 2, "hashes_per_bucket": 1})
    record = 12  # one 64-bit hash and the document's index
    sigs = {f"signatures/bucket_{b:03d}/00000.minhash.sig": "x" * (2 * record) for b in range(2)}
    _task(tmp_path, "filter", 0, [0, 2, 2], {"filtered/00000.jsonl": "{}\n{}\n", **sigs})
    assert stage.task_problem(tmp_path, cfg, "filter", 0) is None
    (tmp_path / "signatures/bucket_001/00000.minhash.sig").write_text("x" * (record + 5))
    assert stage.task_problem(tmp_path, cfg, "filter", 0) == "MinHash signatures cut short"
    (tmp_path / "signatures/bucket_001/00000.minhash.sig").unlink()
    assert "missing" in stage.task_problem(tmp_path, cfg, "filter", 0)
    (tmp_path / "logs/filter/stats/00000.json").unlink()
    assert stage.task_problem(tmp_path, cfg, "filter", 0) == "no stats"


def test_shards_must_hold_exactly_the_documents_kept(tmp_path):
    (tmp_path / "shard-00000.jsonl").write_text("{}\n{}\n")
    (tmp_path / "shard-00001.jsonl").write_text("{}\n")
    stage.check_shards(tmp_path, config(), 3)
    with pytest.raises(DilforgeError, match="the 2 shard.s. hold 3 documents but the write phase kept 4"):
        stage.check_shards(tmp_path, config(), 4)


def test_throughput_per_core_comes_from_every_tasks_cpu_seconds(tmp_path):
    for phase, values in {"filter": ["2.5", "1.5"], "write": ["1.0"]}.items():
        folder = tmp_path / "logs" / phase / "cpu"
        folder.mkdir(parents=True)
        for i, v in enumerate(values):
            (folder / f"{i:05d}").write_text(v + "\n")
    assert report.cpu_seconds(tmp_path) == {"filter": 4.0, "write": 1.0, "total": 5.0}
    stats = tmp_path / "logs" / "filter" / "stats"
    stats.mkdir()
    reader = {"name": "📖 dilforge sources", "stats": {"documents": {"total": 1000}, "bytes": {"total": 2_000_000}}}
    (stats / "00000.json").write_text(json.dumps([reader]))
    m = report.collect(tmp_path, config(), {})
    assert (m.mb_per_cpu_second, m.documents_per_cpu_second, m.cpu_seconds["total"]) == (0.4, 200.0, 5.0)


def test_seconds_total_is_the_whole_stage_the_checks_and_report_included(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "check_not_empty", lambda metrics, config: None)  # an empty work folder here
    monkeypatch.setattr(report, "write", lambda out_dir, config, metrics: time.sleep(0.05))
    t0 = time.perf_counter()
    seconds = stage.finish(config(), tmp_path, tmp_path, {"filter": 0.01}, t0).metrics["seconds"]
    assert seconds["filter"] == 0.01 and seconds["total"] >= 0.05


STAGE = """
import os, sys, time
from dilforge_curate import stage
stage.children_die_with_the_stage()
if os.fork() == 0:  # a worker, which forks one of its own
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def test_processes_the_stage_forks_die_with_it_even_on_kill_9(tmp_path):
    """The at-fork hook: a `kill -9` of the stage takes its forked children (datatrove's workers and Manager,
    which hold the work-folder lock) with it; a child's own fork lives while that child does."""
    import subprocess
    import sys
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", STAGE])
    deadline = time.monotonic() + 60
    while len(psutil.Process(proc.pid).children(recursive=True)) < 2:
        assert time.monotonic() < deadline, "the stage never forked"
        time.sleep(0.05)
    family = psutil.Process(proc.pid).children(recursive=True)
    time.sleep(0.5)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)  # the grandchild too
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.pid for p in alive]
