"""The training loop (phase 1, embeddings + LM head; phase 2, all parameters) and its non-tensor state."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from dilforge_shared.contract import Terminated
from dilforge_shared.errors import DilforgeError

from .checkpoints import Checkpointer
from .config import CptConfig
from .data import PackedData, Prefetcher, ValidationSet
from .leakage import measure as measure_leakage
from .optim import StepResult, lr_at, run_step, set_lr, skips_on_device
from .reporting import MetricsLog, PeakMemory, mfu
from .runtime import Runtime
from .validation import evaluate

log = logging.getLogger("dilforge.cpt")


@dataclass
class TrainState:
    """The loop's position and results so far; saved as state.json in every checkpoint."""

    step: int = 0  # optimizer steps done, over both phases
    phase: int = 1  # the phase in progress (1 or 2)
    step_in_phase: int = 0  # optimizer steps done in that phase
    tokens_seen: int = 0  # training tokens consumed (global batch × seq_len per step)
    sampler: dict = field(default_factory=dict)  # MixtureSampler.state_dict() after the last step
    last_loss: float | None = None  # training loss of the last step
    last_val: dict = field(default_factory=dict)  # the last validation row
    best_val_bpb: float | None = None  # the lowest validation BPB so far
    transplant: dict = field(default_factory=dict)  # the transplant report (step-0 BPB per initialisation)
    history: list[dict] = field(default_factory=list)  # training rows (global rank 0)
    validation: list[dict] = field(default_factory=list)  # validation rows, step 0 first (global rank 0)
    leakage: list[dict] = field(default_factory=list)  # {step, sets: {set: leakage row}} at step 0 and each validation

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, data: dict[str, Any]) -> None:
        """In place: the loop, the sampler position and the model component hold this very object."""
        vars(self).update(vars(TrainState(**data)))

    def add_validation(self, row: dict | None) -> None:
        if row is None:  # not global rank 0
            return
        self.validation.append(row)
        self.last_val = row
        bpb = row.get("val_bpb")
        if bpb is not None and (self.best_val_bpb is None or bpb < self.best_val_bpb):
            self.best_val_bpb = bpb


# ---- the loop ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopSetup:
    """What the loop needs besides the model, data and state; built once by the stage."""

    config: CptConfig
    rt: Runtime
    checkpointer: Checkpointer  # everything resumable registered (stage: state, model with optimizer, RNG)
    metrics: MetricsLog
    stop_requested: Callable[[], bool]  # SIGTERM here or the launcher's stop file (checked on every rank)
    flops_per_token: dict[int, float]  # per phase (phase 1 computes no weight gradients in the blocks)
    peak_flops: float | None
    leakage_probe: Any = None  # leakage.LeakageProbe: measured at every validation when set


@dataclass(frozen=True)
class Pending:
    """A step taken but not yet read back: what a rollback to just before it needs."""

    step: int
    lr: float
    sampler_before: dict
    result: StepResult


def settle(
    pending: list[Pending], state: TrainState, setup: LoopSetup, index: int, tokens_per_step: int
) -> list[tuple[float, float]]:
    """Read back the pending steps (one host sync) and return their (loss, norm). A non-finite step latched the
    device-side skip, so the model holds the step before it: the TrainState is rolled back to it, checkpointed,
    and the run stops naming step, phase and lr."""
    values = torch.stack([torch.stack([p.result.loss, p.result.norm, p.result.ok.float()]) for p in pending]).tolist()
    bad = next((i for i, (_, _, ok) in enumerate(values) if not ok), None)
    rows = [(loss, norm) for loss, norm, _ in values]
    if bad is None:
        return rows
    undone = len(pending) - bad
    first = pending[bad]
    state.step -= undone
    state.step_in_phase -= undone
    state.tokens_seen -= undone * tokens_per_step
    state.sampler = first.sampler_before
    if bad:
        state.last_loss = rows[bad - 1][0]
    for loss, _ in rows[:bad]:
        setup.metrics.tick(loss)
    setup.checkpointer.save(state.step)
    loss, norm = rows[bad]
    what = (
        f"non-finite training loss ({loss})"
        if not math.isfinite(loss)
        else f"non-finite gradient norm ({norm}; training loss {loss:.6g})"
    )
    raise DilforgeError(
        f"{what} at step {first.step} (phase {index}, lr {first.lr:g}); the optimizer "
        f"did not step; checkpoint saved at step {state.step}. Lower the phase's lr, "
        "raise num_warmup_steps, set max_grad_norm, or check the data"
    )


