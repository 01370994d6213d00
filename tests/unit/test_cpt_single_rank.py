"""One-rank FSDP2 (one GPU) without FSDP's per-micro-batch overhead: weights are not resharded after
forward (no re-gather per micro-batch) and gradients are reduced only after the last micro-batch. On a
one-rank gloo group (CPU) the new step gives the same numbers as the old one (reshard after every
forward, gradient sync on every micro-batch)."""

from __future__ import annotations

import os

import pytest
import torch
from cpt_steps import train_step
from dilforge_shared.errors import ConfigError
from factories import tiny_llama_config

os.environ.setdefault("OMP_NUM_THREADS", "1")


def test_single_rank_keeps_weights_gathered_and_many_ranks_reshard():
    from dilforge_cpt.runtime import Runtime
    from dilforge_cpt.sharding import fsdp_options

    assert fsdp_options(Runtime(world=1, fsdp=True)) == {"reshard_after_forward": False}
    assert fsdp_options(Runtime(world=8, fsdp=True)) == {"reshard_after_forward": True}


def build(config, rt, reshard: bool | None):
    """The stage's model; `reshard` set = the old FSDP options (fully_shard's default: reshard after forward)."""
    from dilforge_cpt import optim, sharding
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(256))
    if reshard is not None:
        original = sharding.fsdp_options
        sharding.fsdp_options = lambda rt: {"reshard_after_forward": reshard}
        try:
            model = sharding.shard_model(model, config, rt)
        finally:
            sharding.fsdp_options = original
    else:
        model = sharding.shard_model(model, config, rt)
    trainable = optim.set_trainable(model, 2)
    return model, optim.make_optimizer(trainable, config, config.phase2)


def full(p):
    v = p.detach()
    return (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()


def test_one_rank_step_matches_the_old_fsdp_step(monkeypatch):
    from dilforge_cpt import runtime
    from dilforge_cpt.config import CptConfig

    config = CptConfig(
        scratch_model={},
        corpora=[{"uri": "a"}],
        validation=[{"uri": "v"}],
        seq_len=32,
        phase2={"num_steps": 2, "learning_rate": 1e-3},
        fsdp="on",
        global_batch_size=4,
        micro_batch_size=2,
    )
    rt = runtime.init_runtime(config)
    try:
        assert rt.fsdp and rt.world == 1
        gen = torch.Generator().manual_seed(1)
        batches = [[torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)] for _ in range(2)]

        new, new_opt = build(config, rt, None)
        initial = {n: full(p) for n, p in new.named_parameters()}
        syncs, reshards = [], []
        cls = type(new)
        real_sync, real_reshard = cls.set_requires_gradient_sync, cls.set_reshard_after_backward
        monkeypatch.setattr(
            cls, "set_requires_gradient_sync", lambda self, flag, **k: syncs.append(flag) or real_sync(self, flag, **k)
        )
        monkeypatch.setattr(
            cls,
            "set_reshard_after_backward",
            lambda self, flag, **k: reshards.append(flag) or real_reshard(self, flag, **k),
        )
        new_losses = [train_step(new, new_opt, b, rt, 1.0) for b in batches]
        assert syncs == [False, True, False, True]  # reduce once per step, after the last micro-batch
        assert reshards == [False, True, False, True]  # weights gathered once per step, freed after its last backward
        monkeypatch.undo()

        old, old_opt = build(config, rt, True)
        for name in ("set_requires_gradient_sync", "set_reshard_after_backward"):  # the old step: neither
            monkeypatch.setattr(type(old), name, lambda self, flag, **k: None)
        old_losses = [train_step(old, old_opt, b, rt, 1.0) for b in batches]
    finally:
        runtime.shutdown(rt)
    flat = [x for pair in new_losses for x in pair]  # (loss, grad norm) per step
    assert flat == pytest.approx([x for pair in old_losses for x in pair], rel=1e-5)
    for (name, a), (_, b) in zip(new.named_parameters(), old.named_parameters(), strict=True):
        torch.testing.assert_close(full(a), full(b), rtol=1e-5, atol=1e-6, msg=name)
    assert all(not torch.equal(initial[n], full(p)) for n, p in new.named_parameters())  # both steps trained


def test_auto_micro_batch_and_checkpointing_from_the_memory_estimate():
    """Llama-3.2-1B at seq 2048 with 140 GB free: 20.7 GiB of model state, 2.1 GiB of activations per
    sequence plus 2.4 GiB of logits without the fused loss: 19 sequences fit -> 16 of a 256-sequence batch;
    with FLCE (Liger on CUDA) 42 fit -> 32. CPU: at most 8. A set number is kept. Checkpointing auto turns on
    only where the micro-batch does not fit without it."""
    from dilforge_cpt.config import CptConfig
    from dilforge_cpt.runtime import Runtime
    from dilforge_cpt.sharding import resolve_memory
    from transformers import LlamaConfig

    shape = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )

    def cfg(**kw):
        return CptConfig(
            scratch_model={},
            corpora=[{"uri": "a"}],
            validation=[{"uri": "v"}],
            seq_len=2048,
            phase2={"num_steps": 1},
            global_batch_size=256,
            **kw,
        )

    gpu = Runtime(device=torch.device("cuda", 0), world=1, dtype=torch.bfloat16)
    plain, recompute, why = resolve_memory(cfg(liger="off"), gpu, shape, free_bytes=140e9)
    assert (plain, recompute) == (16, False) and "memory estimate" in why and "-> 19 fit" in why
    assert resolve_memory(cfg(liger="auto"), gpu, shape, free_bytes=140e9)[:2] == (32, False)
    assert resolve_memory(cfg(), Runtime(), shape)[:2] == (8, False)
    assert resolve_memory(cfg(micro_batch_size=4), gpu, shape)[:2] == (4, False)
    auto = {"liger": "off", "activation_checkpointing": "auto"}
    assert resolve_memory(cfg(**auto), gpu, shape, free_bytes=140e9)[:2] == (16, False)  # 19 fit without
    assert resolve_memory(cfg(**auto, micro_batch_size=32), gpu, shape, free_bytes=140e9)[:2] == (32, True)
    assert resolve_memory(cfg(**auto), gpu, shape, free_bytes=28e9)[:2] == (1, True)  # not one sequence without
    assert resolve_memory(cfg(**auto), Runtime(), shape)[:2] == (8, False)  # CPU: no estimate
    assert cfg().micro_batch_size == "auto"
    with pytest.raises(ConfigError, match=r"cpt.global_batch_size \(256\) must be a multiple of the processes \(3\)"):
        resolve_memory(cfg(), Runtime(world=3), shape)  # auto: refused before a per-process batch is worked out
