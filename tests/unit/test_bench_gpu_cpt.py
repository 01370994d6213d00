"""bench/gpu_cpt.py: the largest micro-batch chosen on a warm model against a simulated device memory,
out-of-memory recognition and stepping down, and the whole sweep in --tiny mode on CPU through the CPT
stage's own training step."""

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


class Oom(Exception):
    pass


class FakeDevice:
    """Device memory in GiB, as the H200 behaves for a fused AdamW: a model's first optimizer step creates
    the optimizer state, so a fresh model's first step needs `state` GiB less than every later step."""

    def __init__(self, capacity=100.0, weights=20.0, state=16.0, per_sample=4.0):
        self.total, self.weights, self.state, self.per_sample = capacity, weights, state, per_sample
        self.peak_now = 0.0

    def reset(self):
        self.peak_now = 0.0

    def peak(self):
        return self.peak_now * 2**30

    def capacity(self):
        return self.total * 2**30


class FakeTrainer:
    """Runs out of memory exactly when the FakeDevice would; poisoned after an OOM (as FSDP2 is)."""

    def __init__(self, device: FakeDevice):
        self.device, self.has_state, self.poisoned, self.steps = device, False, False, []
        self.kernels = []

    def step(self, batch, skip=False):
        assert not self.poisoned, "stepped a model that went out of memory"
        need = self.device.weights + self.device.per_sample * batch + (self.device.state if self.has_state else 0)
        if need > self.device.total:
            self.poisoned = True
            raise Oom(f"simulated OOM at batch {batch}")
        self.device.peak_now = max(self.device.peak_now, need)
        self.has_state = True  # the first step (skipped or not) creates the optimizer state
        self.steps.append(batch)

    def warm(self):
        self.step(1, skip=True)

    def measure(self, batch, warmup=2, steps=5):
        for _ in range(warmup + steps):
            self.step(batch)
        return {"tok_s": float(batch)}

    def close(self):
        pass


