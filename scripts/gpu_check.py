#!/usr/bin/env python
"""Everything that needs a CUDA GPU in ONE call of at most 8 minutes (scripts/gpu_check.sh runs this
after installing the carried wheels). Phases in order of information per second, each clipped to the
time left; a phase that cannot finish in what is left is skipped and the summary says so:

  1. environment  device, driver, torch/CUDA/cuDNN/NCCL, SDPA backends     -> env.json
  2. ceilings     bf16 matmul (8192³ + the model's GEMMs), HBM copy,       -> ceilings.json,
                  attention fwd+bwd per SDPA backend and flex                 attention_table.json
  3. cpt          the CPT stage's own step, bisected max micro-batch,      -> bench.json
                  plain / liger / compile_flce, one process per point
  4. tests        the GPU suite (pytest -m gpu tests/gpu)                   -> pytest.xml

At most 8 files come back from the device machine, so the results folder holds at most 8: the five
above, summary.txt, and logs.tar.gz with every log and every file the tests wrote. The summary table
is printed last (the reply carries the end of the output).

  python scripts/gpu_check.py RESULTS_DIR [--total-s 480] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES = 8
MARGIN_S = 20  # kept back at the end: tarring, the summary


@dataclass
class Phase:
    name: str
    min_s: float  # a phase with less time left than this is skipped
    max_s: float  # never more than this
    reserve_s: float = 0  # left for the phases after it
    status: str = "not run"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def plan(dry_run: bool) -> list[Phase]:
    if dry_run:  # CPU: the same phases on tiny shapes
        return [
            Phase("environment", 5, 120),
            Phase("ceilings", 10, 300),
            Phase("cpt", 20, 600),
            Phase("tests", 20, 900),
        ]
    return [
        Phase("environment", 5, 45),
        Phase("ceilings", 30, 90, reserve_s=330),
        Phase("cpt", 90, 300, reserve_s=120),
        Phase("tests", 60, 300),
    ]


def commands(phase: str, results: Path, logs: Path, dry_run: bool, py: str, budget: float) -> list[str]:
    tiny = ["--tiny"] if dry_run else []
    if phase == "environment":
        return [py, "bench/gpu_ceilings.py", "--env-only", "--json", str(results / "env.json"), *tiny]
    if phase == "ceilings":
        return [
            py,
            "bench/gpu_ceilings.py",
            "--json",
            str(results / "ceilings.json"),
            "--attention-table",
            str(results / "attention_table.json"),
            *tiny,
        ]
    if phase == "cpt":
        cmd = [
            py,
            "bench/gpu_cpt.py",
            "--json",
            str(results / "bench.json"),
            "--log",
            str(logs / "bench_points.log"),
            "--budget-s",
            str(max(10, budget - 60)),
            "--profile",
            *tiny,
        ]
        matmul = read_json(results / "ceilings.json").get("matmul_tflops", {}).get("8192^3")
        if matmul and not dry_run:
            cmd += ["--matmul-tflops", f"{matmul:.1f}"]
        return cmd
    if phase == "tests":
        return [
            py,
            "-m",
            "pytest",
            "tests/gpu",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "--timeout",
            "240",
            "--junitxml",
            str(results / "pytest.xml"),
        ]
    raise ValueError(phase)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run(cmd: list[str], limit: float, log: Path, env: dict) -> tuple[int, bool]:
    """Run with a wall-clock limit; at the limit SIGINT first (pytest then still writes its XML and the
    bench its JSON), SIGKILL 15 s later. Returns (exit code, stopped at the limit)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return proc.returncode, True


def time_for(phase: Phase, left: float) -> float | None:
    """Seconds this phase may run, or None when it cannot finish in what is left."""
    usable = min(phase.max_s, left - phase.reserve_s)
    if usable < phase.min_s:
        usable = min(phase.max_s, left)  # the phases after it then get what this one leaves
    return usable if usable >= phase.min_s else None


