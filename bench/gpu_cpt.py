#!/usr/bin/env python
"""CPT training throughput and memory on one GPU, through the CPT stage's OWN training step.

Llama-3.2-1B architecture (random init), seq 2048, the stage's runtime (`dilforge_cpt.runtime`), model
preparation (`dilforge_cpt.sharding`: Liger, activation checkpointing, per-layer compile, FSDP2 when the
runtime says so), trainable set, optimizer and `train_step` (`dilforge_cpt.loop`) and its FLOP and
peak accounting (`dilforge_cpt.reporting`); only the Liger kernel set is chosen here. One table for
{plain, Liger all kernels, Liger FLCE only} x {eager, compile} x {no activation checkpointing,
checkpointing}: the largest micro-batch that fits, found by bisection (doubling until the first
out-of-memory, then halving the interval: any integer, not only powers of two), and at that batch
tok/s/GPU, MFU, achieved TFLOP/s, peak allocated and reserved memory. Liger variants are also
measured at the plain variant's largest batch of the same mode, which gives Liger's memory cut and
speed-up at equal batch.

On one GPU the stage trains through a one-rank FSDP2 group (bf16 compute, fp32 master weights) with
fused AdamW, so the bench does too. MFU = tok/s x FLOPs/token (the stage's phase-2 `flops_per_token`)
/ the device's peak (the stage's table by exact device name, `--peak-tflops` to override). Goal on one H200 (Llama-3.2-1B shape, seq 2048): >= 80,000 tok/s/GPU,
>= 65 % MFU, Liger >= 50 % lower peak training memory than plain at equal batch.

  python bench/gpu_cpt.py --json out.json                 # one GPU, the whole table
  python bench/gpu_cpt.py --budget-s 240 --json out.json  # stop starting new points after 240 s
  python bench/gpu_cpt.py --tiny --json out.json          # CPU, tiny Llama: checks the script (seconds)

Compiled points start from the eager largest batch of the same variant and search only downwards
(`--bisect-compiled` searches from scratch). The whole table takes about 10-15 minutes on one H200
(mostly compilation); scripts/gpu_check.sh runs it with the time left after the GPU suite, eager
points first.

Points not run (no CUDA for Liger, budget spent) are listed with the reason.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LIGER_VARIANTS = ("plain", "liger_all", "liger_flce")
MODES = ("eager", "compile")
CHECKPOINTING = (False, True)


@dataclass
class Point:
    liger: str
    mode: str
    checkpointing: bool
    batch: int = 0
    role: str = "max"           # "max": at this variant's largest batch; "equal": at plain's largest batch
    ok: bool = False
    skipped: str | None = None  # why the point did not run
    max_batch: int | None = None
    probes: list[int] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # the Liger kernels actually applied (the stage decides for liger_all)
    tok_s: float | None = None
    mfu: float | None = None
    tflops: float | None = None
    peak_allocated_gb: float | None = None
    peak_reserved_gb: float | None = None
    loss: float | None = None
    seconds: float | None = None


# ---- bisection ---------------------------------------------------------------------------------------

def bisect_max_batch(fits: Callable[[int], bool], start: int = 1, limit: int = 256) -> tuple[int, list[int]]:
    """Largest batch b in [1, limit] with fits(b), assuming fits is monotone; and the batches probed.

    Doubling from `start` until the first failure (or `limit`), then bisection of the interval
    between the last batch that fit and the first that did not. If `start` itself fails the search
    goes down. Returns 0 when not even batch 1 fits.
    """
    probes: list[int] = []

    def probe(b: int) -> bool:
        probes.append(b)
        return fits(b)

    start = max(1, min(start, limit))
    if probe(start):
        good, bad = start, None
        while bad is None and good < limit:
            nxt = min(2 * good, limit)
            if probe(nxt):
                good = nxt
            else:
                bad = nxt
        if bad is None:
            return good, probes
    else:
        good, bad = 0, start
    while bad - good > 1:
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, probes


# ---- the stage's pieces ------------------------------------------------------------------------------

def model_shape(tiny: bool):
    from transformers import LlamaConfig
    if tiny:
        return LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           rope_theta=500000.0, max_position_embeddings=4096)
    # Llama-3.2-1B
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                       rope_theta=500000.0, max_position_embeddings=131072)


def stage_config(args, mode: str, checkpointing: bool, liger: str):
    """The CPT stage config of one point: only what the training step reads is meaningful."""
    from dilforge_shared.configs.cpt import CptConfig
    return CptConfig.model_validate({
        "scratch_model": {"max_position_embeddings": 131072}, "corpora": [{"uri": "/dev/null"}],
        "validation": [{"uri": "/dev/null"}], "seq_len": args.seq, "phase2": {"num_steps": 1, "learning_rate": 1e-4},
        "global_batch_size": 1, "micro_batch_size": 1, "compile": mode == "compile",
        "activation_checkpointing": checkpointing, "liger": "off" if liger == "plain" else "auto", "fsdp": "auto",
        "peak_tflops_per_device": args.peak_tflops,
    })


def apply_kernels(model, config, rt, liger: str) -> list[str]:
    """plain: none; liger_all: the stage's own set (apply_liger); liger_flce: fused linear cross entropy only."""
    from dilforge_cpt import sharding
    if liger == "plain" or not rt.cuda:
        return []
    if liger == "liger_all":
        return sharding.apply_liger(model, config, rt)
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)
    return ["fused_linear_cross_entropy"]


