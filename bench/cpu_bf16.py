#!/usr/bin/env python
"""Bench: one CPT training step on CPU in fp32 against bf16 autocast, same model, batch and process.

What `cpt.precision: auto` chooses on a CPU with bf16 instructions (AVX512-BF16/AMX; dilforge_shared.runtime_policy)
against what it chooses elsewhere: forward + backward over `--micro-batches` micro-batches of `--batch` windows of
`--seq-len` tokens, then AdamW, as the stage steps (fp32 weights and optimizer state in both arms). The arms
alternate `--rounds` times; the figure is each arm's median step time and their ratio. It also prints both arms'
loss on the same batch before any step, so the arithmetic's effect on the loss is visible beside the speed.

  OMP_NUM_THREADS=2 python bench/cpu_bf16.py --model .dilforge/store/artifacts/cpt/<id>/data-<...>
"""

from __future__ import annotations

import argparse
import statistics
import time

import hardware  # bench/hardware.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", required=True, help="an HF model folder (safetensors), e.g. a CPT artifact's data folder"
    )
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="windows per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    from dilforge_shared.runtime_policy import cpu_computes_bf16
    from transformers import AutoModelForCausalLM

    print(hardware.describe("transformers"))
    print(f"bf16 instructions (runtime_policy.cpu_computes_bf16): {cpu_computes_bf16()}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, trust_remote_code=False)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len)) for _ in range(args.micro_batches)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def loss_of(batch, bf16: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=batch, labels=batch).loss

    with torch.no_grad():
        first = {arm: float(loss_of(batches[0], arm == "bf16")) for arm in ("fp32", "bf16")}

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        for batch in batches:
            loss_of(batch, bf16).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(False)  # warm-up: allocator, optimizer state
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(args.rounds):
        for arm in ("fp32", "bf16"):
            times[arm].append(step(arm == "bf16"))
    tokens = args.batch * args.micro_batches * args.seq_len
    print(
        f"\none step = {args.micro_batches} x {args.batch} x {args.seq_len} = {tokens} tokens, {args.rounds} rounds\n"
    )
    print("| arm | median step (s) | tokens/s | loss on the first batch |")
    print("|---|---:|---:|---:|")
    for arm, ts in times.items():
        med = statistics.median(ts)
        print(f"| {arm} | {med:.2f} | {tokens / med:.0f} | {first[arm]:.4f} |")
    ratio = statistics.median(times["fp32"]) / statistics.median(times["bf16"])
    print(f"\nbf16 autocast / fp32 speed: {ratio:.2f}x; loss difference {first['bf16'] - first['fp32']:+.4f}")


if __name__ == "__main__":
    main()
