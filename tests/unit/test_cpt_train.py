"""Training pieces: LR schedule, FLOPs/MFU formula, BPB, phase-1 freezing, checkpoint round trip."""

from __future__ import annotations

import itertools
import json
import math

import factories
import numpy as np
import pytest
import torch
from dilforge_cpt.config import CptConfig, Phase

torch.set_num_threads(1)


def test_lr_schedule_warmup_then_cosine_to_floor():
    from dilforge_cpt.optim import lr_at

    p = Phase(num_steps=10, learning_rate=1.0, num_warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(p, s) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0]
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("phase", [1, 2])
def test_flops_per_token_matches_torch_flop_counter(tied, phase):
    """The formula against FLOPs torch counts in a real forward + backward (eager attention, so the attention
    matmuls are visible to the counter): equal up to the RMSNorm weights, which are parameters but no matmul."""
    from dilforge_cpt.reporting import flops_per_token
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    norm_params = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    if phase == 1:  # phase 1 trains only the vocabulary matrices
        for name, param in model.named_parameters():
            param.requires_grad_("embed_tokens" in name or "lm_head" in name)
    ids = torch.randint(0, 512, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops() / ids.numel()
    passes = 4 if phase == 1 else 6
    assert flops_per_token(cfg, num_params, 64, phase=phase, causal=False) - passes * norm_params == measured
    # causal attention is charged half of the dense score matrix: 6·L·d·T instead of 12·L·d·T
    dense_minus_causal = 6 * cfg.num_hidden_layers * cfg.hidden_size * 64
    assert (
        flops_per_token(cfg, num_params, 64, phase=phase, causal=False)
        - flops_per_token(cfg, num_params, 64, phase=phase)
        == dense_minus_causal
    )


def test_flops_per_token_llama_3_2_1b_mfu_figures():
    """The issue's figures for Llama 3.2 1B at 2048 tokens: 6·N = 7.42 GFLOP/token, causal attention adds 0.40;
    80k tok/s on a 989 TFLOP/s H200 is ~63 % MFU, and charging 6·N in phase 1 would overstate MFU by ~33 %."""
    from dilforge_cpt.reporting import flops_per_token
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    assert params == 1_235_814_400
    fpt = flops_per_token(cfg, params, 2048)
    assert 6 * params == pytest.approx(7.415e9, rel=1e-3) and fpt - 6 * params == 6 * 16 * 2048 * 2048
    assert 0.62 < 80_000 * fpt / 989e12 < 0.64
    assert 0.75 < flops_per_token(cfg, params, 2048, phase=1) / fpt < 0.78


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A10G", None),
        ("Tesla T4", None),
    ],
)
def test_device_peak_by_exact_name_and_override(name, tflops):
    from dilforge_cpt.reporting import device_peak_tflops, peak_flops
    from dilforge_cpt.runtime import Runtime

    assert device_peak_tflops(name) == tflops
    cfg = CptConfig(
        scratch_model={},
        corpora=[{"uri": "a"}],
        validation=[{"uri": "b"}],
        phase1={"num_steps": 1},
        peak_tflops_per_device=100.0,
    )
    assert peak_flops(cfg, Runtime()) == 100e12


def tiny_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(factories.tiny_llama_config(64))


def test_phase1_trains_only_embeddings_and_head():
    from dilforge_cpt.optim import make_optimizer, set_trainable

    model = tiny_model()
    trainable = set_trainable(model, 1)
    assert [p.shape for p in trainable.params] == [model.model.embed_tokens.weight.shape]  # tied: one matrix
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(
        trainable,
        CptConfig(scratch_model={}, corpora=[{"uri": "a"}], validation=[{"uri": "b"}], phase1={"num_steps": 1}),
        Phase(num_steps=1, learning_rate=0.1),
    )
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {"model.embed_tokens.weight", "lm_head.weight"}
    assert len(set_trainable(model, 2).params) == len(list(model.parameters()))


class Json:
    def __init__(self, value=None):
        self.value = value or {}

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def checkpointer(root, model, opt, state: Json, rt=None, keep=2):
    from dilforge_cpt.checkpoints import Checkpointer, RngState
    from dilforge_cpt.runtime import Runtime

    ck = Checkpointer(root, rt or Runtime(), keep)
    ck.register("train_state", state)
    ck.register("model", factories.CheckpointTensors(model, opt), kind="tensors")
    ck.register("rng", RngState(), kind="rank_json")
    return ck


def trained():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return model, opt


