"""How the model is laid out for training and gathered back for publishing: Liger kernels,
activation checkpointing, per-layer torch.compile, FSDP2, and the full-state-dict HF save."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from dilforge_shared import runtime_policy
from dilforge_shared.configs.cpt import CptConfig

from .runtime import Runtime

log = logging.getLogger("dilforge.cpt")

# torch.compile backend for the decoder layers (the CPU test swaps in aot_eager: graph capture and graph
# breaks do not depend on the backend, Inductor's C++ build on two cores does take minutes).
COMPILE_BACKEND = "inductor"


LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")


def liger_kernels(config: CptConfig) -> dict[str, bool]:
    """Which Liger kernels to apply. Eager: all four. With `compile`: only the fused linear cross
    entropy, which lives in the LM head's loss, outside the compiled decoder layers. Liger's RoPE
    dispatch is `torch.compiler.disable`d (one graph break per layer; with activation checkpointing
    no graph was captured at all), and its RMSNorm/SwiGLU Triton kernels are opaque to Inductor,
    which fuses those element-wise ops itself."""
    keep = ("fused_linear_cross_entropy",) if config.compile else LIGER_KERNELS
    return {name: name in keep for name in LIGER_KERNELS}


def apply_liger(model, config: CptConfig, rt: Runtime) -> list[str]:
    """Liger kernels where the shared policy says they apply (CUDA + llama + cpt.liger); returns the
    kernels applied, for the log and manifest."""
    model_type = model.config.model_type
    if not runtime_policy.choose_liger(config.liger, rt.device.type, model_type, "cpt.liger"):
        if config.liger != "off" and rt.cuda:
            log.warning("liger: no kernels for model_type %s", model_type)
        return []
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    kernels = liger_kernels(config)
    apply_liger_kernel_to_llama(cross_entropy=False, model=model, **kernels)
    return sorted(name for name, on in kernels.items() if on)


def shard_model(model, config: CptConfig, rt: Runtime):
    """Activation checkpointing → torch.compile per layer → FSDP2 (per layer, then root) when rt.fsdp."""
    model.config.use_cache = False
    if config.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.model.layers
    if config.compile:
        for layer in layers:
            layer.compile(backend=COMPILE_BACKEND)
    model.to(rt.device)
    if rt.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if rt.dtype == torch.bfloat16 else MixedPrecisionPolicy()
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    model.train()
    return model


def save_hf_model(model, out_dir: Path, save_dtype: torch.dtype, rt: Runtime) -> None:
    """Gather the full state dict (collective) and save a plain HF model from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not rt.is_main:
        return
    cfg = model.config
    cfg.use_cache = True
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(full, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch saving the model: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        fresh.tie_weights()
    fresh.to(save_dtype)
    fresh.save_pretrained(str(out_dir), safe_serialization=True)
