"""How the model is laid out for training and gathered back for publishing: Liger kernels,
activation checkpointing, per-layer torch.compile, FSDP2, and the full-state-dict HF save."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from dilforge_shared import runtime_policy
from dilforge_shared.errors import ConfigError
from dilforge_shared.training import training_bytes

from .config import CptConfig
from .runtime import Runtime

log = logging.getLogger("dilforge.cpt")

COMPILE_BACKEND = "inductor"  # for the decoder layers; the CPU test swaps in aot_eager


LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")


def liger_kernels(config: CptConfig) -> dict[str, bool]:
    """Which Liger kernels to apply: all four eagerly; with `compile` only the fused linear cross entropy (outside
    the compiled layers): Liger's RoPE breaks the graph and Inductor fuses RMSNorm/SwiGLU itself."""
    keep = ("fused_linear_cross_entropy",) if config.compile else LIGER_KERNELS
    return {name: name in keep for name in LIGER_KERNELS}


def patch_liger(model, kernels: dict[str, bool], apply=None) -> list[str]:
    """Apply the chosen Liger kernels to `model` (default `apply_liger_kernel_to_llama`); returns their names.
    Liger rebinds Llama's modules for the whole process, so each run has its own process."""
    if apply is None:
        from liger_kernel.transformers import apply_liger_kernel_to_llama as apply
    apply(cross_entropy=False, model=model, **kernels)
    return sorted(name for name, on in kernels.items() if on)


def apply_liger(model, config: CptConfig, rt: Runtime) -> list[str]:
    """Liger kernels where the shared policy says they apply (CUDA + llama + cpt.liger); the kernels applied."""
    model_type = model.config.model_type
    if not runtime_policy.choose_liger(config.liger, rt.device.type, model_type, "cpt.liger"):
        if config.liger != "off" and rt.cuda:
            log.warning("liger: no kernels for model_type %s", model_type)
        return []
    return patch_liger(model, liger_kernels(config))


CPU_MAX_MICRO_BATCH = 8  # CPU memory is not the limit; past a few sequences a bigger batch buys no speed


def resolve_memory(
    config: CptConfig, rt: Runtime, model_config, free_bytes: float | None = None
) -> tuple[int, bool, str]:
    """(micro_batch_size, activation checkpointing, why) from the settings, `auto` from the memory estimate
    (`training.training_bytes`) on CUDA: checkpointing only when the micro-batch does not fit without it,
    the micro-batch the largest divisor of the per-process batch that fits. CPU: no estimate, auto is off."""
    micro, checkpointing = config.micro_batch_size, config.activation_checkpointing
    if micro == "auto" and config.global_batch_size % rt.world:
        raise ConfigError(
            f"cpt.global_batch_size ({config.global_batch_size}) must be a multiple of the processes ({rt.world})"
        )
    per_rank = config.global_batch_size // rt.world
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    if "auto" not in (micro, checkpointing) or not rt.cuda:
        if micro != "auto":
            return micro, checkpointing == "on", "set by cpt.micro_batch_size"
        best = max(d for d in divisors if d <= CPU_MAX_MICRO_BATCH)
        why = f"auto on CPU: the largest divisor of {per_rank} sequences per process up to {CPU_MAX_MICRO_BATCH}"
        return best, checkpointing == "on", why
    if free_bytes is None:
        free_bytes = float(torch.cuda.mem_get_info(rt.device)[0])
    fused = (
        runtime_policy.choose_liger(config.liger, rt.device.type, model_config.model_type)
        and liger_kernels(config)["fused_linear_cross_entropy"]
    )
    bf16 = rt.dtype == torch.bfloat16

    def fits(on: bool) -> tuple[int, float, float]:  # with activation checkpointing `on`
        state, per_seq = training_bytes(
            model_config, config.seq_len, full=True, bf16=bf16, world=rt.world, checkpointing=on, fused_loss=fused
        )
        return max(int((0.85 * free_bytes - state) // per_seq), 0), state, per_seq

    recompute = checkpointing == "on" or (
        checkpointing == "auto" and fits(False)[0] < (1 if micro == "auto" else micro)
    )
    count, state, per_seq = fits(recompute)
    best = micro if micro != "auto" else max([d for d in divisors if d <= count], default=1)
    why = (
        f"from the memory estimate: {free_bytes / 2**30:.0f} GiB free, {state / 2**30:.1f} GiB model state, "
        f"{per_seq / 2**30:.2f} GiB per sequence {'with' if recompute else 'without'} activation checkpointing "
        f"-> {count} fit; micro-batch {best} of {per_rank} sequences per process"
    )
    return best, recompute, why


def fsdp_options(rt: Runtime) -> dict:
    """fully_shard options: one rank keeps the unsharded weights after forward (nothing to save by freeing them,
    a cast + copy per micro-batch saved); several ranks free them (FSDP's memory saving)."""
    return {"reshard_after_forward": rt.world > 1}


def shard_model(model, config: CptConfig, rt: Runtime):
    """Activation checkpointing → torch.compile per layer → FSDP2 (per layer, then root) when rt.fsdp."""
    model.config.use_cache = False
    if config.activation_checkpointing == "on":  # auto is resolved before (resolve_memory)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.model.layers
    if config.compile:
        for layer in layers:
            layer.compile(backend=COMPILE_BACKEND)
    model.to(rt.device)
    if rt.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32)  # fp32 weights: no cast
        options = fsdp_options(rt)
        for layer in layers:
            fully_shard(layer, mp_policy=mp, **options)
        fully_shard(model, mp_policy=mp, **options)
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