_RUNTIME: list = []


def runtime_for(config):
    """The stage's runtime, made once per process: every point shares its device, dtype and (if the stage
    sets one up) process group; what differs between points (Liger, compile, checkpointing) is not in it."""
    if not _RUNTIME:
        from dilforge_cpt import runtime
        _RUNTIME.append(runtime.init_runtime(config))
    return _RUNTIME[0]


class Trainer:
    """One variant's model + optimizer, stepped through dilforge_cpt.loop.train_step at any micro-batch."""

    def __init__(self, args, shape, liger: str, mode: str, checkpointing: bool):
        import torch
        from dilforge_cpt import loop, reporting, sharding
        from transformers import LlamaForCausalLM
        self.config = stage_config(args, mode, checkpointing, liger)
        self.rt = runtime_for(self.config)
        torch.manual_seed(0)
        with self.rt.device:  # initialise on the GPU: a 1.2B-parameter init on CPU takes longer than the measurement
            model = LlamaForCausalLM(shape)
        self.kernels = apply_kernels(model, self.config, self.rt, liger)
        self.num_params = sum(p.numel() for p in model.parameters())  # before sharding, as the stage counts
        self.model = sharding.shard_model(model, self.config, self.rt)
        self.trainable = loop.set_trainable(self.model, 2)
        self.optimizer = loop.make_optimizer(self.trainable, self.config, self.config.phase2, fused=self.rt.cuda)
        self.fpt = reporting.flops_per_token(shape, self.num_params, args.seq, phase=2)
        self.peak = reporting.peak_flops(self.config, self.rt)
        self.shape, self.seq = shape, args.seq
        self.rng = __import__("numpy").random.default_rng(0)

    def step(self, batch: int) -> float:
        from dilforge_cpt import loop
        tokens = self.rng.integers(0, self.shape.vocab_size, size=(batch, self.seq), dtype="int64")
        loss, _ = loop.train_step(self.model, self.optimizer, [tokens], self.rt, self.config.max_grad_norm,
                                  self.trainable.row_masks)
        return loss

    def fits(self, batch: int) -> bool:
        import torch
        try:
            self.step(batch)
            return True
        except torch.OutOfMemoryError:
            self.optimizer.zero_grad(set_to_none=True)
            free_memory()
            return False

    def measure(self, batch: int, warmup: int, steps: int) -> dict:
        import torch
        for _ in range(warmup):
            self.step(batch)
        sync(self.rt)
        if self.rt.cuda:
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.step(batch)
        sync(self.rt)
        elapsed = time.perf_counter() - start
        tok_s = batch * self.seq * steps / elapsed
        achieved = tok_s * self.fpt
        out = {"tok_s": tok_s, "tflops": achieved / 1e12, "mfu": achieved / self.peak if self.peak else None,
               "loss": loss, "seconds": elapsed}
        if self.rt.cuda:
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated(self.rt.device) / 2**30
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.rt.device) / 2**30
        return out

    def close(self) -> None:
        self.model = self.optimizer = None
        free_memory()


def sync(rt) -> None:
    import torch
    if rt.cuda:
        torch.cuda.synchronize(rt.device)


