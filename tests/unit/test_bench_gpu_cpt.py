"""bench/gpu_cpt.py: bisection of the largest micro-batch, and the whole sweep in --tiny mode on CPU
through the CPT stage's own training step."""

from __future__ import annotations

import json
import os

import factories
import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def bench():
    return factories.load_bench("gpu_cpt")


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
    plan = bench.plan_points(False, list(bench.VARIANTS), (False, True))
    assert [p[0] for p in plan] == ["plain", "liger", "compile_flce"] * 2
    assert all((reason is None) == (variant == "plain") for variant, _, reason in plan)


def test_equal_batch_comparison(bench):
    plain = bench.Point("plain", batch=10, ok=True, tok_s=100.0, peak_allocated_gb=60.0)
    liger = bench.Point("liger", batch=10, role="equal", ok=True, tok_s=120.0, peak_allocated_gb=24.0)
    other = bench.Point("liger", batch=18, ok=True, tok_s=130.0, peak_allocated_gb=50.0)
    (cmp,) = bench.equal_batch_comparison([plain, liger, other])
    assert cmp["batch"] == 10 and cmp["memory_cut"] == pytest.approx(0.6) and cmp["speedup"] == pytest.approx(1.2)


class Oom(Exception):
    pass


def test_every_probe_after_an_out_of_memory_runs_on_a_fresh_model(bench):
    """A simulated OOM poisons the trainer (as FSDP2's state after an OOM in backward): probing it again
    would fail; the bisection must build a new model + optimizer instead."""
    built, closed = [], []

    class Trainer:
        def __init__(self):
            self.poisoned = False
            built.append(self)

        def step(self, batch):
            assert not self.poisoned, "probed a model that went out of memory"
            if batch > 5:
                self.poisoned = True
                raise Oom(f"simulated OOM at batch {batch}")

        def close(self):
            closed.append(self)

    probe = bench.FreshAfterOom(Trainer, lambda exc: isinstance(exc, Oom))
    best, probes = bench.bisect_max_batch(probe.fits, start=4, limit=64)
    assert best == 5 and probes == [4, 8, 6, 5]
    assert probe.builds == [1, 1, 2, 3]  # a new build after each of the two OOMs
    assert len(built) == 3 and closed == built[:2]
    assert probe.current() is built[2] and not built[2].poisoned
    with pytest.raises(ValueError):  # anything but an OOM is not swallowed
        bench.FreshAfterOom(lambda: (_ for _ in ()).throw(ValueError("x")), lambda e: False).fits(1)


