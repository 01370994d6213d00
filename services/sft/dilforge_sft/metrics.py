"""The SFT stage's metrics: the run's settings, loss curve and cost."""

from __future__ import annotations

from typing import Any

from dilforge_shared.manifest import Metrics
from pydantic import Field


class LossPoint(Metrics):
    step: int
    loss: float


class SftMetrics(Metrics):
    base_model: str
    chat_template: str
    family: str
    attention: str
    activation_checkpointing: bool
    device: str
    bf16: bool
    liger: bool
    trainable_parameters: int
    total_parameters: int
    eval_loss_before: float
    eval_loss_after: float
    train_loss: float
    train_loss_history: list[LossPoint]
    optimizer_steps: int
    resumed_from_step: int
    train_runtime_s: float
    train_steps_per_second: float | None = None
    data: dict[str, dict[str, Any]] = Field(description="Record counts per split (sft data.DataCounts).")
    outputs: list[str]
    num_label_preview_examples: int