def free_memory() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the sweep -----------------------------------------------------------------------------------------

def plan_points(cuda: bool, modes: list[str], ligers: list[str],
                checkpointing: tuple[bool, ...] = CHECKPOINTING) -> list[tuple[str, str, bool, str | None]]:
    """(liger, mode, checkpointing, reason skipped) in run order: every eager point before any compiled one
    (compiled points start from the eager largest batch), and per (mode, checkpointing) plain first, so its
    largest batch is known when the Liger variants are measured at equal batch."""
    out = []
    for mode, ckpt in itertools.product(modes, checkpointing):
        for liger in ligers:
            out.append((liger, mode, ckpt, None if cuda or liger == "plain" else "Liger needs CUDA (Triton)"))
    return out


def write_json(path: str | None, header: str, points: list[Point]) -> None:
    """Rewritten after every point, so a run stopped by a wall-clock limit still leaves its results."""
    if path:
        Path(path).write_text(json.dumps({"header": header, "points": [asdict(p) for p in points],
                                          "equal_batch": equal_batch_comparison(points)}, indent=1))


def measure_point(trainer, point: Point, args, eager_max: dict, plain_max: dict, points: list[Point]) -> None:
    """Time `point` at its largest batch; a Liger variant also at plain's largest batch of its mode."""
    key, mode_key = (point.liger, point.checkpointing), (point.mode, point.checkpointing)
    if point.mode == "eager":
        eager_max[key] = point.max_batch
    if point.liger == "plain":
        plain_max[mode_key] = point.max_batch
    point.batch, point.kernels = point.max_batch, list(trainer.kernels)
    point.__dict__.update(trainer.measure(point.batch, args.warmup, args.steps), ok=True)
    equal = plain_max.get(mode_key)
    if point.liger != "plain" and equal and equal < point.max_batch:
        extra = Point(point.liger, point.mode, point.checkpointing, batch=equal, role="equal",
                      max_batch=point.max_batch, kernels=point.kernels)
        extra.__dict__.update(trainer.measure(equal, args.warmup, args.steps), ok=True)
        points.append(extra)


def run_sweep(args, shape, cuda: bool, header: str = "") -> list[Point]:
    import torch
    points: list[Point] = []
    began = time.perf_counter()
    plain_max: dict[tuple[str, bool], int] = {}
    eager_max: dict[tuple[str, bool], int] = {}
    start_hint = args.start_batch
    for liger, mode, ckpt, skip in plan_points(cuda, args.modes, args.liger, args.checkpointing):
        point = Point(liger, mode, ckpt)
        points.append(point)
        if skip is None and time.perf_counter() - began > args.budget_s:
            skip = f"time budget of {args.budget_s:.0f} s spent"
        if skip:
            point.skipped = skip
            print(row(point), flush=True)
            continue
        if mode == "compile":
            torch._dynamo.reset()  # every compiled point compiles its own graphs
        trainer = None
        try:
            trainer = Trainer(args, shape, liger, mode, ckpt)
            known = eager_max.get((liger, ckpt)) if mode == "compile" and not args.bisect_compiled else None
            # a compiled point starts at the eager point's largest batch and only searches down if it does not
            # fit (compiling every probe's shape would cost minutes per point)
            best, probes = bisect_max_batch(trainer.fits, start=known or start_hint,
                                            limit=known or args.max_batch)
            point.max_batch, point.probes = best, probes
            if best == 0:
                point.skipped = "batch 1 does not fit"
            else:
                measure_point(trainer, point, args, eager_max, plain_max, points)
                start_hint = max(start_hint, plain_max.get((mode, ckpt), 0))
        except Exception as exc:  # a variant that breaks (compile error, OOM while timing) is reported, not fatal
            point.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        finally:
            if trainer is not None:
                trainer.close()
        print(row(point), flush=True)
        if points[-1] is not point:
            print(row(points[-1]), flush=True)
        write_json(args.json, header, points)
    return points