def test_a_point_after_an_oom_probe_measures_a_fresh_stage_model(bench, monkeypatch):
    """run_point with the real tiny Trainer whose steps above batch 2 raise torch.OutOfMemoryError: the
    measured model is a build made after the last OOM, and the stage's own step ran on it."""
    import torch

    builds = []

    class OomAbove2(bench.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            builds.append(self)

        def step(self, batch):
            if batch > 2:
                raise torch.OutOfMemoryError("simulated")
            return super().step(batch)

    args = bench.parse_args(["--tiny", "--max-batch", "4", "--steps", "1", "--warmup", "0", "--equal-batch", "1"])
    monkeypatch.setattr(bench, "Trainer", OomAbove2)
    point = bench.Point("plain")
    points = bench.run_point(args, point)
    assert point.ok and point.max_batch == 2 and point.probes == [1, 2, 4, 3]
    # 4 went out of memory: 3 ran on build 2; 3 went out of memory: build 3 is the one measured
    assert point.fresh_after_oom == [1, 1, 1, 2] and len(builds) == 3
    assert point.kernels_ran == {} and point.logits_materialised is True and point.liger_parts_after == []
    assert [p.role for p in points] == ["max", "equal"] and points[1].batch == 1 and points[1].tok_s > 0


def test_counting_calls_counts_and_restores():
    from dilforge_cpt.sharding import counting_calls

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x = torch.ones(2, requires_grad=True)
    with counting_calls({"double": Double}) as counts:
        Double.apply(x).sum().backward()
        Double.apply(x)
    assert counts == {"double": 2} and "apply" not in vars(Double)
    assert torch.equal(Double.apply(x), 2 * x)


def test_time_shares_sorts_kernels_by_kind(bench):
    shares = bench.time_shares(
        [
            ("sm90_xmma_gemm_bf16", 60.0),
            ("flash_fwd_kernel", 25.0),
            ("cudnn_generated_fort_native_sdpa", 5.0),
            ("vectorized_elementwise", 10.0),
        ]
    )
    assert shares["share"] == pytest.approx({"gemm": 0.6, "attention": 0.3, "other": 0.1})


def test_tiny_sweep_runs_each_point_in_its_own_process(bench, tmp_path):
    out = tmp_path / "gpu_cpt.json"
    assert bench.main(["--tiny", "--max-batch", "3", "--json", str(out), "--log", str(tmp_path / "log")]) == 0
    result = json.loads(out.read_text())
    (plain,) = [p for p in result["points"] if p["ok"]]
    assert plain["variant"] == "plain" and plain["max_batch"] == 3 and plain["batch"] == 3 and plain["tok_s"] > 0
    assert plain["probes"] == [1, 2, 3] and plain["liger_parts_after"] == [] and plain["logits_materialised"]
    skipped = [p for p in result["points"] if not p["ok"]]
    assert [p["variant"] for p in skipped] == ["liger", "compile_flce"] and all("CUDA" in p["skipped"] for p in skipped)
    assert "POINT_RESULT" in (tmp_path / "log").read_text()  # the point ran in a child process
    assert "Llama" in result["header"] and "date" in result["header"]


def test_sweep_logic_with_a_simulated_gpu(bench):
    """Capacities per variant stand in for GPU memory: plain first, Liger measured also at plain's largest
    batch, compile_flce searched downwards from liger's largest batch, the budget stops new points."""
    capacity = {"plain": 18, "liger": 45, "compile_flce": 40}
    commands = []

    def runner(cmd, left, log):
        commands.append(cmd)
        opts = dict(zip(cmd[2::2], cmd[3::2], strict=False))
        variant, start, limit = opts["--point"], int(opts["--start-batch"]), int(opts["--max-batch"])
        best, probes = bench.bisect_max_batch(lambda b: b <= capacity[variant], start=start, limit=limit)
        mem = 1.0 if variant == "plain" else 0.4
        out = [
            {
                "ok": True,
                "max_batch": best,
                "batch": best,
                "probes": probes,
                "tok_s": 1000.0 * best,
                "tflops": 1.0,
                "peak_allocated_gb": mem * best,
            }
        ]
        if "--equal-batch" in opts:
            b = int(opts["--equal-batch"])
            out.append(
                {
                    "ok": True,
                    "role": "equal",
                    "batch": b,
                    "max_batch": best,
                    "tok_s": 1100.0 * b,
                    "tflops": 1.0,
                    "peak_allocated_gb": mem * b,
                }
            )
        return out

    args = bench.parse_args(["--max-batch", "256"])
    points = bench.run_sweep(args, cuda=True, runner=runner)
    at_max = {p.variant: p for p in points if p.role == "max"}
    assert at_max["plain"].max_batch == 18 and at_max["liger"].max_batch == 45
    assert at_max["compile_flce"].probes[0] == 45 and at_max["compile_flce"].max_batch == 40
    assert "--equal-batch" not in commands[0] and commands[1][commands[1].index("--equal-batch") + 1] == "18"
    cmp = {c["variant"]: c for c in bench.equal_batch_comparison(points)}
    assert cmp["liger"]["batch"] == 18 and cmp["liger"]["memory_cut"] == pytest.approx(0.6)
    commands.clear()
    points = bench.run_sweep(bench.parse_args(["--budget-s", "0"]), cuda=True, runner=runner)
    assert commands == [] and len(points) == 3 and all("budget" in p.skipped for p in points)
