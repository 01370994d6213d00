"""The training loop and its state.

`TrainState` is everything the loop carries from step to step that is not a tensor: it is what a
checkpoint's state.json holds and what a resume restores (model and optimizer tensors go through
DCP, each rank's RNG through its own JSON file: `checkpoints.py`). `train_loop` runs phase 1
(embeddings + LM head) and phase 2 (all parameters) from wherever the state says, validating,
logging and checkpointing on the configured steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dilforge_shared.configs.cpt import CptConfig, Phase
from dilforge_shared.contract import Terminated
from dilforge_shared.errors import DilforgeError

from .checkpoints import load_checkpoint, save_checkpoint
from .data import PackedData, ValidationSet
from .reporting import MetricsLog, PeakMemory
from .runtime import Runtime
from .validation import evaluate

log = logging.getLogger("dilforge.cpt")


@dataclass
class TrainState:
    """The loop's position and results so far; saved as state.json in every checkpoint."""
    step: int = 0                      # optimizer steps done, over both phases
    phase: int = 1                     # the phase in progress (1 or 2)
    step_in_phase: int = 0             # optimizer steps done in that phase
    tokens_seen: int = 0               # training tokens consumed (global batch × seq_len per step)
    sampler: dict = field(default_factory=dict)  # MixtureSampler.state_dict() after the last step
    last_loss: float | None = None     # training loss of the last step
    last_val: dict = field(default_factory=dict)  # the last validation row
    best_val_bpb: float | None = None  # the lowest validation BPB so far
    transplant: dict = field(default_factory=dict)  # the transplant report (step-0 BPB per initialisation)
    history: list[dict] = field(default_factory=list)     # training rows (global rank 0)
    validation: list[dict] = field(default_factory=list)  # validation rows, step 0 first (global rank 0)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainState:
        """Fields missing from older checkpoints keep their defaults; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def add_validation(self, row: dict | None) -> None:
        if row is None:  # not global rank 0
            return
        self.validation.append(row)
        self.last_val = row
        bpb = row.get("val_bpb")
        if bpb is not None and (self.best_val_bpb is None or bpb < self.best_val_bpb):
            self.best_val_bpb = bpb


# ---- optimisation --------------------------------------------------------------------------
@dataclass(frozen=True)
class Trainable:
    """What one phase trains: the parameters, and row masks (1 = train) for vocabulary matrices of
    which only some rows train (phase 1 `new_rows`); masked rows get zero gradient, so AdamW (no
    weight decay there) leaves them bit-identical."""
    params: list[torch.nn.Parameter]
    vocab_params: list[torch.nn.Parameter]   # embedding (and untied LM head): embedding_learning_rate applies
    row_masks: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)


def vocab_matrices(model) -> list[torch.nn.Parameter]:
    """The embedding and the LM head (once when tied)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return [emb] if head is emb else [emb, head]


def set_trainable(model, phase: int, new_rows: torch.Tensor | None = None) -> Trainable:
    """Phase 1: embeddings + LM head only (with `new_rows`, a bool per vocabulary row, only those
    rows). Phase 2: everything."""
    vocab = vocab_matrices(model)
    keep = {id(p) for p in vocab}
    params = []
    for p in model.parameters():
        p.requires_grad_(phase == 2 or id(p) in keep)
        if p.requires_grad:
            params.append(p)
    masks = []
    if phase == 1 and new_rows is not None:
        masks = [(p, _row_mask(p, new_rows)) for p in vocab]
    return Trainable(params, vocab, masks)


def _row_mask(param: torch.nn.Parameter, new_rows: torch.Tensor) -> torch.Tensor:
    """A [rows, 1] mask laid out like the parameter (a DTensor sharded the same way under FSDP2)."""
    mask = new_rows.to(device=param.device, dtype=param.dtype).reshape(-1, 1)
    if hasattr(param, "device_mesh"):  # FSDP2 DTensor: same mesh and placements as the parameter
        from torch.distributed.tensor import distribute_tensor
        full = mask.expand(-1, param.shape[1]).contiguous()
        return distribute_tensor(full, param.device_mesh, param.placements)
    return mask


