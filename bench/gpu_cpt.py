#!/usr/bin/env python
"""CPT training throughput and memory on one GPU, through the CPT stage's OWN training step.

Llama-3.2-1B architecture (random init), seq 2048, the stage's runtime (`dilforge_cpt.runtime`: device,
bf16, one-rank FSDP2, the SDPA backend the policy picks), model preparation (`dilforge_cpt.sharding`:
Liger, activation checkpointing, per-layer compile, FSDP2 with the single-rank options), trainable
set, optimizer and `run_step` (`dilforge_cpt.optim`) and its FLOP accounting (`dilforge_cpt.reporting`,
causal attention counted as causal). Variants, each the stage's own choice for its settings:

  plain         eager, no Liger
  liger         eager, the stage's Liger set (RoPE, RMSNorm, SwiGLU, fused linear cross entropy)
  compile_flce  per-layer torch.compile + Liger fused linear cross entropy (the stage's set with compile)

For each: the largest micro-batch that fits in steady state, and at that batch tok/s/GPU, MFU against
the device's datasheet peak AND against the matmul ceiling measured in the same run (`--matmul-tflops`,
from bench/gpu_ceilings.py, else measured here), peak allocated/reserved memory, and the allocator's
retries (`num_alloc_retries`: non-zero = the batch only fits by flushing the cache, which costs time).
Liger is measured at plain's largest batch too (memory cut and speed-up at equal batch).

The batch comes from a memory fit, not from out-of-memory probing: the model is warmed first (one
skipped optimizer step, so the fused AdamW's state exists, as in every later step), then two steady-state
steps (`--fit-batches`, 2 and 4) give peak = fixed + per-sample x batch, and the largest batch within
`--memory-headroom` of the device's memory is timed. If timing still runs out of memory, a new warm
model is timed at the next smaller batch, and `oom_retries` records it.

Honest labels, by construction:
- every point runs in its OWN process (`--point`): Liger's process-wide patches, compiled graphs, the
  one-rank process group and the allocator state of one point cannot reach the next;
- each measurement empties the allocator's cache and resets its peak first;
- the Liger kernels that actually RAN are counted (their autograd Functions' calls during one checked
  step) and fused linear cross entropy is proven by the forward returning no logits.

compile_flce is not in the default set (its Inductor compiles do not fit the one-shot device call):
`--variants compile_flce` runs it alone (scripts/gpu_check.sh --second).

  python bench/gpu_cpt.py --json out.json                 # one GPU, the table (about 4-6 minutes)
  python bench/gpu_cpt.py --budget-s 240 --json out.json  # start no point after 240 s
  python bench/gpu_cpt.py --tiny --json out.json          # CPU, tiny Llama: checks the script (seconds)

Points not run (no CUDA for Liger, budget spent, a point's process failed) are listed with the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("plain", "liger", "compile_flce")
RESULT_PREFIX = "POINT_RESULT "


@dataclass
class Point:
    variant: str
    checkpointing: bool = False
    batch: int = 0
    role: str = "max"  # "max": at this variant's largest batch; "equal": at plain's largest batch
    ok: bool = False
    skipped: str | None = None  # why the point did not run
    max_batch: int | None = None  # the batch chosen for this variant (fitted, or stepped down from the fit)
    fit: dict | None = None  # the memory fit that chose it (fixed and per-sample GiB, capacity, prediction)
    oom_retries: list[int] = field(default_factory=list)  # batches that ran out of memory while timing
    num_builds: int = 0  # models built (one, unless timing ran out of memory)
    kernels: list[str] = field(default_factory=list)  # Liger kernels the stage applied
    kernels_ran: dict[str, int] = field(default_factory=dict)  # Liger autograd Functions called in one step
    logits_materialised: bool | None = None
    tok_s: float | None = None
    mfu_spec: float | None = None  # against the datasheet peak
    mfu_measured: float | None = None  # against the measured bf16 matmul ceiling
    tflops: float | None = None
    peak_allocated_gb: float | None = None
    peak_reserved_gb: float | None = None
    num_alloc_retries: int | None = None
    loss: float | None = None
    seconds: float | None = None
    attention: str | None = None
    profile: dict | None = None


# ---- the largest micro-batch: fitted on a warm model, confirmed by the timed steady-state steps ------


def fit_max_batch(peaks: dict[int, float], capacity: float, headroom: float, limit: int) -> tuple[int, dict]:
    """The largest batch whose steady-state peak, extrapolated linearly from two measured batches, stays
    within `headroom` of `capacity` (bytes); clamped to [1, limit]. Peak memory of a training step is
    fixed (weights, gradients, optimizer state) plus per-sample (activations, logits), so two points fit it."""
    (b1, p1), (b2, p2) = sorted(peaks.items())[:2]
    per_sample = (p2 - p1) / (b2 - b1)
    fixed = p1 - per_sample * b1
    usable = capacity * headroom - fixed
    predicted = limit if per_sample <= 0 else int(usable // per_sample)
    fit = {
        "fixed_gb": fixed / 2**30,
        "per_sample_gb": per_sample / 2**30,
        "capacity_gb": capacity / 2**30,
        "headroom": headroom,
        "peaks_gb": {str(b): p / 2**30 for b, p in sorted(peaks.items())},
        "predicted": predicted,
    }
    return max(1, min(limit, predicted)), fit


class WarmBuilds:
    """Trainers whose optimizer state exists before any measured step: a fused AdamW creates its state at
    the first `step()`, so a fresh model's first step peaks ~8 bytes/parameter below every later one, and a
    batch found on a fresh model runs out of memory once timing starts. Every build takes one skipped step
    at batch 1 (`Trainer.warm`: the stage's own `run_step(skip=...)`), and after an out-of-memory error the
    trainer is discarded (FSDP2's state is not usable after an OOM inside backward)."""

    def __init__(self, make_trainer: Callable[[], object]):
        self.make_trainer = make_trainer
        self.trainer = None
        self.num_builds = 0

    def current(self):
        if self.trainer is None:
            self.trainer = self.make_trainer()
            self.trainer.warm()
            self.num_builds += 1
        return self.trainer

    def discard(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = None
        free_memory()


def choose_batch(builds: WarmBuilds, memory, args) -> tuple[int, dict | None]:
    """The batch to time: `--batch` if given; else fitted from two steady-state steps on a warm model
    (no out-of-memory probing); on a device without memory statistics (CPU) `--max-batch`."""
    if args.batch:
        return args.batch, None
    if memory.capacity() is None:
        return args.max_batch, None
    trainer = builds.current()
    peaks = {}
    for b in args.fit_batches:
        memory.reset()
        trainer.step(b)
        peaks[b] = memory.peak()
    return fit_max_batch(peaks, memory.capacity(), args.memory_headroom, args.max_batch)


def next_smaller(batch: int) -> int:
    return batch - max(1, batch // 16)


def measure_stepping_down(builds: WarmBuilds, batch: int, measure: Callable, is_oom) -> tuple[int, dict, list[int]]:
    """measure(trainer, batch) at `batch`; if it runs out of memory, a new warm trainer at the next smaller
    batch, and so on. Returns (batch measured, its numbers, the batches that ran out of memory)."""
    failed: list[int] = []
    while batch >= 1:
        try:
            return batch, measure(builds.current(), batch), failed
        except BaseException as exc:
            if not is_oom(exc):
                raise
            failed.append(batch)
            builds.discard()
            batch = next_smaller(batch)
    raise RuntimeError(f"batch 1 runs out of memory (tried {failed})")


class DeviceMemory:
    """Peak and capacity of the CUDA device's memory in bytes; None on a CPU (nothing to fit)."""

    def __init__(self, rt):
        self.rt = rt

    def reset(self) -> None:
        import torch

        free_memory()
        torch.cuda.reset_peak_memory_stats(self.rt.device)

    def peak(self) -> float:
        import torch

        return float(torch.cuda.max_memory_reserved(self.rt.device))

    def capacity(self) -> float | None:
        import torch

        return float(torch.cuda.mem_get_info(self.rt.device)[1]) if self.rt.cuda else None


# ---- the stage's pieces ------------------------------------------------------------------------------


def model_shape(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=4096,
        )
    # Llama-3.2-1B
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    )


def stage_config(args, variant: str, checkpointing: bool, batch: int = 1):
    """The CPT stage config of one point: only what the training step reads is meaningful."""
    from dilforge_cpt.config import CptConfig

    return CptConfig.model_validate(
        {
            "scratch_model": {"max_position_embeddings": 131072},
            "corpora": [{"uri": "/dev/null"}],
            "validation": [{"uri": "/dev/null"}],
            "seq_len": args.seq,
            "phase2": {"num_steps": 1, "learning_rate": 1e-4},
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "compile": variant == "compile_flce",
            "activation_checkpointing": checkpointing,
            "liger": "off" if variant == "plain" else "auto",
            "fsdp": "auto",
            "peak_tflops_per_device": args.peak_tflops,
        }
    )


class Trainer:
    """One variant's model + optimizer, stepped through dilforge_cpt.optim.run_step at any micro-batch."""

    def __init__(self, args, shape, rt, variant: str, checkpointing: bool):
        import numpy as np
        import torch
        from dilforge_cpt import optim, reporting, sharding
        from transformers import LlamaForCausalLM

        self.config = stage_config(args, variant, checkpointing)
        self.rt = rt
        torch.manual_seed(0)
        with self.rt.device:  # initialise on the GPU: a 1.2B-parameter init on CPU takes longer than the measurement
            model = LlamaForCausalLM(shape)
        self.kernels = sharding.apply_liger(model, self.config, self.rt)  # for this process: one per point
        self.num_params = sum(p.numel() for p in model.parameters())  # before sharding, as the stage counts
        self.model = sharding.shard_model(model, self.config, self.rt)
        self.trainable = optim.set_trainable(self.model, 2)
        self.optimizer = optim.make_optimizer(self.trainable, self.config, self.config.phase2, fused=self.rt.cuda)
        self.fpt = reporting.flops_per_token(shape, self.num_params, args.seq, phase=2)
        self.peak = reporting.peak_flops(self.config, self.rt)
        self.shape, self.seq = shape, args.seq
        self.rng = np.random.default_rng(0)

    def tokens(self, batch: int):
        return self.rng.integers(0, self.shape.vocab_size, size=(batch, self.seq), dtype="int64")

    def step(self, batch: int, skip: bool = False) -> float:
        import torch
        from dilforge_cpt import optim

        result = optim.run_step(
            self.model,
            self.optimizer,
            [self.tokens(batch)],
            self.rt,
            self.config.max_grad_norm,
            self.trainable.row_masks,
            skip=torch.tensor(skip, device=self.rt.device),
        )
        return float(result.loss)  # read back every step: a bench point is timed to the device's finish

    def warm(self) -> None:
        """One skipped step at batch 1: the fused optimizer creates its state, the weights do not change."""
        self.step(1, skip=True)

    def check_kernels(self) -> tuple[dict[str, int], bool]:
        """One forward + backward at batch 1 counting the Liger Functions that ran; and whether the
        forward returned logits (fused linear cross entropy returns none)."""
        import torch
        from liger_probe import counting_calls, liger_functions

        x = torch.from_numpy(self.tokens(1)).to(self.rt.device)
        with counting_calls(liger_functions()) as counts:
            with self.rt.autocast():
                out = self.model(input_ids=x, labels=x)
            out.loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return {k: v for k, v in counts.items() if v}, out.logits is not None

    def measure(self, batch: int, warmup: int, steps: int, matmul_flops: float | None) -> dict:
        import torch
        from dilforge_cpt import reporting

        for _ in range(warmup):
            self.step(batch)
        sync(self.rt)
        retries0 = 0
        if self.rt.cuda:  # this measurement's own peak: nothing cached from an earlier, larger batch
            free_memory()
            torch.cuda.reset_peak_memory_stats(self.rt.device)
            retries0 = torch.cuda.memory_stats(self.rt.device).get("num_alloc_retries", 0)
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.step(batch)
        sync(self.rt)
        elapsed = time.perf_counter() - start
        tok_s = batch * self.seq * steps / elapsed
        out = {
            "tok_s": tok_s,
            "tflops": tok_s * self.fpt / 1e12,
            "mfu_spec": reporting.mfu(tok_s, self.fpt, self.peak),
            "mfu_measured": reporting.mfu(tok_s, self.fpt, matmul_flops),
            "loss": loss,
            "seconds": elapsed,
        }
        if self.rt.cuda:
            stats = torch.cuda.memory_stats(self.rt.device)
            out["num_alloc_retries"] = stats.get("num_alloc_retries", 0) - retries0
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(self.rt.device) / 2**30
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.rt.device) / 2**30
        return out

    def profile(self, batch: int) -> dict:
        """Where one step's device time goes: GEMM, attention, everything else (torch.profiler)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if self.rt.cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            self.step(batch)
            sync(self.rt)
        attr = "device_time_total" if self.rt.cuda else "self_cpu_time_total"
        return time_shares([(e.key, getattr(e, attr, 0) or 0) for e in prof.key_averages()])

    def close(self) -> None:
        self.model = self.optimizer = None
        free_memory()


def time_shares(kernels: list[tuple[str, float]]) -> dict:
    """Kernel times by kind: GEMM (cuBLAS/CUTLASS names), attention (flash/cuDNN/efficient/flex
    kernels), other; shares of the total."""
    kinds = {
        "gemm": ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm"),
        "attention": ("flash", "fmha", "cudnn", "attention", "sdpa", "flex"),
    }
    totals = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for name, t in kernels:
        low = name.lower()
        kind = next((k for k, keys in kinds.items() if any(key in low for key in keys)), "other")
        totals[kind] += t
    whole = sum(totals.values()) or 1.0
    return {"time_us": totals, "share": {k: v / whole for k, v in totals.items()}}


def sync(rt) -> None:
    import torch

    if rt.cuda:
        torch.cuda.synchronize(rt.device)


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "failed to allocate")


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, and the allocation failures near the edge that libraries raise as plain
    RuntimeErrors (cuBLAS workspace, cuDNN, NCCL buffers)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MESSAGES)


# ---- one point, in its own process -------------------------------------------------------------------


def run_point(args, point: Point, make_trainer: Callable[[], Trainer] | None = None, memory=None) -> list[Point]:
    """Choose the batch on a warm model (`choose_batch`), check the kernels, time it in steady state
    (stepping down on out-of-memory), and, if asked, time plain's largest batch too (`--equal-batch`).
    Returns the point and its equal-batch twin."""
    import torch
    from dilforge_cpt import runtime

    shape = model_shape(args.tiny)
    rt = runtime.init_runtime(stage_config(args, point.variant, point.checkpointing))
    point.attention = "sdpa (torch's default backend order)"
    builds = WarmBuilds(make_trainer or (lambda: Trainer(args, shape, rt, point.variant, point.checkpointing)))
    memory = memory or DeviceMemory(rt)
    out = [point]
    matmul = args.matmul_tflops * 1e12 if args.matmul_tflops else None
    try:
        if point.variant == "compile_flce":
            torch._dynamo.reset()
        batch, point.fit = choose_batch(builds, memory, args)
        if point.variant != "compile_flce":  # a batch-1 check would cost the compiled variant one more compile
            point.kernels_ran, point.logits_materialised = builds.current().check_kernels()
        point.batch, numbers, point.oom_retries = measure_stepping_down(
            builds, batch, lambda t, b: t.measure(b, args.warmup, args.steps, matmul), is_oom
        )
        trainer = builds.current()
        point.kernels, point.max_batch = list(trainer.kernels), point.batch
        point.__dict__.update(numbers, ok=True)
        if args.profile:
            point.profile = trainer.profile(point.batch)
        if args.equal_batch and args.equal_batch < point.batch:
            twin = Point(
                point.variant,
                point.checkpointing,
                batch=args.equal_batch,
                role="equal",
                max_batch=point.batch,
                kernels=point.kernels,
                kernels_ran=point.kernels_ran,
                logits_materialised=point.logits_materialised,
                attention=point.attention,
            )
            twin.__dict__.update(trainer.measure(args.equal_batch, args.warmup, args.steps, matmul), ok=True)
            out.append(twin)
    finally:
        point.num_builds = builds.num_builds
        builds.discard()
        runtime.shutdown(rt)
    return out


def point_main(args) -> int:
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    point = Point(args.point, args.point_checkpointing == "on")
    try:
        points = run_point(args, point)
    except Exception as exc:  # a variant that breaks (compile error, OOM while timing) is reported, not fatal
        point.ok = False
        point.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        points = [point]
    print(RESULT_PREFIX + json.dumps([asdict(p) for p in points]), flush=True)
    return 0


# ---- the sweep: one process per point ----------------------------------------------------------------


def plan_points(cuda: bool, variants: list[str], checkpointing: tuple[bool, ...]) -> list[tuple[str, bool, str | None]]:
    """(variant, checkpointing, reason skipped) in run order, plain first per checkpointing setting so its
    largest batch is known when the Liger variants are measured at equal batch."""
    out = []
    for ckpt in checkpointing:
        for variant in variants:
            out.append((variant, ckpt, None if cuda or variant == "plain" else "Liger needs CUDA (Triton)"))
    return out


def point_command(args, variant: str, ckpt: bool, batch: int | None, equal: int | None) -> list[str]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--point",
        variant,
        "--point-checkpointing",
        "on" if ckpt else "off",
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--max-batch",
        str(args.max_batch),
        "--fit-batches",
        ",".join(map(str, args.fit_batches)),
        "--memory-headroom",
        str(args.memory_headroom),
    ]
    if batch:
        cmd += ["--batch", str(batch)]
    if equal:
        cmd += ["--equal-batch", str(equal)]
    for flag, value in (("--matmul-tflops", args.matmul_tflops), ("--peak-tflops", args.peak_tflops)):
        if value:
            cmd += [flag, str(value)]
    if args.tiny:
        cmd.append("--tiny")
    if args.profile:
        cmd.append("--profile")
    return cmd


def run_in_process(cmd: list[str], timeout: float, log) -> list[dict]:
    """Run one point's process; its results are on the last RESULT line; its output goes to `log`."""
    try:
        limit = None if timeout == float("inf") else max(1.0, timeout)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write(out)
        return [{"skipped": f"stopped after {timeout:.0f} s (the time left in the budget)"}]
    log.write(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return [{"skipped": f"point process exited {proc.returncode}: {tail[0][:200]}"}]
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def run_sweep(args, cuda: bool, header: str = "", runner=run_in_process) -> list[Point]:
    """plain first (its largest batch is the equal-batch reference), then liger, then compile_flce, timed at
    liger's batch when known (each compiled shape recompiles: no fit). A point is started only with at
    least `--point-min-s` of the budget left, and stopped when the budget ends."""
    points: list[Point] = []
    began = time.perf_counter()
    log = open(args.log, "a") if args.log else open(os.devnull, "w")  # noqa: SIM115
    with log:
        for variant, ckpt, skip in plan_points(cuda, args.variants, args.checkpointing):
            done = {p.variant: p.max_batch for p in points if p.ok and p.role == "max" and p.checkpointing == ckpt}
            batch = args.batch
            if variant == "compile_flce" and not batch:
                batch = done.get("liger") or done.get("plain")
            left = args.budget_s - (time.perf_counter() - began)
            if skip is None and left < max(args.point_min_s, 1e-9):
                skip = f"{max(0.0, left):.0f} s of the {args.budget_s:.0f} s budget left, a point needs {args.point_min_s:.0f}"
            if skip:
                points.append(Point(variant, ckpt, skipped=skip))
                print(row(points[-1]), flush=True)
                continue
            equal = done.get("plain") if variant != "plain" else None
            for result in runner(point_command(args, variant, ckpt, batch, equal), left, log):
                point = Point(variant, ckpt)
                point.__dict__.update({k: v for k, v in result.items() if k in Point.__dataclass_fields__})
                point.variant, point.checkpointing = variant, ckpt
                points.append(point)
                print(row(point), flush=True)
            write_json(args.json, header, points)
    return points


def write_json(path: str | None, header: str, points: list[Point]) -> None:
    """Rewritten after every point, so a run stopped by a wall-clock limit still leaves its results."""
    if path:
        Path(path).write_text(
            json.dumps(
                {
                    "header": header,
                    "points": [asdict(p) for p in points],
                    "equal_batch": equal_batch_comparison(points),
                },
                indent=1,
            )
        )


def equal_batch_comparison(points: list[Point]) -> list[dict]:
    """Liger vs plain at the same micro-batch and checkpointing: peak memory cut and speed-up."""
    base = {(p.checkpointing, p.batch): p for p in points if p.ok and p.variant == "plain"}
    out = []
    for p in points:
        b = base.get((p.checkpointing, p.batch))
        if p.ok and p.variant != "plain" and b is not None:
            cut = (
                (1 - p.peak_allocated_gb / b.peak_allocated_gb) if p.peak_allocated_gb and b.peak_allocated_gb else None
            )
            out.append(
                {
                    "variant": p.variant,
                    "checkpointing": p.checkpointing,
                    "batch": p.batch,
                    "memory_cut": cut,
                    "speedup": p.tok_s / b.tok_s,
                }
            )
    return out


HEADER = (
    f"{'variant':<13} {'ckpt':<5} {'batch':>5} {'at':<6} {'max':>4} {'tok/s/GPU':>11} {'MFU spec':>8} "
    f"{'MFU meas':>8} {'TFLOP/s':>8} {'alloc GB':>8} {'resv GB':>8} {'retry':>5}  note"
)


def row(p: Point) -> str:
    def num(v, fmt):
        return format(v, fmt) if v is not None else "n/a"

    def pct(v):
        return f"{100 * v:.1f}%" if v is not None else "n/a"

    head = f"{p.variant:<13} {p.checkpointing!s:<5}"
    if not p.ok:
        return f"{head} {'':>5} {'':<6} {num(p.max_batch, 'd'):>4}  {p.skipped}"
    ran = ",".join(sorted(p.kernels_ran)) or "none"
    note = (
        f"{fit_note(p)}; liger ran: {ran}; logits {'yes' if p.logits_materialised else 'none'}"
        if p.role == "max"
        else "at plain's largest batch"
    )
    return (
        f"{head} {p.batch:>5} {p.role:<6} {num(p.max_batch, 'd'):>4} {p.tok_s:>11,.0f} {pct(p.mfu_spec):>8} "
        f"{pct(p.mfu_measured):>8} {p.tflops:>8.1f} {num(p.peak_allocated_gb, '.1f'):>8} "
        f"{num(p.peak_reserved_gb, '.1f'):>8} {num(p.num_alloc_retries, 'd'):>5}  {note}"
    )


def fit_note(p: Point) -> str:
    retried = f", out of memory at {p.oom_retries}" if p.oom_retries else ""
    if not p.fit:
        return f"batch given{retried}"
    return (
        f"fit {p.fit['fixed_gb']:.1f} GB + {p.fit['per_sample_gb']:.2f} GB/sample of {p.fit['capacity_gb']:.0f} GB "
        f"-> {p.fit['predicted']}{retried}"
    )


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny Llama on CPU (tests the script)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (2048; 64 with --tiny)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (5; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per point (2; 1 with --tiny)")
    ap.add_argument("--batch", type=int, default=None, help="time this batch (no memory fit)")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch chosen (128; 4 with --tiny)")
    ap.add_argument("--fit-batches", default=None, help="two batches whose steady-state peaks fit memory (2,4)")
    ap.add_argument("--memory-headroom", type=float, default=0.95, help="fraction of device memory the fit may fill")
    ap.add_argument("--point-min-s", type=float, default=None, help="start no point with less budget left (60)")
    ap.add_argument(
        "--variants", default="plain,liger", help="comma list of plain,liger,compile_flce (compile: a call of its own)"
    )
    ap.add_argument("--checkpointing", default="off", help="comma list of off,on (activation checkpointing)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no new point after this many seconds")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's datasheet bf16 TFLOP/s")
    ap.add_argument(
        "--matmul-tflops",
        type=float,
        default=None,
        help="measured bf16 matmul ceiling for the second MFU (bench/gpu_ceilings.py); measured here if absent",
    )
    ap.add_argument("--profile", action="store_true", help="profile one step per variant: GEMM / attention shares")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--log", default=None, help="append the points' own output to this file")
    ap.add_argument("--point", choices=VARIANTS, default=None, help=argparse.SUPPRESS)  # one point, this process
    ap.add_argument("--point-checkpointing", choices=("off", "on"), default="off", help=argparse.SUPPRESS)
    ap.add_argument("--equal-batch", type=int, default=None, help=argparse.SUPPRESS)  # also measure here
    args = ap.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.steps = args.steps or (2 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.fit_batches = tuple(int(b) for b in (args.fit_batches or ("1,2" if args.tiny else "2,4")).split(","))
    args.point_min_s = args.point_min_s if args.point_min_s is not None else (0.0 if args.tiny else 60.0)
    args.max_batch = args.max_batch or (4 if args.tiny else 128)
    args.variants = args.variants.split(",")
    ckpt = args.checkpointing.split(",")
    args.checkpointing = tuple(c == "on" for c in ckpt)
    bad = [v for v in args.variants if v not in VARIANTS] + [c for c in ckpt if c not in ("off", "on")]
    if bad:
        ap.error(f"unknown variant or checkpointing setting {bad}")
    if len(args.fit_batches) != 2 or len(set(args.fit_batches)) != 2 or min(args.fit_batches) < 1:
        ap.error(f"--fit-batches takes two different positive batches, not {args.fit_batches}")
    return args


def measured_matmul_tflops() -> float | None:
    """A quick bf16 8192³ matmul ceiling when bench/gpu_ceilings.py did not pass one (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from gpu_ceilings import matmul_tflops

    return matmul_tflops(8192, 8192, 8192, reps=10)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA (children inherit it)
    if args.point:
        return point_main(args)
    import torch
    from hardware import describe

    cuda = torch.cuda.is_available()
    if args.matmul_tflops is None:
        args.matmul_tflops = measured_matmul_tflops()
    header = (
        f"# gpu_cpt: {describe('transformers', 'liger-kernel')}; seq {args.seq}; "
        f"{'tiny Llama' if args.tiny else 'Llama-3.2-1B shape'}; steps {args.steps} (+{args.warmup} warmup); "
        f"measured matmul ceiling {args.matmul_tflops or 'n/a'} TFLOP/s; one process per point"
    )
    print(header)
    print(HEADER, flush=True)
    points = run_sweep(args, cuda, header)
    for c in equal_batch_comparison(points):
        cut = f"{100 * c['memory_cut']:.0f}% lower peak memory" if c["memory_cut"] is not None else "memory n/a"
        print(
            f"# {c['variant']} vs plain, checkpointing {c['checkpointing']}, batch {c['batch']}: "
            f"{cut}, {c['speedup']:.2f}x tok/s"
        )
    write_json(args.json, header, points)
    return 0 if any(p.ok for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