def equal_batch_comparison(points: list[Point]) -> list[dict]:
    """Liger vs plain at the same micro-batch and mode: peak memory cut and speed-up."""
    base = {(p.mode, p.checkpointing, p.batch): p for p in points if p.ok and p.liger == "plain"}
    out = []
    for p in points:
        b = base.get((p.mode, p.checkpointing, p.batch))
        if p.ok and p.liger != "plain" and b is not None:
            cut = (1 - p.peak_allocated_gb / b.peak_allocated_gb) if p.peak_allocated_gb and b.peak_allocated_gb else None
            out.append({"liger": p.liger, "mode": p.mode, "checkpointing": p.checkpointing, "batch": p.batch,
                        "memory_cut": cut, "speedup": p.tok_s / b.tok_s})
    return out


HEADER = (f"{'liger':<11} {'mode':<8} {'ckpt':<5} {'batch':>5} {'at':<6} {'max':>4} {'tok/s/GPU':>11} {'MFU':>6} "
          f"{'TFLOP/s':>8} {'alloc GB':>8} {'resv GB':>8}  note")


def row(p: Point) -> str:
    def num(v, fmt):
        return format(v, fmt) if v is not None else "n/a"
    head = f"{p.liger:<11} {p.mode:<8} {p.checkpointing!s:<5}"
    if not p.ok:
        return f"{head} {'':>5} {'':<6} {num(p.max_batch, 'd'):>4}  {p.skipped}"
    mfu = f"{100 * p.mfu:.1f}%" if p.mfu is not None else "n/a"
    note = f"probes {p.probes}" if p.role == "max" else "at plain's largest batch"
    return (f"{head} {p.batch:>5} {p.role:<6} {num(p.max_batch, 'd'):>4} {p.tok_s:>11,.0f} {mfu:>6} "
            f"{p.tflops:>8.1f} {num(p.peak_allocated_gb, '.1f'):>8} {num(p.peak_reserved_gb, '.1f'):>8}  {note}")


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny Llama on CPU (tests the script)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (2048; 64 with --tiny)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (5; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per point (2; 1 with --tiny)")
    ap.add_argument("--start-batch", type=int, default=None, help="first batch probed (8; 1 with --tiny)")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch probed (256; 4 with --tiny)")
    ap.add_argument("--modes", default=None, help="comma list of eager,compile (both; eager with --tiny)")
    ap.add_argument("--liger", default=",".join(LIGER_VARIANTS), help="comma list of plain,liger_all,liger_flce")
    ap.add_argument("--checkpointing", default="off,on", help="comma list of off,on (activation checkpointing)")
    ap.add_argument("--bisect-compiled", action="store_true",
                    help="bisect compiled points from scratch too (default: start at the eager largest batch)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no new point after this many seconds")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's peak bf16 TFLOP/s")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    args.seq = args.seq or (64 if args.tiny else 2048)
    args.steps = args.steps or (2 if args.tiny else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.start_batch = args.start_batch or (1 if args.tiny else 8)
    args.max_batch = args.max_batch or (4 if args.tiny else 256)
    args.modes = (args.modes or ("eager" if args.tiny else "eager,compile")).split(",")
    args.liger = args.liger.split(",")
    ckpt = args.checkpointing.split(",")
    args.checkpointing = tuple(c == "on" for c in ckpt)
    bad = [m for m in args.modes if m not in MODES] + [v for v in args.liger if v not in LIGER_VARIANTS] + \
        [c for c in ckpt if c not in ("off", "on")]
    if bad:
        ap.error(f"unknown mode or Liger variant {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    import torch
    from hardware import describe
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shape = model_shape(args.tiny)
    header = f"# gpu_cpt: {describe('transformers', 'liger-kernel')}; seq {args.seq}; " \
             f"{'tiny Llama' if args.tiny else 'Llama-3.2-1B shape'}; steps {args.steps} (+{args.warmup} warmup)"
    print(header)
    print(HEADER, flush=True)
    points = run_sweep(args, shape, cuda, header)
    comparison = equal_batch_comparison(points)
    for c in comparison:
        cut = f"{100 * c['memory_cut']:.0f}% lower peak memory" if c["memory_cut"] is not None else "memory n/a"
        print(f"# {c['liger']} vs plain, {c['mode']}, checkpointing {c['checkpointing']}, batch {c['batch']}: "
              f"{cut}, {c['speedup']:.2f}x tok/s")
    write_json(args.json, header, points)
    if _RUNTIME:
        from dilforge_cpt import runtime
        runtime.shutdown(_RUNTIME.pop())
    return 0 if any(p.ok for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
