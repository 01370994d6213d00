#!/usr/bin/env python
"""Everything that needs a CUDA GPU in ONE call of at most 8 minutes (scripts/gpu_check.sh runs this
after installing the carried wheels). Phases in order of information per second; each has a budget
checked before it starts (a phase that cannot finish in what is left is skipped, and the summary says
so) and is stopped at its limit:

  1. environment  device, driver, torch/CUDA/cuDNN/NCCL, SDPA backends     -> env.json
  2. ceilings     bf16 matmul (8192³ + the model's GEMMs), HBM copy,       -> ceilings.json
                  attention fwd+bwd per SDPA backend on the model's GQA call
  3. cpt          the CPT stage's own step at the batch fitted on a warm    -> bench.json
                  model, plain and liger, one process per point
  4. tests        the GPU suite (pytest tests/gpu)                          -> pytest.xml

`--second`: what does not fit the first call, for a second, optional one: compile_flce (two Inductor
compiles) and flex attention (one) -> bench_compile.json, flex_attention.json.

The deadline counts from the shell's start (DILFORGE_GPU_T0, set first thing by scripts/gpu_check.sh),
so the wheel install and the import check are inside it. At most 8 files come back from the device
machine: logs live outside the results folder (in $TMPDIR) and are tarred into it as logs.tar.gz at the
end, on SIGTERM/SIGINT/SIGHUP too; summary.txt is rewritten after every phase, so even a SIGKILL leaves a
summary of the phases that finished, and the results folder never holds more than 7 files. The summary
table is printed last (the reply carries the end of the output).

  python scripts/gpu_check.py RESULTS_DIR [--total-s 480] [--dry-run] [--second]
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
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES = 8
MARGIN_S = 20  # kept back at the end: tarring, the summary
# First-principles tok/s/GPU for the Llama-3.2-1B shape at seq 2048, bf16, one H200 (docs/benchmarks.md:
# 7.82 GFLOP/token at the MFU this stack reaches); printed beside the measured figure.
EXPECTED_TOK_S = {"plain": (55_000, "50-60k"), "liger": (67_000, "60-74k"), "compile_flce": (67_000, "60-74k")}


class Stopped(BaseException):
    """A signal (SIGTERM from a wall-clock limit, SIGINT, SIGHUP) arrived: pack what exists and stop."""


@dataclass
class Phase:
    name: str
    min_s: float  # a phase with less time left than this is skipped
    max_s: float  # never more than this
    reserve_s: float = 0  # left for the phases after it
    status: str = "not run"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def plan(dry_run: bool, second: bool = False) -> list[Phase]:
    if second:  # the optional second call: the compiled points
        if dry_run:
            return [Phase("environment", 5, 120), Phase("flex", 10, 300), Phase("compile", 20, 600)]
        return [Phase("environment", 5, 30), Phase("flex", 30, 120, reserve_s=240), Phase("compile", 120, 400)]
    if dry_run:  # CPU: the same phases on tiny shapes
        return [
            Phase("environment", 5, 120),
            Phase("ceilings", 10, 300),
            Phase("cpt", 20, 600),
            Phase("tests", 20, 900),
        ]
    # 480 s from the shell's start, ~60 s of it before the first phase (wheels, imports, CUDA probe)
    return [
        Phase("environment", 5, 30),
        Phase("ceilings", 20, 75, reserve_s=260),
        Phase("cpt", 130, 240, reserve_s=70),
        Phase("tests", 60, 300),
    ]


def commands(phase: str, results: Path, logs: Path, dry_run: bool, py: str, budget: float) -> list[str]:
    tiny = ["--tiny"] if dry_run else []
    if phase == "flex":
        return [
            py,
            "bench/gpu_ceilings.py",
            "--attention-only",
            "--flex",
            "--json",
            str(results / "flex_attention.json"),
            *tiny,
        ]
    if phase == "compile":
        return [
            py,
            "bench/gpu_cpt.py",
            "--variants",
            "compile_flce",
            "--json",
            str(results / "bench_compile.json"),
            "--log",
            str(logs / "bench_points.log"),
            "--budget-s",
            str(max(10, budget - 30)),
            *tiny,
        ]
    if phase == "environment":
        return [py, "bench/gpu_ceilings.py", "--env-only", "--json", str(results / "env.json"), *tiny]
    if phase == "ceilings":
        return [
            py,
            "bench/gpu_ceilings.py",
            "--json",
            str(results / "ceilings.json"),
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
            str(max(10, budget - 20)),
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
    """Run with a wall-clock limit; at the limit (or on a signal to this process) SIGINT first (pytest then
    still writes its XML and the bench its JSON), SIGKILL 10 s later. Returns (exit code, stopped)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            stop(proc)
            return proc.returncode, True
        except Stopped:
            stop(proc)
            raise


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


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