def test_checkpointer_round_trip_picks_the_newest_complete_and_prunes(tmp_path):
    model, opt = trained()
    checkpointer(tmp_path, model, opt, Json({"step": 3})).save(3)
    (tmp_path / "step-00000009.tmp").mkdir()  # a half-written checkpoint is never picked
    fresh = tiny_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = Json()
    ck = checkpointer(tmp_path, fresh, fresh_opt, state)
    assert ck.resume_point().name == "step-00000003" and ck.resume_step == 3
    path = ck.resume_point()
    assert list(path.glob("__0_*.distcp")) and (path / "rng-rank00000.json").is_file()
    marker = json.loads((path / "COMPLETE.node00000-of-00001").read_text())
    assert set(marker["files"]) == {p.name for p in path.iterdir() if not p.name.startswith("COMPLETE")}
    assert all(len(e["sha256"]) == 64 and e["size"] == (path / n).stat().st_size for n, e in marker["files"].items())
    assert ck.load() and state.value == {"step": 3}
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=False):
        assert torch.equal(a, b), k
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
    for step in (6, 9):
        checkpointer(tmp_path, model, opt, Json({"step": step})).save(step)
    assert sorted(p.name for p in tmp_path.glob("step-*") if not p.name.endswith(".tmp")) == [
        "step-00000006",
        "step-00000009",
    ]
    assert not checkpointer(tmp_path / "none", fresh, fresh_opt, Json()).load()


_flip = factories.flip_byte  # same size: only a content digest can tell


