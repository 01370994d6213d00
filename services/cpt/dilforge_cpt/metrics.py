"""The CPT stage's metrics: training and validation curves, the transplant, leakage."""

from __future__ import annotations

from dilforge_shared.manifest import Metrics
from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainRow(Metrics):
    """One logged optimizer step."""

    step: int
    phase: int
    loss: float
    lr: float
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None


SET_PREFIX = "val_bpb/"  # a validation row holds one `val_bpb/<set name>` per validation set


class ValidationRow(BaseModel):
    """One validation pass: loss and BPB over all sets, and `val_bpb/<set>` per set."""

    model_config = ConfigDict(extra="allow")
    step: int
    val_loss: float
    val_bpb: float
    eval_peak_memory_gb: float | None = None

    @model_validator(mode="after")
    def _only_per_set_bpb(self) -> ValidationRow:
        for key, value in (self.model_extra or {}).items():
            if not key.startswith(SET_PREFIX) or not isinstance(value, (int, float)):
                raise ValueError(f"unknown validation metric {key!r} (only {SET_PREFIX}<set> may be added)")
        return self


class LeakageRow(Metrics):
    """One initialisation on one validation set at step 0 (services/cpt leakage.py); only `bpb_extended`
    where the base tokenisation cannot be scored."""

    bpb_extended: float
    bpb_base_model: float | None = None
    extended_vs_base: float | None = None
    bpb_base_tokenization: float | None = None
    base_tokenization_vs_base: float | None = None


class Transplant(Metrics):
    """How the base model's vocabulary became the stage's: kept/new rows and the step-0 BPB of each
    initialisation compared (`step0_val_bpb[method]`, per validation set in `step0_val_bpb_by_set`)."""

    method: str
    reason: str | None = None
    num_kept: int | None = None
    num_new: int | None = None
    base_vocab_size: int | None = None
    new_vocab_size: int | None = None
    step0_val_bpb: dict[str, float] = Field(default_factory=dict)
    step0_val_bpb_by_set: dict[str, dict[str, float]] = Field(default_factory=dict)
    step0_leakage: dict[str, dict[str, LeakageRow]] = Field(
        default_factory=dict, description="The step-0 leakage table: method -> validation set -> row."
    )
    tied: bool | None = None  # the trained model ties embedding and LM head
    leakage_not_measured: str | None = None  # why there is no leakage table (base tokens missing from the vocab)


class LeakageEntry(Metrics):
    """One leakage measurement (step 0 or a validation): per set {bpb_base_tokenization, bpb_kept_rows,
    leakage}."""

    step: int
    sets: dict[str, dict[str, float]]


class CptMetrics(Metrics):
    num_steps: int
    tokens_seen: int
    final_train_loss: float | None
    final_val_loss: float | None
    final_val_bpb: float | None
    final_val_bpb_by_set: dict[str, float]
    best_val_bpb: float | None
    step0_val_loss: float | None
    step0_val_bpb: float | None
    step0_val_bpb_by_set: dict[str, float]
    transplant: Transplant | None
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_gb: float | None
    eval_peak_memory_gb: float | None
    world_size: int
    global_batch_sequences: int
    global_batch_tokens: int
    total_tokens: int
    num_params: int
    liger_kernels: list[str]
    dtype: str
    history: list[TrainRow]
    validation: list[ValidationRow]
    leakage: list[LeakageEntry] = Field(default_factory=list)  # step 0 and every validation
