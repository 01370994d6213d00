"""Optimisation for the CPT loop: what each phase trains, AdamW and its parameter groups, the warmup + cosine
schedule, and one optimizer step that skips non-finite steps (on the device with fused AdamW)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import CptConfig, Phase
from .runtime import Runtime


@dataclass(frozen=True)
class Trainable:
    """What one phase trains: the parameters, and row masks (1 = train) for vocabulary matrices of which only
    some rows train (phase 1 `new_rows`): masked rows get zero gradient, so AdamW leaves them bit-identical."""

    params: list[torch.nn.Parameter]
    vocab_params: list[torch.nn.Parameter]  # embedding (and untied LM head): embedding_learning_rate applies
    row_masks: list[tuple[torch.nn.Parameter, torch.Tensor]]
    # phase 2 `kept_rows_learning_rate`: a [rows, 1] factor on each optimizer step's change of the vocabulary
    # matrices (kept rows kept_rows_learning_rate / embedding_learning_rate, new rows 1)
    row_scales: list[tuple[torch.nn.Parameter, torch.Tensor]]


def set_trainable(
    model,
    phase: int,
    new_rows: torch.Tensor | None = None,
    kept_rows: torch.Tensor | None = None,
    kept_scale: float = 1.0,
) -> Trainable:
    """Phase 1: embeddings + LM head only (with `new_rows`, a bool per vocabulary row, only those
    rows). Phase 2: everything; with `kept_rows` (a bool per vocabulary row) those rows' steps are scaled
    by `kept_scale` (`run_step`)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    vocab = [emb] if head is emb else [emb, head]  # the LM head once when tied
    for p in model.parameters():
        p.requires_grad_(phase == 2 or any(p is v for v in vocab))
    params = [p for p in model.parameters() if p.requires_grad]
    masks = [(p, _row_mask(p, new_rows)) for p in vocab] if phase == 1 and new_rows is not None else []
    scales = []
    if phase == 2 and kept_rows is not None and kept_scale != 1.0:
        factor = torch.where(kept_rows, kept_scale, 1.0)
        scales = [(p, _row_mask(p, factor)) for p in vocab]
    return Trainable(params, vocab, masks, scales)


def _row_mask(param: torch.nn.Parameter, per_row: torch.Tensor) -> torch.Tensor:
    """A [rows, 1] tensor of `per_row` laid out like the parameter (a DTensor sharded the same way under FSDP2)."""
    mask = per_row.to(device=param.device, dtype=param.dtype).reshape(-1, 1)
    if hasattr(param, "device_mesh"):  # FSDP2 DTensor: same mesh and placements as the parameter
        from torch.distributed.tensor import distribute_tensor

        full = mask.expand(-1, param.shape[1]).contiguous()
        return distribute_tensor(full, param.device_mesh, param.placements)
    return mask


