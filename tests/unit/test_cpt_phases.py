"""Phase 1 `new_rows` leaves kept rows and every other tensor bit-identical (plain, and under FSDP2 on
1- and 2-process gloo groups with tied weights); phase 2 `embedding_learning_rate` gives the vocabulary matrices
their own learning rate."""

from __future__ import annotations

import socket

import factories
import numpy as np
import pytest
import torch
from dilforge_cpt.config import CptConfig, Phase1, Phase2

torch.set_num_threads(1)
VOCAB = 64
NEW = torch.tensor([i % 3 == 0 for i in range(VOCAB)])  # every third token is "new"


def tiny_model(tied: bool = True):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(factories.tiny_llama_config(VOCAB, tie_word_embeddings=tied))


def config(**phase1) -> CptConfig:
    return CptConfig(
        scratch_model={},
        corpora=[{"uri": "a"}],
        validation=[{"uri": "b"}],
        phase1={"num_steps": 3, "learning_rate": 0.05, "trainable": "new_rows", **phase1},
    )


def batches(seed: int):
    return [np.random.default_rng(seed).integers(0, VOCAB, (2, 12))]


def assert_only_new_rows_changed(before: dict, after: dict):
    changed_new = False
    for name, old in before.items():
        new = after[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(new[~NEW], old[~NEW]), f"{name}: a kept row changed"
            changed_new |= not torch.equal(new[NEW], old[NEW])
        else:
            assert torch.equal(new, old), f"{name} changed"
    assert changed_new, "no new row was trained"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_new_rows_phase_changes_only_new_rows(tied):
    from cpt_steps import train_step
    from dilforge_cpt.optim import make_optimizer, set_trainable
    from dilforge_cpt.runtime import Runtime

    model = tiny_model(tied)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = config()
    trainable = set_trainable(model, 1, NEW)
    assert len(trainable.row_masks) == (1 if tied else 2)
    opt = make_optimizer(trainable, cfg, cfg.phase1)
    for step in range(3):
        train_step(model, opt, batches(step), Runtime(), 1.0, trainable.row_masks)
    assert_only_new_rows_changed(before, model.state_dict())


def test_new_rows_refuses_weight_decay():
    with pytest.raises(ValueError, match="phase1.weight_decay must be 0 with phase1.trainable: new_rows"):
        config(weight_decay=0.1)


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from cpt_steps import train_step
    from dilforge_cpt.optim import make_optimizer, set_trainable
    from dilforge_cpt.runtime import Runtime
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rt = Runtime(rank=rank, world=world, distributed=True, fsdp=True)
        model = tiny_model(tied=True)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        cfg = config()
        trainable = set_trainable(model, 1, NEW)
        opt = make_optimizer(trainable, cfg, cfg.phase1)
        for step in range(3):
            train_step(model, opt, batches(10 * step + rank), rt, 1.0, trainable.row_masks)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_new_rows_under_fsdp2_gloo_with_tied_weights(tmp_path, world):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "after.pt"
    # spawn, not fork: a fork of the test process copies whatever threads earlier tests left (tqdm's monitor,
    # telemetry), and a child forked while one of them held a lock can hang
    mp.start_processes(_fsdp_worker, args=(world, port, str(out)), nprocs=world, start_method="spawn")
    before = tiny_model(tied=True).state_dict()
    after = torch.load(out, weights_only=True)
    assert_only_new_rows_changed({k: v for k, v in before.items() if k in after}, after)


def test_phase2_embedding_learning_rate_scales_the_vocabulary_matrices_step():
    """Adam's first step moves every element by about its group's lr: 0.1 for the embedding, 0.001 elsewhere."""
    from dilforge_cpt.optim import make_optimizer, set_lr, set_trainable

    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    phase = Phase2(num_steps=1, learning_rate=1e-3, embedding_learning_rate=1e-1)
    cfg = CptConfig(scratch_model={}, corpora=[{"uri": "a"}], validation=[{"uri": "b"}], phase2=phase)
    opt = make_optimizer(set_trainable(model, 2), cfg, phase)
    set_lr(opt, phase.learning_rate)
    x = torch.from_numpy(batches(0)[0])
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    after = model.state_dict()
    emb = (after["model.embed_tokens.weight"] - before["model.embed_tokens.weight"]).abs().max()
    mlp = (after["model.layers.0.mlp.up_proj.weight"] - before["model.layers.0.mlp.up_proj.weight"]).abs().max()
    assert emb == pytest.approx(0.1, rel=0.01) and mlp == pytest.approx(1e-3, rel=0.01)
    assert Phase1().trainable == "embeddings" and Phase2().embedding_learning_rate is None
