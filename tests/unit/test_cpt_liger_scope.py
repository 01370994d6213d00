"""Liger runs where nothing has to be undone: `apply_liger_kernel_to_llama` rebinds names for the whole process,
so the stage applies it in its own process (every backend runs the stage as one) and never in a process that
builds a plain model afterwards. The real patch is checked in a child process, so this test process stays plain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import factories
import pytest
import torch
from factories import tiny_llama_config

TESTS = Path(__file__).resolve().parents[1]


def plain_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(128))


CHILD = """
import sys
import factories
from factories import tiny_llama_config
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama
from dilforge_cpt import sharding
from liger_probe import liger_parts

model = LlamaForCausalLM(tiny_llama_config(128))
assert liger_parts(model) == [], liger_parts(model)
kernels = sharding.patch_liger(model, dict.fromkeys(sharding.LIGER_KERNELS, True))
assert kernels == sorted(sharding.LIGER_KERNELS), kernels
parts = set(liger_parts(model))
# Liger binds forwards on the instance (class names stay LlamaRMSNorm/LlamaMLP) and the model's own forward
assert type(model.model.norm).__name__ == "LlamaRMSNorm"
assert {"<model>", "model.norm", "model.layers.0.mlp", "model.layers.1.input_layernorm"} <= parts, parts
assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")  # the process's, kept
print("ok")
"""


def test_real_liger_patch_binds_liger_code_to_the_model_in_its_own_process():
    pytest.importorskip("liger_kernel.transformers")  # imports on CPU; its kernels need CUDA to RUN
    import dilforge_cpt
    import dilforge_shared

    paths = [
        str(TESTS),
        str(TESTS.parent / "bench"),
        *(str(Path(m.__file__).resolve().parents[1]) for m in (dilforge_cpt, dilforge_shared)),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert sharding_parts_of_a_plain_model() == []  # this process was never patched


def sharding_parts_of_a_plain_model() -> list[str]:
    return factories.load_bench("liger_probe").liger_parts(plain_llama())


def test_patch_liger_passes_the_chosen_kernels_and_the_model():
    from dilforge_cpt import sharding

    calls = []
    model = plain_llama()
    kernels = {"rope": False, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True}
    applied = sharding.patch_liger(model, kernels, apply=lambda **kw: calls.append(kw))
    assert applied == ["fused_linear_cross_entropy", "rms_norm", "swiglu"]
    assert calls == [{"cross_entropy": False, "model": model, **kernels}]


def test_apply_liger_follows_the_policy(monkeypatch):
    from dilforge_cpt import sharding
    from dilforge_cpt.config import CptConfig
    from dilforge_cpt.runtime import Runtime

    config = CptConfig(scratch_model={}, corpora=[{"uri": "a"}], validation=[{"uri": "v"}], phase2={"num_steps": 1})
    calls = []
    monkeypatch.setattr(sharding, "patch_liger", lambda model, kernels: calls.append(kernels) or ["k"])
    model = plain_llama()
    assert sharding.apply_liger(model, config, Runtime()) == [] and calls == []  # CPU: the policy says no
    assert sharding.apply_liger(model, config, Runtime(device=torch.device("cuda", 0))) == ["k"]
    assert calls == [sharding.liger_kernels(config)]