def junit_counts(path: Path) -> dict[str, int]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def phase_notes(name: str, results: Path) -> list[str]:
    """The numbers each phase contributes to the summary."""
    if name == "environment":
        env = read_json(results / "env.json")
        return [
            (
                f"{env.get('device')} cc {env.get('capability', '-')}; torch {env.get('torch')} cuda {env.get('cuda')} "
                f"cudnn {env.get('cudnn')} nccl {env.get('nccl')}; sdpa {','.join(env.get('sdpa_backends_available', []))}"
            )
        ]
    if name == "ceilings":
        c = read_json(results / "ceilings.json")
        out = [f"matmul {k}: {v:,.0f} TFLOP/s" for k, v in c.get("matmul_tflops", {}).items()]
        if "hbm_copy_gbps" in c:
            out.append(f"HBM copy {c['hbm_copy_gbps']:,.0f} GB/s")
        out += [
            f"attention {k}: {v:,.0f} TFLOP/s" if isinstance(v, float) else f"attention {k}: {v}"
            for k, v in c.get("attention_tflops", {}).items()
        ]
        return out
    if name == "cpt":
        out = []
        for p in read_json(results / "bench.json").get("points", []):
            if not p.get("ok"):
                out.append(f"{p['variant']} ckpt={p['checkpointing']}: skipped ({p.get('skipped')})")
                continue

            def pct(v):
                return f"{100 * v:.1f}%" if v is not None else "n/a"

            mem = f"{p['peak_allocated_gb']:.1f} GB" if p.get("peak_allocated_gb") is not None else "n/a"
            out.append(
                f"{p['variant']} batch {p['batch']} ({p['role']}, max {p['max_batch']}): {p['tok_s']:,.0f} tok/s, "
                f"MFU {pct(p.get('mfu_spec'))} spec / {pct(p.get('mfu_measured'))} measured, peak {mem}, "
                f"alloc retries {p.get('num_alloc_retries')}, liger ran {sorted(p.get('kernels_ran', {}))}"
            )
            if p.get("profile"):
                share = p["profile"]["share"]
                out.append(
                    f"  time: gemm {100 * share['gemm']:.0f}%, attention {100 * share['attention']:.0f}%, "
                    f"other {100 * share['other']:.0f}%"
                )
        for c in read_json(results / "bench.json").get("equal_batch", []):
            cut = f"{100 * c['memory_cut']:.0f}%" if c.get("memory_cut") is not None else "n/a"
            out.append(f"{c['variant']} vs plain at batch {c['batch']}: memory cut {cut}, speed-up {c['speedup']:.2f}x")
        return out
    if name == "tests":
        counts = junit_counts(results / "pytest.xml")
        return [", ".join(f"{v} {k}" for k, v in counts.items() if k != "tests")] if counts else ["no pytest.xml"]
    return []


def pack(results: Path, logs: Path) -> list[str]:
    """Tar the logs folder, then anything beyond the 8-file limit; returns the files left."""
    with tarfile.open(results / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs)
    files = sorted(p for p in results.iterdir())
    if len(files) > MAX_FILES:
        keep = {"summary.txt", "logs.tar.gz", "bench.json", "ceilings.json", "pytest.xml", "env.json"}
        extra = [p for p in files if p.name not in keep]
        with tarfile.open(results / "extra.tar.gz", "w:gz") as tar:
            for p in extra:
                tar.add(p, arcname=p.name)
        for p in extra:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return sorted(p.name for p in results.iterdir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--total-s", type=float, default=480.0, help="the whole call's budget (8 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the same phases on tiny shapes")
    ap.add_argument("--phases", default=None, help="comma list: run only these phases")
    args = ap.parse_args(argv)
    began = time.monotonic()
    deadline = began + args.total_s - MARGIN_S
    results = args.results
    results.mkdir(parents=True, exist_ok=True)
    logs = results / "logs"
    logs.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DILFORGE_GPU_RESULTS": str(logs),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    py = sys.executable
    phases = plan(args.dry_run)
    wanted = set(args.phases.split(",")) if args.phases else None
    for phase in phases:
        if wanted is not None and phase.name not in wanted:
            phase.status = "not asked"
            continue
        left = deadline - time.monotonic()
        limit = time_for(phase, left)
        if limit is None:
            phase.status = f"skipped: needs {phase.min_s:.0f} s, {max(0, left):.0f} s left"
            print(f"== {phase.name}: {phase.status}", flush=True)
            continue
        if phase.name == "ceilings" and (results / "attention_table.json").exists():
            (results / "attention_table.json").unlink()
        cmd = commands(phase.name, results, logs, args.dry_run, py, limit)
        if phase.name == "cpt" and (results / "attention_table.json").exists():
            env["DILFORGE_ATTENTION_TABLE"] = str(results / "attention_table.json")  # the policy uses what was measured
        print(f"== {phase.name} (at most {limit:.0f} s): {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc, stopped = run(cmd, limit, logs / f"{phase.name}.log", env)
        phase.seconds = time.monotonic() - t0
        phase.status = "stopped at its time limit" if stopped else ("ok" if rc == 0 else f"failed (exit {rc})")
        phase.notes = phase_notes(phase.name, results)
        tail = (logs / f"{phase.name}.log").read_text(errors="replace").splitlines()[-8:]
        print("\n".join("   " + line for line in tail), flush=True)
    files = pack(results, logs)
    total = time.monotonic() - began
    lines = [
        (
            f"gpu_check {'(dry run, CPU) ' if args.dry_run else ''}finished in {total:.0f} s of {args.total_s:.0f}; "
            f"files: {', '.join(files + ['summary.txt'])}"
        ),
        f"{'phase':<12} {'seconds':>7}  status",
        "-" * 78,
    ]
    for phase in phases:
        lines.append(f"{phase.name:<12} {phase.seconds:>7.0f}  {phase.status}")
        lines += [f"{'':<21}{note}" for note in phase.notes]
    summary = "\n".join(lines)
    (results / "summary.txt").write_text(summary + "\n")
    assert len(list(results.iterdir())) <= MAX_FILES
    print("\n" + summary, flush=True)
    ok = all(p.status in ("ok", "not asked") for p in phases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
