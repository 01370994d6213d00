"""Phase 2 `kept_rows_learning_rate`: the base model's own vocabulary rows train at their own rate.

`run_step` scales each step's change of the vocabulary matrices row by row; for AdamW that is exactly a
per-row learning rate, checked against a reference that holds the kept and the new rows as two parameters
in two parameter groups at the two rates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dilforge_cpt.config import CptConfig
from dilforge_cpt.model_init import row_masks
from dilforge_cpt.optim import TrainingModel, run_step, set_trainable
from dilforge_cpt.runtime import Runtime
from factories import tiny_cpt_config

ROWS, DIM, NUM_KEPT = 12, 6, 8
KEPT = torch.arange(ROWS) < NUM_KEPT
LR, SCALE = 0.05, 0.1


class Toy(torch.nn.Module):
    """An `embedding` and a vector; loss = a fixed function of the looked-up rows (so gradients differ by row)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.emb = torch.nn.Parameter(weight.clone())
        self.bias = torch.nn.Parameter(torch.zeros(DIM))

    def rows(self) -> torch.Tensor:
        return self.emb

    def forward(self, input_ids, labels=None):
        h = self.rows()[input_ids] + self.bias
        return SimpleNamespace(loss=((h - torch.sin(input_ids.float())[..., None]) ** 2).mean() + (h**3).mean())


class SplitToy(Toy):
    """The same model with the kept and the new rows as two parameters."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        del self.emb
        self.kept = torch.nn.Parameter(weight[:NUM_KEPT].clone())
        self.new = torch.nn.Parameter(weight[NUM_KEPT:].clone())

    def rows(self) -> torch.Tensor:
        return torch.cat([self.kept, self.new])


def batches(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, ROWS, (2, 5), generator=g) for _ in range(2)]


def adamw(groups, fused: bool):
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=fused or None)


@pytest.mark.parametrize("fused", [False, True])
def test_scaled_steps_equal_a_per_row_learning_rate(fused):
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    scaled, split, plain = Toy(weight), SplitToy(weight), Toy(weight)
    factor = torch.where(KEPT, SCALE, 1.0).reshape(-1, 1)
    opt_scaled = adamw(list(scaled.parameters()), fused)
    opt_plain = adamw(list(plain.parameters()), fused)
    opt_split = adamw([{"params": [split.kept], "lr": LR * SCALE}, {"params": [split.new, split.bias]}], fused)
    rt = Runtime()
    for step in range(6):
        run_step(scaled, opt_scaled, batches(step), rt, None, row_scales=[(scaled.emb, factor)])
        run_step(split, opt_split, batches(step), rt, None)
        run_step(plain, opt_plain, batches(step), rt, None)
    torch.testing.assert_close(scaled.emb.detach(), split.rows().detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled.bias.detach(), split.bias.detach(), rtol=1e-5, atol=1e-6)
    kept_moved = (scaled.emb.detach() - weight)[KEPT].norm() / (plain.emb.detach() - weight)[KEPT].norm()
    assert 0.05 < float(kept_moved) < 0.3  # the kept rows moved about SCALE as far as without the factor


def test_a_skipped_step_leaves_scaled_rows_unchanged():
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    toy = Toy(weight)
    opt = adamw(list(toy.parameters()), fused=True)
    factor = torch.where(KEPT, SCALE, 1.0).reshape(-1, 1)
    run_step(toy, opt, batches(0), Runtime(), None, skip=torch.tensor(True), row_scales=[(toy.emb, factor)])
    assert torch.equal(toy.emb.detach(), weight)


def test_phase2_scales_only_kept_rows_at_the_configured_ratio():
    phase2 = {"num_steps": 2, "learning_rate": 1e-4, "embedding_learning_rate": 2e-3, "kept_rows_learning_rate": 5e-5}
    cfg = CptConfig.model_validate({**tiny_cpt_config().model_dump(), "phase2": phase2})
    pending = SimpleNamespace(mapping=SimpleNamespace(kept=[0, 1, 2, -1, -1]))
    _, kept = row_masks(cfg, pending, 5, scratch=False)
    assert kept.tolist() == [True, True, True, False, False]
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 3)
    model.get_input_embeddings = lambda: model.embed
    model.get_output_embeddings = lambda: model.embed
    training = TrainingModel(model, cfg, Runtime(), SimpleNamespace(phase=2), None, kept)
    assert training.kept_scale() == pytest.approx(5e-5 / 2e-3)
    trainable, _ = training.start_phase(2)
    [(param, factor)] = trainable.row_scales
    assert param is model.embed.weight
    assert factor.reshape(-1).tolist() == pytest.approx([0.025, 0.025, 0.025, 1.0, 1.0])
    assert set_trainable(model, 1, None, kept, 0.025).row_scales == []  # phase 1 has no kept-row rate
    unset = tiny_cpt_config()
    assert row_masks(unset, pending, 5, scratch=False)[1] is None
    assert row_masks(cfg, None, 4, scratch=True)[1].tolist() == [False] * 4
