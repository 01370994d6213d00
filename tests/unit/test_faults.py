"""Fault suite (issue 23 item 8): damage each kind of file the project writes at a random offset and check that the
next run repairs it, refuses in one line, or rebuilds — never reuses or resumes the damage.

Kinds: a published manifest, a published data file, a run record, a lock file, a CPT checkpoint shard and a CPT
checkpoint state file. Damage is a flipped byte, a truncation or a zeroed run of bytes at an offset drawn from a
seeded RNG: CI runs seeds 0..2 (fixed); DILFORGE_FAULT_SEEDS / DILFORGE_FAULT_SEED0 widen it (tests/fuzzing.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_coordinator.records import parse_record
from dilforge_shared.manifest import MANIFEST_NAME
from factories import CheckpointTensors
from fuzzing import fault_seeds
from test_reliability import PublishingBackend, write_config


def damage(path: Path, seed: int) -> str:
    """Change `path` at a seeded random offset (flip, truncate or zero a run); returns what was done."""
    rng = random.Random(seed * 7919 + len(path.name))
    raw = bytearray(path.read_bytes())
    offset = rng.randrange(len(raw))
    mode = rng.choice(["flip", "truncate", "zero"])
    if mode == "truncate":
        raw = raw[:offset]
    elif mode == "zero" and any(raw[offset : offset + 16]):
        raw[offset : offset + 16] = bytes(len(raw[offset : offset + 16]))
    else:
        mode = "flip"
        raw[offset] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(raw))
    return f"{mode} at byte {offset} of {path.name} (seed {seed})"


def _published(tmp_path: Path):
    cfg = load_pipeline(write_config(tmp_path))
    backend = PublishingBackend()
    uri = pl.run_all(cfg, backend)["tokenizer"]
    root = Path(uri.removeprefix("file://"))
    return cfg, backend, uri, root


def _data_dir(root: Path) -> Path:
    return root / json.loads((root / MANIFEST_NAME).read_text())["data_dir"]


@pytest.mark.parametrize("seed", fault_seeds())
@pytest.mark.parametrize("kind", ["manifest", "data_file"])
def test_a_damaged_artifact_file_is_rebuilt_never_reused(tmp_path, capsys, kind, seed):
    cfg, backend, uri, root = _published(tmp_path)
    target = root / MANIFEST_NAME if kind == "manifest" else _data_dir(root) / "tokenizer.json"
    what = damage(target, seed)
    assert check_artifact(uri) is not None, f"{what}: the damage went unnoticed"
    capsys.readouterr()
    assert pl.run_all(cfg, backend)["tokenizer"] == uri
    out = capsys.readouterr().out
    assert len(backend.runs) == 2 and "damaged artifact" in out and "reusing" not in out, f"{what}: {out}"
    assert check_artifact(uri) is None and len(list(root.parent.glob("*.damaged-*"))) == 1
    pl.run_all(cfg, backend)
    assert len(backend.runs) == 2, "the rebuilt artifact is reused"


@pytest.mark.parametrize("seed", fault_seeds())
def test_a_damaged_run_record_is_repaired_or_set_aside_and_the_run_succeeds(tmp_path, capsys, seed):
    cfg, backend, uri, root = _published(tmp_path)
    record = tmp_path / "store" / "runs" / "demo.json"
    what = damage(record, seed)
    capsys.readouterr()
    assert pl.run_all(cfg, backend)["tokenizer"] == uri, what
    doc = parse_record(record.read_bytes(), str(record))
    assert doc.status == "succeeded" and doc.stages["tokenizer"].artifact == f"artifacts/tokenizer/{root.name}", what
    aside = list(record.parent.glob("demo.json.damaged-*"))
    out = capsys.readouterr().out
    assert ("damaged run record" in out) == bool(aside), f"{what}: set aside if and only if reported"


@pytest.mark.parametrize("seed", fault_seeds())
def test_a_damaged_lock_file_is_taken_and_rewritten(tmp_path, seed):
    cfg, backend, uri, root = _published(tmp_path)
    lock = tmp_path / "store" / "locks" / f"tokenizer-{root.name}.lock"
    what = damage(lock, seed)
    assert pl.run_all(cfg, backend)["tokenizer"] == uri, what
    assert set(json.loads(lock.read_text())) >= {"pid", "host"}, f"{what}: owner info rewritten"
    assert len(backend.runs) == 1, "the whole artifact is reused"


# ---- CPT checkpoints: the checkpointer with content digests (issue 23 item 1) ------------------------------------


class _Json:
    def __init__(self, value=None):
        self.value = value or {}

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def _tiny():
    import torch
    from factories import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("seed", fault_seeds())
@pytest.mark.parametrize("kind", ["checkpoint_shard", "checkpoint_state"])
def test_a_damaged_checkpoint_is_never_resumed(tmp_path, kind, seed):
    import torch
    from dilforge_cpt.checkpoints import Checkpointer, RngState
    from dilforge_cpt.runtime import Runtime

    def checkpointer(model, opt, state):
        ck = Checkpointer(tmp_path, Runtime(), 2)
        ck.register("train_state", state)
        ck.register("model", CheckpointTensors(model, opt), kind="tensors")
        ck.register("rng", RngState(), kind="rank_json")
        return ck

    model, opt = _tiny()
    checkpointer(model, opt, _Json({"step": 2})).save(2)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    latest = checkpointer(model, opt, _Json({"step": 4})).save(4)
    target = next(latest.glob("__0_*.distcp")) if kind == "checkpoint_shard" else latest / "state.json"
    what = damage(target, seed)
    fresh, _ = _tiny()
    state = _Json()
    ck = checkpointer(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1), state)
    assert ck.load(), what
    assert state.value == {"step": 2} and ck.resume_step == 2, f"{what}: the damaged step-4 was resumed"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in good.items()), what
