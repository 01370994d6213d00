"""What a CPT run resumes, registered in the order `load()` restores it: the TrainState (the learning-rate
schedule is a function of its phase and step), the sampler position, the model with its phase's optimizer, the RNG."""

from __future__ import annotations

import torch

from .checkpoints import Checkpointer, RngState
from .config import CptConfig
from .runtime import Runtime


class TrainingModel:
    """The model and the optimizer of the phase in progress, built when the phase starts or when a checkpoint
    taken in it is loaded (its moments restored into it)."""

    def __init__(
        self,
        model,
        config: CptConfig,
        rt: Runtime,
        state,
        new_rows: torch.Tensor | None = None,
        kept_rows: torch.Tensor | None = None,
    ):
        self.model, self.config, self.rt, self.state, self.new_rows = model, config, rt, state, new_rows
        self.kept_rows = kept_rows  # phase 2 kept_rows_learning_rate: the base model's own vocabulary rows
        self.phase: int | None = None
        self.trainable = self.optimizer = None
        self._param_groups: list = []

    def rows(self, index: int) -> torch.Tensor | None:
        """Phase 1 `new_rows`: the vocabulary rows that train (None = whole matrices)."""
        return self.new_rows if index == 1 and self.config.phase1.trainable == "new_rows" else None

    def kept_scale(self) -> float:
        """Phase 2: kept_rows_learning_rate / the vocabulary matrices' rate (1 when unset)."""
        p2 = self.config.phase2
        if p2.kept_rows_learning_rate is None:
            return 1.0
        return p2.kept_rows_learning_rate / (p2.embedding_learning_rate or p2.learning_rate)

    def start_phase(self, index: int):
        """(Trainable, optimizer) of phase `index`, built once."""
        from .optim import make_optimizer, set_trainable

        if self.phase != index:
            phase = self.config.phase1 if index == 1 else self.config.phase2
            self.trainable = set_trainable(self.model, index, self.rows(index), self.kept_rows, self.kept_scale())
            self.optimizer = make_optimizer(
                self.trainable, self.config, phase, fused=self.rt.device.type in ("cuda", "cpu")
            )
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


class SamplerPosition:
    """The data position the loop consumed (TrainState.sampler), not where the prefetcher has read ahead to."""

    def __init__(self, sampler, state):
        self.sampler, self.state = sampler, state

    def state_dict(self) -> dict:
        return self.state.sampler

    def load_state_dict(self, position: dict) -> None:
        self.sampler.load_state_dict(position)
        self.state.sampler = position


def register_resumables(checkpointer: Checkpointer, training: TrainingModel, sampler, state) -> Checkpointer:
    checkpointer.register("train_state", state)
    checkpointer.register("sampler", SamplerPosition(sampler, state))
    checkpointer.register("model", training, kind="tensors")
    checkpointer.register("rng", RngState(), kind="rank_json")
    return checkpointer
