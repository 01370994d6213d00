"""bench/gpu_cpt.py: bisection of the largest micro-batch, and the whole sweep in --tiny mode on CPU
through the CPT stage's own training step."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_cpt.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("gpu_cpt_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("capacity", [1, 2, 3, 7, 8, 18, 45, 100, 255, 256])
def test_bisection_finds_the_exact_largest_batch(bench, capacity):
    best, probes = bench.bisect_max_batch(lambda b: b <= capacity, start=8, limit=256)
    assert best == capacity
    assert len(probes) <= 2 * 8 + 2 and len(set(probes)) == len(probes)  # log-many, never the same batch twice


def test_bisection_edges(bench):
    assert bench.bisect_max_batch(lambda b: False, start=8, limit=64) == (0, [8, 4, 2, 1])
    assert bench.bisect_max_batch(lambda b: True, start=8, limit=20) == (20, [8, 16, 20])
    best, probes = bench.bisect_max_batch(lambda b: b <= 18, start=1, limit=256)
    assert best == 18 and probes == [1, 2, 4, 8, 16, 32, 24, 20, 18, 19]  # 18: not a power of two


def test_plan_runs_plain_first_and_skips_liger_without_cuda(bench):
    plan = bench.plan_points(False, ["eager", "compile"], list(bench.LIGER_VARIANTS))
    assert len(plan) == 12
    assert [p[0] for p in plan[:3]] == ["plain", "liger_all", "liger_flce"]
    assert all((reason is None) == (liger == "plain") for liger, _, _, reason in plan)


def test_equal_batch_comparison(bench):
    plain = bench.Point("plain", "eager", False, batch=10, ok=True, tok_s=100.0, peak_allocated_gb=60.0)
    liger = bench.Point("liger_all", "eager", False, batch=10, role="equal", ok=True, tok_s=120.0,
                        peak_allocated_gb=24.0)
    other = bench.Point("liger_all", "eager", False, batch=18, ok=True, tok_s=130.0, peak_allocated_gb=50.0)
    (cmp,) = bench.equal_batch_comparison([plain, liger, other])
    assert cmp["batch"] == 10 and cmp["memory_cut"] == pytest.approx(0.6) and cmp["speedup"] == pytest.approx(1.2)


def test_tiny_sweep_drives_the_stage_training_step(bench, tmp_path, monkeypatch):
    from dilforge_cpt import loop
    calls = []
    real = loop.train_step

    def counting(*args, **kwargs):
        calls.append(args[2][0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", counting)
    out = tmp_path / "gpu_cpt.json"
    assert bench.main(["--tiny", "--max-batch", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ran = [p for p in result["points"] if p["ok"]]
    assert {(p["liger"], p["checkpointing"]) for p in ran} == {("plain", False), ("plain", True)}
    for p in ran:
        assert p["max_batch"] == 3 and p["batch"] == 3 and p["tok_s"] > 0 and p["tflops"] > 0
        assert 3 in p["probes"]
    skipped = [p for p in result["points"] if not p["ok"]]
    assert len(skipped) == 4 and all("CUDA" in p["skipped"] for p in skipped)
    assert (3, 64) in calls and calls  # the stage's own step ran, at the bisected batch and seq 64
    assert "Llama" in result["header"] and "date" in result["header"]


def test_sweep_logic_with_a_simulated_gpu(bench, monkeypatch):
    """Capacities per variant stand in for GPU memory: eager points bisect, compiled points start at the eager
    largest batch, Liger variants are also measured at plain's largest batch, the budget stops new points."""
    capacity = {("plain", False): 18, ("liger_all", False): 45, ("liger_flce", False): 40,
                ("plain", True): 30, ("liger_all", True): 90, ("liger_flce", True): 80}
    built = []

    class FakeTrainer:
        def __init__(self, args, shape, liger, mode, checkpointing):
            built.append((liger, mode, checkpointing))
            self.cap = capacity[(liger, checkpointing)] - (1 if mode == "compile" and liger == "plain" else 0)
            self.liger = liger
            self.kernels = [] if liger == "plain" else ["fused_linear_cross_entropy"]

        def fits(self, batch):
            return batch <= self.cap

        def measure(self, batch, warmup, steps):
            mem = batch * (1.0 if self.liger == "plain" else 0.4)
            return {"tok_s": 1000.0 * batch, "tflops": 1.0, "mfu": 0.5, "loss": 1.0, "seconds": 1.0,
                    "peak_allocated_gb": mem, "peak_reserved_gb": mem + 1}

        def close(self):
            pass

    monkeypatch.setattr(bench, "Trainer", FakeTrainer)
    args = bench.parse_args(["--max-batch", "256"])
    points = bench.run_sweep(args, None, cuda=True)
    at_max = {(p.liger, p.mode, p.checkpointing): p for p in points if p.ok and p.role == "max"}
    assert at_max[("plain", "eager", False)].max_batch == 18
    assert at_max[("liger_all", "eager", True)].max_batch == 90
    # compiled: one probe at the eager batch when it fits, a downward search when it does not
    assert at_max[("liger_all", "compile", False)].probes == [45]
    plain_compiled = at_max[("plain", "compile", False)]
    assert plain_compiled.max_batch == 17 and plain_compiled.probes[0] == 18
    equal = [p for p in points if p.role == "equal"]
    assert {(p.liger, p.mode, p.checkpointing, p.batch) for p in equal} >= {("liger_all", "eager", False, 18),
                                                                             ("liger_flce", "compile", False, 17)}
    cmp = {(c["liger"], c["mode"], c["checkpointing"]): c for c in bench.equal_batch_comparison(points)}
    assert cmp[("liger_all", "eager", False)]["memory_cut"] == pytest.approx(0.6)
    # budget spent: no point starts, each says why
    built.clear()
    args = bench.parse_args(["--budget-s", "0"])
    points = bench.run_sweep(args, None, cuda=True)
    assert built == [] and len(points) == 12 and all("budget" in p.skipped for p in points)