DAMAGE = {
    "shard-bytes": lambda p: _flip(next(p.glob("__0_*.distcp")), -100),
    "shard-header": lambda p: _flip(next(p.glob("__0_*.distcp")), 8),
    "dcp-metadata": lambda p: _flip(p / ".metadata", 20),
    "state-json": lambda p: (p / "state.json").write_text('{"step": 4'),
    "rng-json": lambda p: _flip(p / "rng-rank00000.json", 5),
    "file-missing": lambda p: (p / "rng-rank00000.json").unlink(),
    "unlisted-file": lambda p: (p / "extra.pt").write_bytes(b"x"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_resumed(tmp_path, damage, caplog):
    model, opt = trained()
    checkpointer(tmp_path, model, opt, Json({"step": 2})).save(2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpointer(tmp_path, model, opt, Json({"step": 4})).save(4)
    DAMAGE[damage](tmp_path / "step-00000004")
    fresh = tiny_model()
    state = Json()
    ck = checkpointer(tmp_path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1), state)
    with caplog.at_level("WARNING", logger="dilforge.cpt"):
        assert ck.load()
    assert state.value == {"step": 2} and ck.resume_step == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert "step-00000004 is damaged" in caplog.text and "trying the previous one" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004.damaged"]


def test_every_checkpoint_damaged_starts_fresh_and_a_checkpoint_without_digests_is_not_trusted(tmp_path):
    model, opt = trained()
    path = checkpointer(tmp_path, model, opt, Json({"step": 1})).save(1)
    marker = path / "COMPLETE.node00000-of-00001"
    info = json.loads(marker.read_text())
    info["files"] = {name: entry["size"] for name, entry in info["files"].items()}  # the old, sizes-only marker
    marker.write_text(json.dumps(info))
    ck = checkpointer(tmp_path, model, opt, Json())
    assert ck.resume_point() is None and not ck.load()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.damaged"]


def _forge(path, name: str, data: bytes) -> None:
    """What an attacker with write access can do: change a file and its digest in the marker."""
    from dilforge_shared.manifest import sha256_bytes

    (path / name).write_bytes(data)
    marker = path / "COMPLETE.node00000-of-00001"
    info = json.loads(marker.read_text())
    info["files"][name] = {"size": len(data), "sha256": sha256_bytes(data)}
    marker.write_text(json.dumps(info))


def test_unreadable_shards_behind_forged_digests_fail_in_one_line_not_a_checkpoint_exception(tmp_path):
    """torch's CheckpointException is a BaseException: it would end the stage with no failure file."""
    from dilforge_shared.errors import InputError

    model, opt = trained()
    path = checkpointer(tmp_path, model, opt, Json({"step": 1})).save(1)
    shard = next(path.glob("__0_*.distcp"))
    _forge(path, shard.name, shard.read_bytes()[:64])
    with pytest.raises(InputError, match=r"step-00000001: checkpoint shards unreadable \("):
        checkpointer(tmp_path, model, opt, Json()).load()


def test_rng_state_round_trips_through_json():
    import json
    import random

    from dilforge_cpt.checkpoints import RngState

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # a cached gaussian is part of numpy's state
    saved = json.loads(json.dumps(RngState().state_dict()))
    expect = (random.random(), np.random.normal(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    RngState().load_state_dict(saved)
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[:2] == expect[:2] and torch.equal(got[2], expect[2])


def test_checkpoint_holds_no_pickled_objects_and_refuses_a_malicious_metadata(tmp_path):
    import pickle
    import pickletools

    from dilforge_shared.errors import InputError

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    path = checkpointer(tmp_path / "ck", model, opt, Json({"step": 1})).save(1)
    names = {p.name for p in path.iterdir()}
    assert not {n for n in names if n.endswith((".pt", ".pkl", ".pth"))}, names
    assert "rng-rank00000.json" in names and "state.json" in names
    # DCP's metadata only refers to DCP's own types (no byte blobs that DCP would torch.load unsafely)
    refs = {
        arg for op, arg, _ in pickletools.genops((path / ".metadata").read_bytes()) if op.name == "SHORT_BINUNICODE"
    }
    assert "BytesStorageMetadata" not in refs

    class Evil:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    _forge(path, ".metadata", pickle.dumps(Evil()))  # digests forged too: the unpickler is the last line
    with pytest.raises(InputError, match=r"refers to (io|builtins)\.open, which is not allowed"):
        checkpointer(tmp_path / "ck", model, opt, Json()).load()
    assert not (tmp_path / "pwned").exists()


def test_train_step_skips_the_update_on_an_infinite_gradient():
    from cpt_steps import train_step
    from dilforge_cpt.runtime import Runtime

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = model.model.layers[0].mlp.down_proj.weight
    hook = bad.register_hook(lambda g: torch.full_like(g, float("inf")))
    batch = [np.random.default_rng(0).integers(0, 64, (2, 8))]
    loss, norm = train_step(model, opt, batch, Runtime(), max_grad_norm=1.0)
    assert math.isfinite(loss) and not math.isfinite(norm)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    hook.remove()
    loss, norm = train_step(model, opt, batch, Runtime(), max_grad_norm=1.0)
    assert math.isfinite(norm) and not torch.equal(
        model.model.layers[0].mlp.down_proj.weight, before["model.layers.0.mlp.down_proj.weight"]
    )


def _two_nodes(rank: int, port: int, base: str, shared: bool) -> None:
    import os
    from pathlib import Path

    import torch.distributed as dist
    from dilforge_cpt.runtime import Runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:  # one process per "node": local rank 0 on both
        rt = Runtime(rank=rank, world=2, local_rank=0, distributed=True, node=rank, num_nodes=2)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        root = Path(base) / ("shared" if shared else f"host{rank}")
        for step in (1, 2, 3):
            checkpointer(root, model, opt, Json({"step": step}), rt=rt).save(step)
        torch.save(model.state_dict(), Path(base) / f"expected{rank}.pt") if rank == 0 else None
        os.environ.pop("MASTER_ADDR", None)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-fs", "per-host-dirs"])
def test_multi_node_checkpoint_finalisation(tmp_path, shared):
    import shutil
    import socket

    import torch.multiprocessing as mp
    from dilforge_cpt.checkpoints import checkpoint_folders
    from dilforge_shared.training import read_markers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_two_nodes, args=(port, str(tmp_path), shared), nprocs=2, start_method="fork")
    if shared:  # finalised once: one folder per kept step, both nodes' markers in it, no leftovers
        root = tmp_path / "shared"
        assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]
        assert sorted(p.name for p in (root / "step-00000003").glob("COMPLETE*")) == [
            "COMPLETE.node00000-of-00002",
            "COMPLETE.node00001-of-00002",
        ]
    else:  # each host finalised its own folder; neither alone is a complete checkpoint
        for host in ("host0", "host1"):
            assert sorted(p.name for p in (tmp_path / host).iterdir()) == ["step-00000002", "step-00000003"]
            assert all(read_markers(p) is None for p in checkpoint_folders(tmp_path / host))
        root = tmp_path / "s3-restore"  # SageMaker restores the union of all hosts' uploads
        for host in ("host0", "host1"):
            shutil.copytree(tmp_path / host, root, dirs_exist_ok=True)
    model = torch.nn.Linear(4, 3)
    ck = checkpointer(root, model, torch.optim.AdamW(model.parameters(), lr=0.1), Json())
    assert ck.resume_point().name == "step-00000003" and ck.load()
    expected = torch.load(tmp_path / "expected0.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    (root / "step-00000003" / "rng-rank00001.json").unlink()  # a file a marker lists is missing: not complete
    assert checkpointer(root, model, torch.optim.AdamW(model.parameters(), lr=0.1), Json()).resume_step == 2
