"""scripts/gpu_check.sh's time plan on CPU (--dry-run): the deadline counts from the shell's start, a
phase that cannot finish in what is left is skipped, and a run killed mid-phase still leaves at most 8
files with a summary (the device tool returns at most 8 files, and only what is in $OUT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def start(results: Path, total_s: int, t0: float | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": "/nonexistent", "TOTAL_S": str(total_s)}
    env["OMP_NUM_THREADS"] = "1"
    if t0 is not None:
        env["DILFORGE_GPU_T0"] = f"{t0:.3f}"
    return subprocess.Popen(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(results)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_short_budget_skips_the_phases_that_cannot_finish(tmp_path):
    """The shell started 40 s before the script (DILFORGE_GPU_T0): with 60 s in all, nothing is left for
    any phase, and the summary says so in place of running them."""
    proc = start(tmp_path / "out", 60, t0=time.time() - 40)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.count("skipped: needs") == 4 and "finished" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "summary.txt"]


def test_a_run_killed_mid_phase_leaves_a_summary_and_at_most_8_files(tmp_path):
    results = tmp_path / "out"
    proc = start(results, 900)
    deadline = time.time() + 240
    while time.time() < deadline and not (results / "env.json").exists():  # the environment phase is done
        time.sleep(0.5)
    assert (results / "env.json").exists(), proc.stdout.read() if proc.poll() is not None else "no env.json"
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)  # as the device tool's wall-clock limit does
    out, _ = proc.communicate(timeout=120)
    files = sorted(p.name for p in results.iterdir())
    assert len(files) <= 8 and {"summary.txt", "logs.tar.gz", "env.json"} <= set(files), files
    summary = (results / "summary.txt").read_text()
    assert "stopped by SIGTERM" in summary and "environment" in summary and " ok" in summary
    with tarfile.open(results / "logs.tar.gz") as tar:
        assert "logs/environment.log" in tar.getnames()
    assert proc.returncode != 0