def train_loop(training, data: PackedData, val: list[ValidationSet], state: TrainState, setup: LoopSetup) -> TrainState:
    """Resume from the newest good checkpoint, then run both phases. The host syncs with the device only on log,
    validation and checkpoint steps (`settle`)."""
    config, rt, metrics = setup.config, setup.rt, setup.metrics
    if setup.checkpointer.load():
        data.sampler.load_state_dict(state.sampler)  # the position the loop consumed, not the prefetcher's
    else:
        state.sampler = data.sampler.state_dict()  # a fresh run starts where the sampler stands
    model = training.model
    tokens_per_step = config.global_batch_size * config.seq_len
    memory = PeakMemory(rt)
    prefetch = Prefetcher(data, config.global_batch_size, config.micro_batch_size, rt.rank, rt.world, rt.device)
    try:
        for index, phase in ((1, config.phase1), (2, config.phase2)):
            if phase.num_steps == 0 or index < state.phase:
                continue
            if index > state.phase:
                state.phase, state.step_in_phase = index, 0
            trainable, optimizer = training.start_phase(index)
            masks, scales = trainable.row_masks, trainable.row_scales
            what = "all parameters" if index == 2 else "embeddings + LM head"
            if masks:
                what = f"the {int(training.new_rows.sum())} new rows of the {what}"
            said = f"phase {index}: {phase.num_steps} steps at lr {phase.learning_rate:g} ({what})"
            log.info("%s; host syncs on log steps only: %s", said, skips_on_device(optimizer))
            memory.start_phase()
            step_time, step_tokens = 0.0, 0
            skip = torch.zeros((), dtype=torch.bool, device=rt.device)  # latched by the first bad step
            pending: list[Pending] = []
            while state.step_in_phase < phase.num_steps:
                lr = lr_at(phase, state.step_in_phase)
                set_lr(optimizer, lr)
                t0 = time.perf_counter()
                batches, sampler_before, sampler_after = prefetch.next()
                result = run_step(model, optimizer, batches, rt, config.max_grad_norm, masks, skip, scales)
                skip = skip | ~result.ok
                pending.append(Pending(state.step + 1, lr, sampler_before, result))
                state.step_in_phase += 1
                state.step += 1
                state.tokens_seen += tokens_per_step
                state.sampler = sampler_after
                step = state.step
                log_now = (
                    step % config.log_every == 0 or step == config.num_steps or state.step_in_phase == phase.num_steps
                )
                eval_now = step % config.eval_every == 0 or step == config.num_steps
                stopping = rt.any(setup.stop_requested())
                checkpoint_now = step % config.checkpoint_every == 0 or stopping
                if log_now or eval_now or checkpoint_now or not skips_on_device(optimizer):
                    try:
                        values = settle(pending, state, setup, index, tokens_per_step)
                    except DilforgeError:
                        prefetch.consumed = state.sampler
                        raise
                    pending = []
                    for loss, _ in values:
                        metrics.tick(loss)
                    loss, norm = values[-1]
                    state.last_loss = loss
                step_time += time.perf_counter() - t0
                step_tokens += tokens_per_step
                if log_now:
                    tps = step_tokens / step_time if step_time else 0.0
                    train = {"phase": index, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps}
                    train["tokens_per_s_per_device"] = per_device = tps / rt.world
                    train["mfu"] = mfu(per_device, setup.flops_per_token[index], setup.peak_flops)
                    row = metrics.record(step, {**train, "peak_memory_gb": memory.training_gb()})
                    if row is not None:
                        state.history.append(row)
                    step_time, step_tokens = 0.0, 0
                if eval_now:
                    with memory.evaluating() as eval_memory:
                        result_row = evaluate(model, val, config, rt)
                    state.add_validation(
                        metrics.record(
                            step, {**result_row, "eval_peak_memory_gb": eval_memory["gb"]}, kind="validation"
                        )
                    )
                    if setup.leakage_probe is not None:
                        rows = measure_leakage(model, setup.leakage_probe, config, rt)
                        state.leakage.append({"step": step, "sets": rows})
                        log.info(
                            "leakage at step %d: %s",
                            step,
                            ", ".join(f"{n}={r['leakage']:+.4f}" for n, r in rows.items()),
                        )
                if checkpoint_now:
                    setup.checkpointer.save(state.step)
                if stopping:
                    raise Terminated(f"stopped by SIGTERM at step {step}; checkpoint saved, rerun to resume")
    finally:
        prefetch.close()
    state.sampler = prefetch.consumed
    return state
