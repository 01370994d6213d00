"""The training loop in process: TrainState is what a checkpoint saves, and a run stopped mid-way and
resumed from its checkpoint ends exactly where the uninterrupted run ends (across the phase boundary)."""

from __future__ import annotations

import json

import factories
import numpy as np
import pytest
import torch
from dilforge_cpt.config import CptConfig
from dilforge_shared.contract import Terminated

torch.set_num_threads(1)
VOCAB, SEQ = 64, 16


def config() -> CptConfig:
    return factories.tiny_cpt_config(eval_every=3)


def token_files(tmp_path):
    from dilforge_cpt.data import TokenFile

    files = []
    for i, n in enumerate((40 * SEQ, 25 * SEQ)):
        path = tmp_path / f"c{i}.u32"
        np.random.default_rng(i).integers(0, VOCAB, n).astype(np.uint32).tofile(path)
        files.append(TokenFile(path, n, 1, f"c{i}"))
    return files


def run(tmp_path, ckpt_root, stop_at: int | None):
    """Train from the newest checkpoint under ckpt_root (or from scratch); SIGTERM-like stop after stop_at."""
    from dilforge_cpt.data import PackedData, ValidationSet
    from dilforge_shared.bpb import build_stream

    cfg = config()
    torch.manual_seed(0)
    data = PackedData(token_files(tmp_path), [c.weight for c in cfg.corpora], SEQ, cfg.seed)
    stream = build_stream(["abc", "de"], [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]], bos=0, doc_end=63)
    return train(cfg, ckpt_root, data, [ValidationSet("v", stream)], stop_at)


def train(cfg, ckpt_root, data, val, stop_at=None):
    """What the stage does around the loop: one checkpointer with everything resumable, the loop starting with
    its load() (stage.train_in_process)."""
    from dilforge_cpt.checkpoints import Checkpointer, RngState
    from dilforge_cpt.loop import LoopSetup, TrainState, train_loop
    from dilforge_cpt.optim import TrainingModel
    from dilforge_cpt.reporting import MetricsLog
    from dilforge_cpt.runtime import Runtime
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(factories.tiny_llama_config(VOCAB))
    rt, state = Runtime(), TrainState()
    checkpointer = Checkpointer(ckpt_root, rt, cfg.num_checkpoints_kept)
    training = TrainingModel(model, cfg, rt, state)
    checkpointer.register("train_state", state)
    checkpointer.register("model", training, kind="tensors")
    checkpointer.register("rng", RngState(), kind="rank_json")
    setup = LoopSetup(
        config=cfg,
        rt=rt,
        checkpointer=checkpointer,
        metrics=MetricsLog(None, cfg.num_steps, rt, checkpointer.resume_step),
        stop_requested=lambda: stop_at is not None and state.step >= stop_at,
        flops_per_token={1: 1.0, 2: 1.0},
        peak_flops=None,
    )
    try:
        return model, train_loop(training, data, val, state, setup)
    except BaseException as exc:
        exc.model = model  # type: ignore[attr-defined]
        raise


@pytest.mark.parametrize("stop_at", [2, 5], ids=["in-phase-1", "in-phase-2"])
def test_stop_and_resume_equals_uninterrupted(tmp_path, stop_at):
    ref_model, ref_state = run(tmp_path, tmp_path / "ref", None)
    with pytest.raises(Terminated, match=f"stopped by SIGTERM at step {stop_at}"):
        run(tmp_path, tmp_path / "ck", stop_at)
    saved = json.loads((tmp_path / "ck" / f"step-{stop_at:08d}" / "state.json").read_text())
    assert saved["step"] == stop_at and saved["tokens_seen"] == stop_at * 4 * SEQ
    assert saved["phase"] == (1 if stop_at < 3 else 2)
    model, state = run(tmp_path, tmp_path / "ck", None)
    assert state.step == ref_state.step == 7 and state.tokens_seen == 7 * 4 * SEQ
    assert state.sampler == ref_state.sampler
    assert [h["loss"] for h in state.history] == [h["loss"] for h in ref_state.history]
    assert state.best_val_bpb == ref_state.best_val_bpb == min(v["val_bpb"] for v in ref_state.validation)
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values(), strict=False):
        assert torch.equal(a, b), name


def test_runtime_is_plain_on_one_cpu_process_and_fsdp_on_makes_a_one_rank_group():
    import torch.distributed as dist
    from dilforge_cpt.runtime import init_runtime, shutdown

    rt = init_runtime(config())
    assert rt.fsdp is False and rt.world == 1 and not rt.distributed  # CPU, one process: plain
    assert not dist.is_initialized()
    one = init_runtime(config().model_copy(update={"fsdp": "on"}))
    try:  # FSDP in one process: a one-rank group, the same code path as many processes
        assert one.fsdp and one.distributed and one.world == 1 and dist.get_world_size() == 1
    finally:
        shutdown(one)
    assert not dist.is_initialized()


def test_one_process_fsdp2_trains_like_the_unsharded_model(tmp_path):
    """fsdp: on without torchrun (a one-rank gloo group, MixedPrecisionPolicy) takes the same steps as
    the plain model: FSDP2 is a layout, not a different optimisation."""
    from cpt_steps import train_step
    from dilforge_cpt.optim import make_optimizer, set_trainable
    from dilforge_cpt.runtime import Runtime, init_runtime, shutdown
    from dilforge_cpt.sharding import shard_model
    from transformers import LlamaForCausalLM

    cfg = config().model_copy(update={"fsdp": "on"})
    batch = [np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))]
    results = []
    for fsdp in (False, True):
        rt = init_runtime(cfg) if fsdp else Runtime()
        try:
            torch.manual_seed(0)
            model = shard_model(LlamaForCausalLM(factories.tiny_llama_config(VOCAB)), cfg, rt)
            opt = make_optimizer(set_trainable(model, 2), cfg, cfg.phase2)
            losses = [train_step(model, opt, batch, rt, 1.0)[0] for _ in range(3)]
            results.append(losses)
        finally:
            shutdown(rt)
    assert results[1] == pytest.approx(results[0], rel=1e-6)
