"""Training knobs CPT and SFT share, as groups their configs inherit fields from (the YAML stays flat): one name,
one meaning, one description per idea. `training_bytes` is the memory estimate the `auto` micro-batch and
activation checkpointing come from."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from . import MAX_BATCH, MAX_STEPS, RUN_ONLY, StrictModel, Switch


class Batching(StrictModel):
    """How many sequences make an optimizer step and a forward pass (gradient accumulation is derived)."""

    global_batch_size: int = Field(
        le=MAX_BATCH,
        default=8,
        ge=1,
        description="Sequences per optimizer step across all processes (= micro_batch_size × processes × "
        "gradient accumulation steps, which is derived; must divide evenly).",
    )
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | Literal["auto"] = Field(
        json_schema_extra=RUN_ONLY,
        default="auto",
        description="Sequences per forward pass per process (memory, not results). auto (CPT only) = the largest "
        "divisor of global_batch_size / processes that the memory estimate says fits (CPU: at most 8), logged.",
    )
    eval_micro_batch_size: int | None = Field(
        le=MAX_BATCH,
        json_schema_extra=RUN_ONLY,
        default=None,
        ge=1,
        description="Sequences per validation forward pass per process; None = micro_batch_size.",
    )

    def grad_accum_steps(self, num_processes: int, where: str) -> int:
        """Forward passes per optimizer step per process; ValueError naming the fields when it does not divide."""
        if self.micro_batch_size == "auto":
            raise ValueError(f"{where}micro_batch_size is auto: resolve it before deriving gradient accumulation")
        per_step = self.micro_batch_size * num_processes
        if self.global_batch_size % per_step:
            raise ValueError(
                f"{where}global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"{where}micro_batch_size ({self.micro_batch_size}) × processes ({num_processes})"
            )
        return self.global_batch_size // per_step


class Warmup(StrictModel):
    """Linear warmup from 0 to the peak learning rate: a count of steps, or a share of the steps."""

    num_warmup_steps: int | None = Field(
        le=MAX_STEPS, default=None, ge=0, description="Warmup optimizer steps; None = warmup_ratio (or no warmup)."
    )
    warmup_ratio: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Warmup as a share of the optimizer steps (rounded up); used only when num_warmup_steps is None.",
    )

    def warmup_steps(self, num_steps: int) -> int:
        """The warmup length in optimizer steps for a run of num_steps."""
        if self.num_warmup_steps is not None:
            return self.num_warmup_steps
        return math.ceil(self.warmup_ratio * num_steps) if self.warmup_ratio else 0


class Checkpointing(StrictModel):
    """Resumable checkpoints (cadence, retention) and activation recomputation."""

    checkpoint_every: int = Field(
        json_schema_extra=RUN_ONLY,
        default=200,
        ge=1,
        description="Write a resumable checkpoint every this many optimizer steps (and on SIGTERM).",
    )
    num_checkpoints_kept: int = Field(
        le=100, json_schema_extra=RUN_ONLY, default=2, ge=1, description="Newest complete checkpoints kept on disk."
    )
    activation_checkpointing: Switch = Field(
        json_schema_extra=RUN_ONLY,
        default="off",
        description="Recompute layer activations in backward to save memory at the cost of speed. auto: on where the "
        "memory estimate says training does not fit without it (off on CPU). YAML true/false mean on/off.",
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _bool_is_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads `on`/`off`/`true`/`false` as booleans; a bool switch means on/off."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class SourceLimits(StrictModel):
    """How much of one data source a stage reads (demos, smoke runs)."""

    max_docs: int | None = Field(
        default=None, ge=1, description="Read at most this many documents (records) of this source; None = all."
    )


def training_bytes(
    model_config,
    tokens: int,
    *,
    full: bool,
    bf16: bool,
    world: int = 1,
    checkpointing: bool = False,
    fused_loss: bool = False,
) -> tuple[float, float]:
    """(weight/optimizer bytes per rank, activation bytes for `tokens` tokens per micro-batch): the one training
    memory estimate, for choosing CPT's micro-batch and SFT's activation checkpointing.

    Parameters are counted from the HF config. Full training: 16 B/param sharded over `world` (fp32 weights,
    gradients, AdamW moments) + a 2 B/param bf16 copy; LoRA: the frozen weights in the compute dtype. Activations
    per layer and token: 17·h·dtype bytes with a flash kernel (Korthikanti et al. 2022), h·dtype with
    checkpointing (plus one layer recomputed); the loss (dtype + 8)·V per token (logits, fp32 loss and gradient)
    unless the fused linear cross entropy runs."""
    c = model_config
    h, layers, vocab, inter = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    kv = h * getattr(c, "num_key_value_heads", c.num_attention_heads) // c.num_attention_heads
    embeddings = vocab * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    params = embeddings + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    elem = 2 if bf16 else 4
    state = 16.0 * params / world + 2.0 * params if full else float(elem * params)
    per_layer = (1 if checkpointing else 17) * elem * h
    activations = tokens * (layers * per_layer + (17 * elem * h if checkpointing else 0))
    loss = 0.0 if fused_loss else float(tokens * vocab * (elem + 8))
    return state, activations + loss