def phase_notes(name: str, results: Path, dry_run: bool = False) -> list[str]:
    """The numbers each phase contributes to the summary."""
    if name == "environment":
        env = read_json(results / "env.json")
        return [
            (
                f"{env.get('device')} cc {env.get('capability', '-')}; torch {env.get('torch')} cuda {env.get('cuda')} "
                f"cudnn {env.get('cudnn')} nccl {env.get('nccl')}; sdpa {','.join(env.get('sdpa_backends_available', []))}"
            )
        ]
    if name in ("ceilings", "flex"):
        c = read_json(results / ("ceilings.json" if name == "ceilings" else "flex_attention.json"))
        out = [f"matmul {k}: {v:,.0f} TFLOP/s" for k, v in c.get("matmul_tflops", {}).items()]
        if "hbm_copy_gbps" in c:
            out.append(f"HBM copy {c['hbm_copy_gbps']:,.0f} GB/s")
        ran = c.get("attention_kernels", {})
        out += [
            (f"attention {k}: {v:,.0f} TFLOP/s" if isinstance(v, float) else f"attention {k}: {v}")
            + (f" (ran: {', '.join(ran[k][:3])})" if ran.get(k) else "")
            for k, v in c.get("attention_tflops", {}).items()
        ]
        return out
    if name in ("cpt", "compile"):
        out = []
        bench = read_json(results / ("bench.json" if name == "cpt" else "bench_compile.json"))
        for p in bench.get("points", []):
            if not p.get("ok"):
                out.append(f"{p['variant']} ckpt={p['checkpointing']}: skipped ({p.get('skipped')})")
                continue

            def pct(v):
                return f"{100 * v:.1f}%" if v is not None else "n/a"

            mem = f"{p['peak_allocated_gb']:.1f} GB" if p.get("peak_allocated_gb") is not None else "n/a"
            expected, band = EXPECTED_TOK_S.get(p["variant"], (None, ""))
            beside = (
                f" (first principles ~{band}: {p['tok_s'] / expected:.2f}x)" if expected and p["role"] == "max" else ""
            )
            out.append(
                f"{p['variant']} batch {p['batch']} ({p['role']}, max {p['max_batch']}): {p['tok_s']:,.0f} tok/s{beside}, "
                f"MFU {pct(p.get('mfu_spec'))} of 989 TFLOP/s / {pct(p.get('mfu_measured'))} of measured matmul, "
                f"peak {mem}, alloc retries {p.get('num_alloc_retries')}, liger ran {sorted(p.get('kernels_ran', {}))}"
            )
            if p.get("oom_retries"):
                out.append(f"  timing ran out of memory at {p['oom_retries']}; measured at {p['batch']}")
            if p.get("profile"):
                share = p["profile"]["share"]
                out.append(
                    f"  time: gemm {100 * share['gemm']:.0f}%, attention {100 * share['attention']:.0f}%, "
                    f"other {100 * share['other']:.0f}%"
                )
        for c in bench.get("equal_batch", []):
            cut = f"{100 * c['memory_cut']:.0f}%" if c.get("memory_cut") is not None else "n/a"
            out.append(f"{c['variant']} vs plain at batch {c['batch']}: memory cut {cut}, speed-up {c['speedup']:.2f}x")
        return out
    if name == "tests":
        counts = junit_counts(results / "pytest.xml")
        return [", ".join(f"{v} {k}" for k, v in counts.items() if k != "tests")] if counts else ["no pytest.xml"]
    return []


