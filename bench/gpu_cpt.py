#!/usr/bin/env python
"""CPT training throughput on one GPU: Llama-3.2-1B architecture, random init, seq 2048, bf16.

Self-contained (torch, transformers, liger-kernel only). For each of {without Liger, with Liger}
it sweeps the micro-batch up to the largest that fits and prints tok/s per GPU, MFU and peak
memory. The training step matches the CPT stage on one GPU: fp32 master weights, bf16 autocast,
AdamW (fused), grad clipping at 1.0, HF loss (labels = inputs), optional activation checkpointing.

MFU = tok/s × (6·N + 12·L·d·T) / peak, N = parameters counted once (tied embeddings), PaLM appendix B.
Goal on H200 (989 TFLOP/s bf16 dense): ≥ 80,000 tok/s at ≥ 65 % MFU; Liger lowers peak memory by
≥ 50 % at equal batch and raises throughput.

  python bench/gpu_cpt.py                 # H200: full sweep (a few minutes)
  python bench/gpu_cpt.py --tiny          # CPU smoke test of the whole script (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time

import torch

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "B200": 2250.0}


def model_config(tiny: bool):
    from transformers import LlamaConfig
    if tiny:
        return LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           rope_theta=500000.0, max_position_embeddings=4096)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                       rope_theta=500000.0, max_position_embeddings=131072, head_dim=64,
                       attn_implementation="sdpa")


def flops_per_token(cfg, num_params: int, seq: int) -> float:
    return 6.0 * num_params + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def build(cfg, liger: bool, device: torch.device, checkpointing: bool, compile_layers: bool):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with device:  # initialise on the GPU: a 1.2 B-parameter init on CPU takes longer than the measurement
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    kernels = []
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False, model=model)
        kernels = ["rope", "rms_norm", "swiglu", "fused_linear_cross_entropy"]
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    model.to(device).train()
    return model, kernels


def measure(cfg, liger: bool, batch: int, seq: int, steps: int, warmup: int, device, dtype, peak, checkpointing,
            compile_layers) -> dict:
    model, kernels = build(cfg, liger, device, checkpointing, compile_layers)
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else torch.autocast(device.type, enabled=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(warmup):
            step()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        sync(device)
        elapsed = time.perf_counter() - t0
        tps = batch * seq * steps / elapsed
        fpt = flops_per_token(cfg, num_params, seq)
        return {"liger": liger, "kernels": kernels, "batch": batch, "ok": True, "tok_s": tps,
                "mfu": tps * fpt / peak if peak else None, "peak_mem_gb": peak_mem(device),
                "loss": float(loss.detach()), "params": num_params}
    except torch.OutOfMemoryError:
        return {"liger": liger, "batch": batch, "ok": False}
    finally:
        model = opt = x = None  # free before the next point
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mem(device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (tests the script)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (2048; 128 with --tiny)")
    ap.add_argument("--batches", default=None, help="comma-separated micro-batches to sweep (default 1,2,4,...,64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (10; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per point (3; 1 with --tiny)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile every decoder layer")
    ap.add_argument("--no-liger", action="store_true", help="skip the Liger sweep")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    seq = args.seq or (128 if args.tiny else 2048)
    steps = args.steps or (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1, 2] if args.tiny else [1, 2, 4, 8, 16, 32, 64])
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    peak = next((v * 1e12 for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None) if cuda else None
    print(f"# gpu_cpt  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# device {name}; torch {torch.__version__}; cuda {torch.version.cuda}; python {platform.python_version()}; "
          f"cpus {os.cpu_count()}; peak {peak / 1e12 if peak else 'n/a'} TFLOP/s; dtype {str(dtype)[6:]}; seq {seq}")
    cfg = model_config(args.tiny)
    variants = [False] + ([True] if cuda and not args.no_liger else [])
    if not cuda:
        print("# liger: skipped (needs CUDA/Triton)")
    results = []
    print(f"{'liger':>5} {'batch':>5} {'tok/s/GPU':>12} {'MFU':>7} {'peak GB':>8} {'loss':>8}")
    for liger in variants:
        for batch in batches:
            r = measure(cfg, liger, batch, seq, steps, warmup, device, dtype, peak, args.activation_checkpointing,
                        args.compile)
            results.append(r)
            if not r["ok"]:
                print(f"{liger!s:>5} {batch:>5} {'OOM':>12}")
                break
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            mem = f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] is not None else "n/a"
            print(f"{liger!s:>5} {batch:>5} {r['tok_s']:>12,.0f} {mfu:>7} {mem:>8} {r['loss']:>8.3f}", flush=True)
    summarize(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def summarize(results: list[dict]) -> None:
    ok = [r for r in results if r["ok"]]
    for liger in (False, True):
        rows = [r for r in ok if r["liger"] == liger]
        if rows:
            best = max(rows, key=lambda r: r["tok_s"])
            mfu = f"{100 * best['mfu']:.1f}%" if best["mfu"] is not None else "n/a"
            print(f"# best {'with' if liger else 'without'} liger: batch {best['batch']}, {best['tok_s']:,.0f} tok/s/GPU, "
                  f"MFU {mfu}, largest batch that fits {max(r['batch'] for r in rows)}")
    base = {r["batch"]: r for r in ok if not r["liger"]}
    for r in ok:
        if r["liger"] and r["batch"] in base and r["peak_mem_gb"]:
            b = base[r["batch"]]
            print(f"# batch {r['batch']}: liger peak memory {r['peak_mem_gb']:.1f} vs {b['peak_mem_gb']:.1f} GB "
                  f"({100 * (1 - r['peak_mem_gb'] / b['peak_mem_gb']):.0f}% lower), throughput "
                  f"{r['tok_s'] / b['tok_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
