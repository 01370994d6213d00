#!/usr/bin/env python
"""The device's own ceilings, measured in the same run as the CPT step they bound.

- environment: device, driver, compute capability, SMs, memory; torch, CUDA, cuDNN, NCCL versions; the
  SDPA backends this build can run (and whether flex attention imports);
- bf16 matmul TFLOP/s at 8192³ and at the Llama-3.2-1B GEMM shapes of one micro-batch (q, k/v, o,
  gate/up, down, LM head; M = batch × seq tokens), on random data (zeros run faster and lie);
- HBM copy GB/s (bytes read + written of a device-to-device copy);
- attention forward + backward TFLOP/s per SDPA backend (FlashAttention-2 path, cuDNN, memory-
  efficient) on the call the model makes: transformers' SDPA path passes 32 query and 8 key/value heads
  with `enable_gqa=True` and `is_causal=True` (no mask tensor), so that is what is timed; the kernels that
  actually ran are read from a profile of one call and recorded beside each number. Counted as causal
  model FLOPs (forward 2·B·H·S²·D, backward 2× forward: no recomputation charged). Flex attention
  (compiled, 30-60 s, not what CPT runs) only with `--flex`.

Each timing: CUDA events, warm-up first, the median of several repetitions. `--tiny` runs every code path
on CPU with small sizes (the numbers are then meaningless: it checks the script).

  python bench/gpu_ceilings.py --json ceilings.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Llama-3.2-1B: hidden 2048, intermediate 8192, 32 query heads, 8 KV heads, head_dim 64, vocab 128256.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 32, 8, 64, 128256


def model_gemms(tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of the forward GEMMs of one micro-batch of `tokens` tokens."""
    kv = KV_HEADS * HEAD_DIM
    return {
        "q/o_proj": (tokens, HIDDEN, HIDDEN),
        "k/v_proj": (tokens, kv, HIDDEN),
        "gate/up_proj": (tokens, INTER, HIDDEN),
        "down_proj": (tokens, HIDDEN, INTER),
        "lm_head": (tokens, VOCAB, HIDDEN),
    }


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() (CUDA events on a GPU, the host clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    out = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def device_and_dtype():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def matmul_tflops(m: int, n: int, k: int, reps: int = 10) -> float:
    import torch

    device, dtype = device_and_dtype()
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, reps)
    return 2.0 * m * n * k / seconds / 1e12


def copy_gbps(num_bytes: int, reps: int = 10) -> float:
    import torch

    device, _ = device_and_dtype()
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), reps)
    return 2.0 * src.numel() * 4 / seconds / 1e9


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Causal forward + backward model FLOPs: forward 2·B·H·S²·D (QKᵀ and AV, half of the S² scores),
    backward twice the forward."""
    return 3.0 * 2.0 * batch * heads * seq * seq * head_dim


ATTENTION_KERNEL_KEYS = ("flash", "fmha", "cudnn", "efficient", "attention", "sdpa", "softmax", "flex", "triton")


def attention_tflops(backend: str, batch: int, seq: int, reps: int = 5) -> tuple[float | str, list[str]]:
    """fwd+bwd TFLOP/s of one SDPA backend (or 'FLEX') on the model's GQA call, and the attention kernels
    a profile of one call saw run; a string instead of the number says why not."""
    import torch
    import torch.nn.functional as F

    device, dtype = device_and_dtype()
    q = torch.randn((batch, HEADS, seq, HEAD_DIM), device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn((batch, KV_HEADS, seq, HEAD_DIM), device=device, dtype=dtype, requires_grad=True) for _ in "kv")
    grad = torch.randn(q.shape, device=device, dtype=dtype)
    if backend == "FLEX":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            return f"flex attention not importable: {exc}", []
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device=str(device))
        attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

        def step():  # gradients returned, not accumulated into .grad: every repetition does the same work
            torch.autograd.grad(attend(q, k, v, block_mask=mask, enable_gqa=True), (q, k, v), grad)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def step():
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                torch.autograd.grad(out, (q, k, v), grad)

    try:
        seconds = timed(step, reps, warmup=2)
        ran = kernels_that_ran(step)
    except Exception as exc:  # noqa: BLE001 - a backend this build or shape cannot run says so
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}", []
    return attention_flops(batch, HEADS, seq, HEAD_DIM) / seconds / 1e12, ran


def kernels_that_ran(step) -> list[str]:
    """The attention kernels (device kernels on a GPU, aten ops on CPU) a profile of one step saw."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    attr = "device_time_total" if cuda else "self_cpu_time_total"
    names = {e.key for e in prof.key_averages() if (getattr(e, attr, 0) or 0) > 0}
    return sorted(n[:120] for n in names if any(key in n.lower() for key in ATTENTION_KERNEL_KEYS))


