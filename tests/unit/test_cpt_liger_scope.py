"""Liger kernels apply to one model instance: what `apply_liger_kernel_to_llama` rebinds for the whole
process (LlamaRMSNorm, LlamaMLP, apply_rotary_pos_emb, LlamaForCausalLM.forward) is undone, so a plain
model built after a Liger one runs no Liger code (Triton kernels refuse CPU tensors: the eval GPU test's
CPU reference and every bench point after a Liger one used to be Liger models)."""

from __future__ import annotations

import types

import pytest
import torch
from factories import tiny_llama_config


def plain_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(128))


ALL = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True}


def _fake_rope(q, k, cos, sin, unsqueeze_dim=1):
    return q, k


def _fake_forward(self, *args, **kwargs):
    return type(self).forward(self, *args, **kwargs)


class _FakeLigerRMSNorm:
    pass


for _fake in (_fake_rope, _fake_forward, _FakeLigerRMSNorm):
    _fake.__module__ = "liger_kernel.fake"  # what liger_parts recognises Liger code by


def fake_liger_apply(calls):
    """A stand-in for apply_liger_kernel_to_llama that rebinds what the real one rebinds (process-wide
    names AND the instance's module forwards), from a module named like Liger's."""
    from transformers.models.llama import modeling_llama

    fake = types.SimpleNamespace(rope=_fake_rope, forward=_fake_forward, LigerRMSNorm=_FakeLigerRMSNorm)

    def apply(rope, cross_entropy, fused_linear_cross_entropy, rms_norm, swiglu, model):
        calls.append(model)
        modeling_llama.apply_rotary_pos_emb = fake.rope
        modeling_llama.LlamaRMSNorm = fake.LigerRMSNorm
        modeling_llama.LlamaMLP = fake.LigerRMSNorm
        modeling_llama.LlamaForCausalLM.forward = fake.forward
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(fake.forward, layer.mlp)

    return apply


def test_fake_patch_touches_one_instance_and_undo_restores_the_process():
    from dilforge_cpt import sharding
    from transformers.models.llama import modeling_llama

    originals = (
        modeling_llama.apply_rotary_pos_emb,
        modeling_llama.LlamaRMSNorm,
        modeling_llama.LlamaMLP,
        modeling_llama.LlamaForCausalLM.__dict__["forward"],
    )
    calls = []
    liger_model = plain_llama()
    patch = sharding.patch_liger(liger_model, ALL, apply=fake_liger_apply(calls))
    assert calls == [liger_model] and patch.kernels == sorted(ALL)
    # class rebinds undone at once; the instance keeps its Liger forwards; RoPE stays until undo()
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == originals[1:3]
    assert modeling_llama.LlamaForCausalLM.__dict__["forward"] is originals[3]
    assert "model.layers.0.mlp" in sharding.liger_parts(liger_model)
    assert "modeling_llama.apply_rotary_pos_emb" in sharding.liger_parts(plain_llama())
    patch.undo()
    assert modeling_llama.apply_rotary_pos_emb is originals[0]
    assert sharding.liger_parts(plain_llama()) == []


def test_real_liger_patch_then_a_plain_model_has_no_liger_modules():
    pytest.importorskip("liger_kernel.transformers")  # imports on CPU; its kernels need CUDA to RUN
    from dilforge_cpt import sharding
    from transformers.models.llama import modeling_llama

    originals = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    liger_model = plain_llama()
    patch = sharding.patch_liger(liger_model, ALL)
    try:
        parts = sharding.liger_parts(liger_model)
        # Liger binds forwards on the instance: class names stay LlamaRMSNorm/LlamaMLP, the forwards are Liger's
        assert type(liger_model.model.norm).__name__ == "LlamaRMSNorm"
        assert {"<model>", "model.norm", "model.layers.0.mlp", "model.layers.1.input_layernorm"} <= set(parts)
        assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == originals[1:]
    finally:
        patch.undo()
    after = plain_llama()
    assert sharding.liger_parts(after) == []
    assert modeling_llama.apply_rotary_pos_emb is originals[0]
    ids = torch.randint(0, 128, (1, 8))
    assert after(input_ids=ids, labels=ids).logits.shape == (1, 8, 128)  # runs on CPU: no Triton kernel left


def test_apply_liger_off_the_policy_is_an_empty_patch():
    from dilforge_cpt import sharding
    from dilforge_cpt.runtime import Runtime
    from dilforge_shared.configs.cpt import CptConfig

    config = CptConfig(scratch_model={}, corpora=[{"uri": "a"}], validation=[{"uri": "v"}], phase2={"num_steps": 1})
    patch = sharding.apply_liger(plain_llama(), config, Runtime())  # CPU: the policy says no
    assert patch.kernels == []
    patch.undo()