def steady_capacity(device: FakeDevice) -> int:
    return int((device.total - device.weights - device.state) // device.per_sample)


def test_the_fake_device_reproduces_the_fresh_model_trap():
    """Bisection over models rebuilt after each out-of-memory probe (the search this replaced) returns a
    batch that fits only a fresh model's first step: its steady-state timing runs out of memory."""
    device = FakeDevice()
    trainer = [FakeTrainer(device)]

    def fits(b):
        try:
            trainer[0].step(b)
            return True
        except Oom:
            trainer[0] = FakeTrainer(device)
            return False

    good, bad = 0, None
    b = 16
    while bad is None:  # doubling, then halving the interval
        good, bad, b = (b, None, 2 * b) if fits(b) else (good, b, b)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    assert good == 20 > steady_capacity(device) == 16
    with pytest.raises(Oom):
        FakeTrainer(device).measure(good)  # a warm model at that batch: the timed steps fail


@pytest.mark.parametrize("per_sample", [1.0, 3.0, 4.0, 7.5])
def test_the_chosen_batch_survives_timed_steady_state_steps(bench, per_sample):
    device = FakeDevice(per_sample=per_sample)
    builds = bench.WarmBuilds(lambda: FakeTrainer(device))
    args = bench.parse_args(["--max-batch", "256"])
    batch, fit = bench.choose_batch(builds, device, args)
    assert builds.num_builds == 1 and builds.current().steps[:3] == [1, 2, 4]  # warmed, then the two fit steps
    assert int(0.95 * steady_capacity(device)) - 1 <= batch <= steady_capacity(device)
    assert fit["per_sample_gb"] == pytest.approx(per_sample) and fit["fixed_gb"] == pytest.approx(36.0)
    measured, numbers, failed = bench.measure_stepping_down(
        builds, batch, lambda t, b: t.measure(b), lambda e: isinstance(e, Oom)
    )
    assert (measured, failed, numbers["tok_s"]) == (batch, [], float(batch)) and builds.num_builds == 1


def test_timing_that_runs_out_of_memory_steps_down_on_a_new_warm_model(bench):
    """A fit can be wrong (fragmentation, a workspace that grows with the batch): the timed batch then
    steps down, each try on a new warm model, and the point records the batches that failed."""
    device = FakeDevice()
    built = []

    def make():
        built.append(FakeTrainer(device))
        return built[-1]

    builds = bench.WarmBuilds(make)
    batch, failed = 20, None
    batch, numbers, failed = bench.measure_stepping_down(
        builds, batch, lambda t, b: t.measure(b), lambda e: isinstance(e, Oom)
    )
    assert failed == [20, 19, 18, 17] and batch == 16 == steady_capacity(device)
    assert len(built) == 5 and all(t.poisoned for t in built[:4]) and built[4].steps[0] == 1  # warmed first
    with pytest.raises(ValueError):  # anything but an OOM is not swallowed
        bench.measure_stepping_down(builds, 4, lambda t, b: (_ for _ in ()).throw(ValueError("x")), lambda e: False)


def test_fit_max_batch_is_clamped(bench):
    gib = 2**30
    assert bench.fit_max_batch({2: 10 * gib, 4: 12 * gib}, 100 * gib, 1.0, 64)[0] == 64
    assert bench.fit_max_batch({2: 10 * gib, 4: 10 * gib}, 100 * gib, 1.0, 64)[0] == 64  # no growth: the limit
    batch, fit = bench.fit_max_batch({1: 90 * gib, 2: 99 * gib}, 100 * gib, 0.95, 64)  # 81 + 9/sample: 1.55
    assert batch == 1 and fit["predicted"] == 1 and fit["peaks_gb"] == {"1": 90.0, "2": 99.0}
    assert (fit["fixed_gb"], fit["per_sample_gb"], fit["capacity_gb"]) == pytest.approx((81.0, 9.0, 100.0))
    assert (
        bench.fit_max_batch({1: 99 * gib, 2: 120 * gib}, 100 * gib, 0.95, 64)[0] == 1
    )  # nothing fits: 1, timing decides


def test_out_of_memory_is_recognised_by_type_and_by_message(bench):
    assert bench.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert bench.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert bench.is_oom(RuntimeError("NCCL error: unhandled system error, NCCL version 2.27: Failed to allocate"))
    assert not bench.is_oom(RuntimeError("shape mismatch")) and not bench.is_oom(ValueError("out of memory"))


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


def test_a_point_whose_timing_runs_out_of_memory_measures_a_new_warm_stage_model(bench, monkeypatch):
    """run_point with the real tiny Trainer whose steps above batch 2 raise torch.OutOfMemoryError: on CPU
    the batch is --max-batch (4); timing steps down to 2 on new warm builds, the stage's own step ran."""
    builds = []

    class OomAbove2(bench.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            builds.append(self)

        def step(self, batch, skip=False):
            if batch > 2:
                raise torch.OutOfMemoryError("simulated")
            return super().step(batch, skip)

    args = bench.parse_args(["--tiny", "--max-batch", "4", "--steps", "1", "--warmup", "0", "--equal-batch", "1"])
    monkeypatch.setattr(bench, "Trainer", OomAbove2)
    point = bench.Point("plain")
    points = bench.run_point(args, point)
    assert point.ok and point.batch == point.max_batch == 2 and point.oom_retries == [4, 3]
    assert point.num_builds == 3 and len(builds) == 3 and point.fit is None
    assert point.kernels_ran == {} and point.logits_materialised is True
    assert [p.role for p in points] == ["max", "equal"] and points[1].batch == 1 and points[1].tok_s > 0


def test_counting_calls_counts_and_restores():
    counting_calls = factories.load_bench("liger_probe").counting_calls

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
    assert plain["oom_retries"] == [] and plain["logits_materialised"]
    skipped = [p for p in result["points"] if not p["ok"]]
    assert [p["variant"] for p in skipped] == ["liger"] and all("CUDA" in p["skipped"] for p in skipped)
    assert "POINT_RESULT" in (tmp_path / "log").read_text()  # the point ran in a child process
    assert "Llama" in result["header"] and "date" in result["header"]


def test_sweep_logic_with_a_simulated_gpu(bench):
    """Capacities per variant stand in for GPU memory: plain first, Liger measured also at plain's largest
    batch, compile_flce timed at liger's batch with no fit, the budget stops new points."""
    capacity = {"plain": 18, "liger": 45, "compile_flce": 40}
    commands = []

    def runner(cmd, left, log):
        commands.append(cmd)
        opts = dict(zip(cmd[2::2], cmd[3::2], strict=False))
        variant = opts["--point"]
        best = min(int(opts.get("--batch", 10**6)), capacity[variant])
        mem = 1.0 if variant == "plain" else 0.4
        out = [
            {
                "ok": True,
                "max_batch": best,
                "batch": best,
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

    args = bench.parse_args(["--max-batch", "256", "--variants", "plain,liger,compile_flce"])
    points = bench.run_sweep(args, cuda=True, runner=runner)
    at_max = {p.variant: p for p in points if p.role == "max"}
    assert at_max["plain"].max_batch == 18 and at_max["liger"].max_batch == 45
    assert commands[2][commands[2].index("--batch") + 1] == "45" and at_max["compile_flce"].max_batch == 40
    assert "--batch" not in commands[0] + commands[1]  # plain and liger are fitted
    assert "--equal-batch" not in commands[0] and commands[1][commands[1].index("--equal-batch") + 1] == "18"
    cmp = {c["variant"]: c for c in bench.equal_batch_comparison(points)}
    assert cmp["liger"]["batch"] == 18 and cmp["liger"]["memory_cut"] == pytest.approx(0.6)
    assert [p.variant for p in bench.run_sweep(bench.parse_args([]), cuda=True, runner=runner)] == [
        "plain",
        "liger",
        "liger",
    ]  # the one-shot default: no compile point
    commands.clear()
    points = bench.run_sweep(bench.parse_args(["--budget-s", "59"]), cuda=True, runner=runner)
    assert commands == [] and len(points) == 2 and all("a point needs 60" in p.skipped for p in points)