def make_optimizer(trainable: Trainable, config: CptConfig, phase: Phase, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors do not. `embedding_learning_rate` (phase 2) scales the vocabulary matrices'
    learning rate by embedding_learning_rate / learning_rate, so they follow the phase's warmup and cosine at their own peak.
    `fused` (on CUDA) runs one kernel for all parameters instead of a loop of small ones."""
    vocab_ids = {id(p) for p in trainable.vocab_params}
    scale = (getattr(phase, "embedding_learning_rate", None) or phase.learning_rate) / phase.learning_rate
    groups = []
    for name, members, decay, lr_scale in (
            ("matrices", [p for p in trainable.params if p.ndim >= 2 and id(p) not in vocab_ids],
             phase.weight_decay, 1.0),
            ("vocabulary", [p for p in trainable.params if id(p) in vocab_ids], phase.weight_decay, scale),
            ("vectors", [p for p in trainable.params if p.ndim < 2], 0.0, 1.0)):
        if members:
            groups.append({"params": members, "weight_decay": decay, "lr_scale": lr_scale, "name": name})
    return torch.optim.AdamW(groups, lr=phase.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                             fused=fused or None)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for this step, times each group's scale (embedding_learning_rate / learning_rate for the vocabulary)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]


def lr_at(phase: Phase, step: int) -> float:
    """Linear warmup to phase.learning_rate, then cosine to phase.learning_rate × min_lr_ratio at the phase's last step."""
    if step < phase.num_warmup_steps:
        return phase.learning_rate * (step + 1) / phase.num_warmup_steps
    span = max(1, phase.num_steps - phase.num_warmup_steps - 1)
    progress = min(1.0, (step - phase.num_warmup_steps) / span)
    return phase.learning_rate * (phase.min_lr_ratio + (1 - phase.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def grad_norm(model, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def train_step(model, optimizer, batches: list[np.ndarray], rt: Runtime, max_grad_norm: float | None,
               row_masks: list[tuple[torch.nn.Parameter, torch.Tensor]] = ()) -> tuple[float, float]:
    """Forward/backward over this rank's micro-batches, clip, and (if loss and grad norm are finite) step.

    Returns (mean loss over the global batch, grad norm). On a non-finite loss or gradient norm (a
    finite bf16 loss can still come with inf/NaN gradients) the gradients are dropped and the
    optimizer does not step, so the caller can checkpoint the last good state; every rank sees the
    same reduced loss and norm, so all ranks take the same decision.
    """
    total = torch.zeros((), device=rt.device, dtype=torch.float32)
    for mb in batches:
        x = torch.from_numpy(mb).to(rt.device, non_blocking=True)
        with rt.autocast():
            loss = model(input_ids=x, labels=x).loss / len(batches)
        loss.backward()
        total += loss.detach().float()
    loss_value = rt.all_sum([float(total)])[0] / rt.world
    if not math.isfinite(loss_value):
        optimizer.zero_grad(set_to_none=True)
        return loss_value, float("nan")
    for param, mask in row_masks:
        if param.grad is not None:
            param.grad.mul_(mask)
    norm = grad_norm(model, max_grad_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return loss_value, norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm


# ---- the loop ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopSetup:
    """What the loop needs besides the model, data and state; built once by the stage."""
    config: CptConfig
    rt: Runtime
    checkpoint_root: Path
    metrics: MetricsLog
    stop_requested: Callable[[], bool]   # SIGTERM here or the launcher's stop file (checked on every rank)
    flops_per_token: dict[int, float]   # per phase (phase 1 computes no weight gradients in the blocks)
    peak_flops: float | None
    new_rows: torch.Tensor | None = None  # bool per vocabulary row: phase 1 `new_rows` trains only these


def save(setup: LoopSetup, state: TrainState, model, optimizer, data: PackedData) -> None:
    state.sampler = data.sampler.state_dict()
    save_checkpoint(setup.checkpoint_root, state.step, model, optimizer, state.to_json(), setup.rt,
                    setup.config.num_checkpoints_kept)


def train_loop(model, data: PackedData, val: list[ValidationSet], state: TrainState, setup: LoopSetup,
               resume_from: Path | None) -> TrainState:
    """Phase 1 then phase 2 from `state`; with `resume_from`, model and optimizer tensors (and this
    rank's RNG) are restored from that checkpoint when its phase's optimizer exists."""
    config, rt, metrics = setup.config, setup.rt, setup.metrics
    tokens_per_step = config.global_batch_size * config.seq_len
    memory = PeakMemory(rt)
    for index, phase in ((1, config.phase1), (2, config.phase2)):
        if phase.num_steps == 0 or index < state.phase:
            continue
        if index > state.phase:
            state.phase, state.step_in_phase = index, 0
        rows = setup.new_rows if index == 1 and config.phase1.trainable == "new_rows" else None
        trainable = set_trainable(model, index, rows)
        optimizer = make_optimizer(trainable, config, phase, fused=rt.cuda)
        if resume_from is not None:
            load_checkpoint(resume_from, model, optimizer, rt)
            resume_from = None
        what = "all parameters" if index == 2 else "embeddings + LM head" if rows is None else \
            f"the {int(rows.sum())} new rows of the embeddings + LM head"
        log.info("phase %d: %d steps at lr %g (%s)", index, phase.num_steps, phase.learning_rate, what)
        memory.start_phase()
        step_time, step_tokens = 0.0, 0
        while state.step_in_phase < phase.num_steps:
            lr = lr_at(phase, state.step_in_phase)
            set_lr(optimizer, lr)
            sampler_before = data.sampler.state_dict()
            t0 = time.perf_counter()
            batches = data.next_step(config.global_batch_size, config.micro_batch_size, rt.rank, rt.world)
            loss, norm = train_step(model, optimizer, batches, rt, config.max_grad_norm, trainable.row_masks)
            step_time += time.perf_counter() - t0
            step_tokens += tokens_per_step
            if not (math.isfinite(loss) and math.isfinite(norm)):
                data.sampler.load_state_dict(sampler_before)
                save(setup, state, model, optimizer, data)
                what = (f"non-finite training loss ({loss})" if not math.isfinite(loss)
                        else f"non-finite gradient norm ({norm}; training loss {loss:.6g})")
                raise DilforgeError(f"{what} at step {state.step + 1} (phase {index}, lr {lr:g}); the optimizer "
                                    f"did not step; checkpoint saved at step {state.step}. Lower the phase's learning_rate, "
                                    "raise num_warmup_steps, set max_grad_norm, or check the data")
            state.step_in_phase += 1
            state.step += 1
            state.tokens_seen += tokens_per_step
            state.last_loss = loss
            step = state.step
            metrics.tick(loss)
            if step % config.log_every == 0 or step == config.num_steps or state.step_in_phase == phase.num_steps:
                tps = step_tokens / step_time if step_time else 0.0
                fpt = setup.flops_per_token[index]
                row = metrics.record(step, {
                    "phase": index, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps,
                    "tokens_per_s_per_device": tps / rt.world,
                    "mfu": (tps / rt.world) * fpt / setup.peak_flops if setup.peak_flops else None,
                    "peak_memory_gb": memory.training_gb(),
                })
                if row is not None:
                    state.history.append(row)
                step_time, step_tokens = 0.0, 0
            if step % config.eval_every == 0 or step == config.num_steps:
                with memory.evaluating() as eval_memory:
                    result = evaluate(model, val, config, rt)
                state.add_validation(metrics.record(step, {**result, "eval_peak_memory_gb": eval_memory["gb"]},
                                                    kind="validation"))
            stopping = rt.any(setup.stop_requested())
            if step % config.checkpoint_every == 0 or stopping:
                save(setup, state, model, optimizer, data)
            if stopping:
                raise Terminated(f"stopped by SIGTERM at step {step}; checkpoint saved, rerun to resume")
    state.sampler = data.sampler.state_dict()
    return state