def pack(results: Path, logs: Path) -> list[str]:
    """Tar the logs folder (outside `results`) into results/logs.tar.gz; anything beyond the 8-file limit
    (nothing, by construction) goes into extra.tar.gz. Returns the files left."""
    tmp = results / ".logs.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(logs, arcname="logs")
    tmp.replace(results / "logs.tar.gz")
    files = sorted(p for p in results.iterdir())
    if len(files) + 1 > MAX_FILES:  # + summary.txt, written after this
        keep = {"summary.txt", "logs.tar.gz", "bench.json", "ceilings.json", "pytest.xml", "env.json"}
        extra = [p for p in files if p.name not in keep]
        with tarfile.open(results / "extra.tar.gz", "w:gz") as tar:
            for p in extra:
                tar.add(p, arcname=p.name)
        for p in extra:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return sorted(p.name for p in results.iterdir())


def write_summary(results: Path, phases: list[Phase], began: float, total_s: float, dry_run: bool, state: str) -> str:
    """summary.txt, rewritten after every phase (atomically): a run killed at any moment leaves one."""
    files = sorted({p.name for p in results.iterdir() if not p.name.startswith(".")} | {"summary.txt"})
    lines = [
        (
            f"gpu_check {'(dry run, CPU) ' if dry_run else ''}{state} {time.time() - began:.0f} s after the shell "
            f"started, budget {total_s:.0f} s; files: {', '.join(files)}"
        ),
        f"{'phase':<12} {'seconds':>7}  status",
        "-" * 78,
    ]
    for phase in phases:
        lines.append(f"{phase.name:<12} {phase.seconds:>7.0f}  {phase.status}")
        lines += [f"{'':<21}{note}" for note in phase.notes]
    summary = "\n".join(lines)
    tmp = results / ".summary.txt.part"
    tmp.write_text(summary + "\n")
    tmp.replace(results / "summary.txt")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--total-s", type=float, default=480.0, help="the whole call's budget from the shell's start")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the same phases on tiny shapes")
    ap.add_argument("--second", action="store_true", help="the optional second call: compile_flce and flex attention")
    ap.add_argument("--phases", default=None, help="comma list: run only these phases")
    args = ap.parse_args(argv)
    began = float(os.environ.get("DILFORGE_GPU_T0") or time.time())  # the shell's start
    deadline = began + args.total_s - MARGIN_S
    results = args.results
    results.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="dilforge-gpu-logs-"))  # never in results: the 8-file limit
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DILFORGE_GPU_RESULTS": str(logs),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        "TOKENIZERS_PARALLELISM": "false",
    }

    def on_signal(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    py = sys.executable
    phases = plan(args.dry_run, args.second)
    wanted = set(args.phases.split(",")) if args.phases else None
    state = "finished"
    try:
        for phase in phases:
            if wanted is not None and phase.name not in wanted:
                phase.status = "not asked"
                continue
            left = deadline - time.time()
            limit = time_for(phase, left)
            if limit is None:
                phase.status = f"skipped: needs {phase.min_s:.0f} s, {max(0, left):.0f} s left"
                print(f"== {phase.name}: {phase.status}", flush=True)
                write_summary(results, phases, began, args.total_s, args.dry_run, "running")
                continue
            cmd = commands(phase.name, results, logs, args.dry_run, py, limit)
            print(f"== {phase.name} (at most {limit:.0f} s): {' '.join(cmd[1:])}", flush=True)
            t0 = time.time()
            phase.status = "running (killed?)"  # what a SIGKILL leaves in the summary
            try:
                rc, stopped = run(cmd, limit, logs / f"{phase.name}.log", env)
                phase.status = "stopped at its time limit" if stopped else ("ok" if rc == 0 else f"failed (exit {rc})")
            except Stopped as sig:
                phase.status = f"stopped by {sig}"
                raise
            finally:
                phase.seconds = time.time() - t0
                phase.notes = phase_notes(phase.name, results, args.dry_run)
            tail = (logs / f"{phase.name}.log").read_text(errors="replace").splitlines()[-8:]
            print("\n".join("   " + line for line in tail), flush=True)
            write_summary(results, phases, began, args.total_s, args.dry_run, "running")
    except Stopped as sig:
        state = f"stopped by {sig}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # packing is not interrupted
        pack(results, logs)
        shutil.rmtree(logs, ignore_errors=True)
        summary = write_summary(results, phases, began, args.total_s, args.dry_run, state)
    assert len(list(results.iterdir())) <= MAX_FILES
    print("\n" + summary, flush=True)
    ok = state == "finished" and all(p.status in ("ok", "not asked") for p in phases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
