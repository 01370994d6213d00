"""Eval on CUDA: bits per byte agrees with the CPU's, greedy generation runs on the GPU."""

from __future__ import annotations

import pytest
from gpu_helpers import synthetic_lines


def test_bpb_on_cuda_matches_cpu_and_generation_runs(chatml_llama_dir):
    import torch
    from dilforge_eval.generate import Prompt, generate
    from dilforge_eval.measures import bits_per_byte
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chatml_llama_dir), trust_remote_code=False)
    docs = synthetic_lines(60, seed=7)
    cpu = AutoModelForCausalLM.from_pretrained(
        str(chatml_llama_dir), dtype=torch.float32, trust_remote_code=False
    ).eval()
    ref = bits_per_byte(cpu, tok, docs, window=256, stride=128).bpb
    fp32 = bits_per_byte(cpu.cuda(), tok, docs, window=256, stride=128).bpb
    assert fp32 == pytest.approx(ref, rel=1e-4)
    bf16 = bits_per_byte(cpu.to(torch.bfloat16), tok, docs, window=256, stride=128).bpb
    assert bf16 == pytest.approx(ref, rel=2e-2)
    (row,) = generate(cpu, tok, [Prompt(id="p", kind="completion", prompt="Bakı")], "greedy", 8, 1.0, 1.0, 1.0, 0)
    assert row["num_new_tokens"] > 0