def environment() -> dict:
    import torch

    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001 - NCCL missing from the build
        env["nccl"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            env["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["nvidia_smi"] = f"unavailable: {exc}"
    else:
        env["device"] = "cpu"
    flags = torch.backends.cuda
    sdpa = {
        "FLASH_ATTENTION": flags.flash_sdp_enabled,
        "CUDNN_ATTENTION": getattr(flags, "cudnn_sdp_enabled", lambda: False),
        "EFFICIENT_ATTENTION": flags.mem_efficient_sdp_enabled,
        "MATH": flags.math_sdp_enabled,
    }
    env["sdpa_backends_available"] = [n for n, on in sdpa.items() if on()] if torch.cuda.is_available() else ["MATH"]
    try:
        import torch.nn.attention.flex_attention

        env["flex_attention"] = True
    except ImportError:
        env["flex_attention"] = False
    from importlib.metadata import PackageNotFoundError, version

    for name in (
        "transformers",
        "accelerate",
        "peft",
        "trl",
        "datasets",
        "liger-kernel",
        "triton",
        "numpy",
        "tokenizers",
        "pydantic",
        "pydantic-settings",
    ):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = None
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, small sizes: checks the script")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch for the model's shapes (16; 1 tiny)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (2048; 128 tiny)")
    ap.add_argument("--json", default=None, help="write everything here")
    ap.add_argument("--flex", action="store_true", help="also flex attention (compiled: ~30-60 s; CPT does not use it)")
    ap.add_argument(
        "--attention-only", action="store_true", help="only the attention timings (with --flex: the second call)"
    )
    ap.add_argument("--env-only", action="store_true", help="only the environment (the device script's first phase)")
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batch, seq = args.batch or (1 if args.tiny else 16), args.seq or (128 if args.tiny else 2048)
    out: dict = {"environment": environment()}
    print(json.dumps(out["environment"]), flush=True)
    if args.env_only:
        if args.json:
            Path(args.json).write_text(json.dumps(out["environment"], indent=1))
        return 0

    def save():  # after every measurement: a phase stopped at its time limit still leaves what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))

    def show(kind: str, name: str, value) -> None:
        shown = f"skipped: {value}" if isinstance(value, str) else f"{value:,.1f} TFLOP/s"
        print(f"{kind:<10} {name:<34} {shown}", flush=True)
        save()

    if not args.attention_only:
        square = 256 if args.tiny else 8192
        out["matmul_tflops"] = {}
        out["matmul_tflops"][f"{square}^3"] = matmul_tflops(square, square, square)
        show("matmul", f"{square}^3", out["matmul_tflops"][f"{square}^3"])
        tokens = batch * seq
        for name, (m, n, k) in model_gemms(tokens if not args.tiny else 64).items():
            if args.tiny:
                n, k = min(n, 256), min(k, 256)
            out["matmul_tflops"][f"{name} {m}x{n}x{k}"] = value = matmul_tflops(m, n, k)
            show("matmul", f"{name} {m}x{n}x{k}", value)
        out["hbm_copy_gbps"] = copy_gbps(2**24 if args.tiny else 2**32)
        print(f"hbm copy   {out['hbm_copy_gbps']:,.0f} GB/s (read + write)", flush=True)
    backends = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"] if torch.cuda.is_available() else ["MATH"]
    if args.flex:
        backends.append("FLEX")  # last: its compile is the slowest measurement here
    attn_batch = max(1, batch // 2)
    dtype = str(device_and_dtype()[1]).removeprefix("torch.")
    out["attention_shape"] = f"B{attn_batch} Hq{HEADS} Hkv{KV_HEADS} S{seq} D{HEAD_DIM} causal enable_gqa {dtype}"
    out["attention_tflops"], out["attention_kernels"] = {}, {}
    for backend in backends:
        value, ran = attention_tflops(backend, attn_batch, seq)
        out["attention_tflops"][backend], out["attention_kernels"][backend] = value, ran
        show("attention", backend, value)
        print(f"{'':<10} {'kernels that ran':<34} {', '.join(ran) or 'none seen'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