def make_optimizer(trainable: Trainable, config: CptConfig, phase: Phase, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors do not. The vocabulary matrices' group is scaled by embedding_learning_rate /
    learning_rate (phase 2). `fused` runs one kernel for all parameters instead of a loop of small ones."""
    vocab_ids = {id(p) for p in trainable.vocab_params}
    scale = (getattr(phase, "embedding_learning_rate", None) or phase.learning_rate) / phase.learning_rate
    groups = []
    for name, members, decay, lr_scale in (
        ("matrices", [p for p in trainable.params if p.ndim >= 2 and id(p) not in vocab_ids], phase.weight_decay, 1.0),
        ("vocabulary", [p for p in trainable.params if id(p) in vocab_ids], phase.weight_decay, scale),
        ("vectors", [p for p in trainable.params if p.ndim < 2], 0.0, 1.0),
    ):
        if members:
            groups.append({"params": members, "weight_decay": decay, "lr_scale": lr_scale, "name": name})
    return torch.optim.AdamW(
        groups,
        lr=phase.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        fused=fused or None,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for this step, times each group's scale (embedding_learning_rate / learning_rate for the vocabulary)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]


def lr_at(phase: Phase, step: int) -> float:
    """Linear warmup to phase.learning_rate, then cosine to phase.learning_rate × min_lr_ratio at the phase's last step."""
    warmup = phase.warmup_steps(phase.num_steps)
    if step < warmup:
        return phase.learning_rate * (step + 1) / warmup
    span = max(1, phase.num_steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    return phase.learning_rate * (
        phase.min_lr_ratio + (1 - phase.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Fused AdamW honours `optimizer.found_inf` in its kernel (the GradScaler protocol), so a step is skipped
    on the device; the foreach/for-loop AdamW needs a host sync to skip."""
    return all(group.get("fused") for group in optimizer.param_groups)


@dataclass(frozen=True)
class StepResult:
    """One step's numbers, left on the device so the loop decides when to read them."""

    loss: torch.Tensor  # mean loss over the global batch (fp32, 0-dim)
    norm: torch.Tensor  # gradient norm before clipping (fp32, 0-dim)
    ok: torch.Tensor  # bool: loss and norm finite (the same on every rank)


def run_step(
    model, optimizer, batches: list, rt: Runtime, max_grad_norm: float | None, row_masks=(), skip=None, row_scales=()
) -> StepResult:
    """Forward/backward over this rank's micro-batches, clip, and step unless the loss or gradient norm is
    non-finite or `skip` (a device bool) is set; with fused AdamW nothing waits for the device. `row_masks` and
    `row_scales` as in `Trainable`: a row scale multiplies the matrix's change row by row (for AdamW exactly a
    per-row learning rate)."""
    total = torch.zeros((), device=rt.device, dtype=torch.float32)
    sync_control = hasattr(model, "set_requires_gradient_sync")  # an FSDP2 root module
    for i, mb in enumerate(batches):
        x = mb if isinstance(mb, torch.Tensor) else torch.from_numpy(mb)
        x = x.to(rt.device, non_blocking=True)
        if sync_control:
            last = i == len(batches) - 1
            # reduce-scatter the gradients once, after the last micro-batch: the earlier ones accumulate
            # unsharded local gradients (FSDP2's no_sync); numerically the same sum
            model.set_requires_gradient_sync(last)
            if rt.world == 1:
                # one rank: keep the gathered bf16 weights until the step's last backward (they cannot change
                # within a step), so they are cast/copied once per step, not once per micro-batch
                model.set_reshard_after_backward(last)
        with rt.autocast():
            loss = model(input_ids=x, labels=x).loss / len(batches)
        loss.backward()
        total += loss.detach().float()
    if rt.world > 1:
        import torch.distributed as dist

        dist.all_reduce(total)
        total /= rt.world
    for param, mask in row_masks:
        if param.grad is not None:
            param.grad.mul_(mask)
    # clip and keep the norm on the device (no host sync); under FSDP2 the DTensor norm is all-reduced to the full
    # norm, the same on every rank
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_grad_norm or float("inf"))
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float().to(total.device)
    ok = torch.isfinite(total) & torch.isfinite(norm)
    blocked = ~ok if skip is None else ~ok | skip
    before = [(p, factor, p.detach().clone()) for p, factor in row_scales]
    if skips_on_device(optimizer):
        optimizer.found_inf = blocked.float()
        optimizer.step()
    elif not bool(blocked):  # host sync: only the non-fused optimizer needs it
        optimizer.step()
    with torch.no_grad():
        for p, factor, old in before:  # old + factor · (stepped − old)
            p.sub_(old).mul_(factor).add_(old)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, norm, ok)


class TrainingModel:
    """The model and the optimizer of the phase in progress, built when the phase starts or when a checkpoint
    taken in it is loaded (its moments restored into it)."""

    def __init__(self, model, config: CptConfig, rt: Runtime, state, new_rows=None, kept_rows=None):
        self.model, self.config, self.rt, self.state = model, config, rt, state
        self.new_rows, self.kept_rows = new_rows, kept_rows  # bool per row (model_init) or None
        self.phase: int | None = None
        self.trainable = self.optimizer = None
        self._param_groups: list = []

    def kept_scale(self) -> float:
        """Phase 2: kept_rows_learning_rate / the vocabulary matrices' rate (1 when unset)."""
        p2 = self.config.phase2
        if p2.kept_rows_learning_rate is None:
            return 1.0
        return p2.kept_rows_learning_rate / (p2.embedding_learning_rate or p2.learning_rate)

    def start_phase(self, index: int):
        """(Trainable, optimizer) of phase `index`, built once."""
        if self.phase != index:
            phase = self.config.phase1 if index == 1 else self.config.phase2
            self.trainable = set_trainable(self.model, index, self.new_rows, self.kept_rows, self.kept_scale())
            self.optimizer = make_optimizer(self.trainable, self.config, phase, fused=True)  # CUDA and CPU have it
            self.phase = index
        return self.trainable, self.optimizer

    def state_dict(self) -> dict:
        """Model and optimizer *state* tensors: param_groups (hyperparameters) come from the config on resume, so
        nothing but tensors goes into the checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.start_phase(self.state.phase)
        msd, osd = get_state_dict(self.model, self.optimizer)
        self._param_groups = osd["param_groups"]
        return {"model": msd, "optim": {"state": osd["state"]}}

    def load_state_dict(self, saved: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=saved["model"],
            optim_state_dict={"state": saved["optim"]["state"], "param_groups": self._param_groups},
        )
