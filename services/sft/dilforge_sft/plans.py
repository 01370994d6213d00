"""What the SFT run uses, decided before the model loads: device and precision (the shared runtime policy),
the attention kernel, and whether activation checkpointing is worth its 25-30 % (a memory estimate)."""

from __future__ import annotations

from dataclasses import dataclass

from dilforge_shared import runtime_policy
from dilforge_shared.runtime_policy import DeviceFacts

from .config import SftConfig


@dataclass(frozen=True)
class DevicePlan:
    device: str
    bf16: bool
    liger: bool


def device_plan(config: SftConfig, model_type: str | None = None, facts: DeviceFacts | None = None) -> DevicePlan:
    """bf16 + Liger on CUDA, fp32 without Liger on CPU, unless the config says otherwise: the shared
    policy (dilforge_shared.runtime_policy) decides; SFT does not train in bf16 on CPU."""
    policy = runtime_policy.decide(
        "sft", precision=config.precision, liger=config.liger, model_type=model_type, cpu_bf16=False, facts=facts
    )
    return DevicePlan(device=policy.device, bf16=policy.bf16, liger=policy.liger)


@dataclass(frozen=True)
class AttentionPlan:
    implementation: str  # transformers' attn_implementation
    reason: str  # logged and published: why this kernel


def attention_plan(config: SftConfig, device: str, has_flash_attn: bool | None = None) -> AttentionPlan:
    """Which attention kernel trains this config, and why: the shared policy's rule
    (runtime_policy.choose_attention; packing on CUDA wants a varlen or flex kernel)."""
    facts = DeviceFacts(
        cuda=device == "cuda",
        flash_attn=runtime_policy.probe_device().flash_attn if has_flash_attn is None else has_flash_attn,
    )
    implementation, reason = runtime_policy.choose_attention(
        config.attention, device, facts, config.packing, "sft.attention"
    )
    return AttentionPlan(implementation, reason)


def device_memory_bytes(device: str) -> int:
    """Total memory of the training device: the GPU's, or the host's RAM on CPU."""
    import os

    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpointing_decision(config: SftConfig, model_config, plan: DevicePlan, memory: int) -> tuple[bool, str]:
    """(use activation checkpointing?, why): auto turns it on only when the memory estimate of LoRA training
    without it (`runtime_policy.training_bytes`) exceeds the budget."""
    if config.activation_checkpointing != "auto":
        return config.activation_checkpointing == "on", "set by sft.activation_checkpointing"
    tokens = config.micro_batch_size * config.max_length
    estimate = sum(
        runtime_policy.training_bytes(model_config, tokens, full=False, bf16=plan.bf16, fused_loss=plan.liger)
    )
    budget = int(memory * config.memory_budget_fraction)
    gib = 2**30
    if estimate > budget:
        return True, f"estimated {estimate / gib:.1f} GiB > budget {budget / gib:.1f} GiB: recompute activations"
    return False, f"estimated {estimate / gib:.1f} GiB <= budget {budget / gib:.1f} GiB: no recomputation"
