"""SFT's Trainer checkpoints carry content digests (dilforge_shared.training, CPT's format): sealed
right after Trainer saves them, verified before a resume; a damaged newest checkpoint is set aside and the
previous one resumed, through the stage's own trainer on a tiny Llama."""

from __future__ import annotations

import json
import logging
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dilforge_sft.config import SftConfig
from dilforge_shared.training import read_markers, seal, verify
from factories import SFT_CONVERSATION, flip_byte


def fake_checkpoint(folder, step, state="{}", sealed=True):
    path = folder / f"checkpoint-{step}"
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(b"weights %d" % step)
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    if sealed:
        seal(path, step)
    return path


def test_latest_checkpoint_removes_cut_off_ones_and_sets_aside_unsealed_ones(tmp_path, caplog):
    from dilforge_sft.training import latest_checkpoint

    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "missing") is None
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, state=None, sealed=False)  # cut off before trainer_state.json
    fake_checkpoint(tmp_path, 8, state='{"trunc', sealed=False)
    fake_checkpoint(tmp_path, 10, sealed=False)  # saved, but the process died before the digests
    with caplog.at_level(logging.WARNING, logger="dilforge.sft"):
        assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "damaged-checkpoint-10"]
    assert "checkpoint-10: markers missing or unreadable" in caplog.text


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "missing", "extra-file"])
def test_every_kind_of_damage_to_the_newest_falls_back_to_the_previous(tmp_path, damage, caplog):
    from dilforge_sft.training import latest_checkpoint

    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    weights = newest / "adapter_model.safetensors"
    if damage == "flipped-byte":
        flip_byte(weights, 3)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1])
    elif damage == "missing":
        weights.unlink()
    else:
        (newest / "optimizer.pt").write_bytes(b"not listed")
    with caplog.at_level(logging.WARNING, logger="dilforge.sft"):
        assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    assert (tmp_path / "damaged-checkpoint-4").is_dir() and not newest.exists()
    assert "checkpoint-4 is damaged" in caplog.text and "trying the previous one" in caplog.text


def test_a_damaged_newest_trainer_checkpoint_is_set_aside_and_training_resumes_from_the_previous(
    tiny_llama_dir, tmp_path, caplog
):
    """Real Trainer checkpoints of the stage's trainer (with the stage's sealing callback): both verify; a byte
    flipped in checkpoint-2's adapter makes the resume take checkpoint-1, and training from it ends at the
    weights the uninterrupted run had at step 2."""
    import torch

    torch.set_num_threads(1)
    from dilforge_sft import stage, training
    from dilforge_sft.training import latest_checkpoint, seal_checkpoints_callback
    from dilforge_shared.runtime_policy import DeviceFacts
    from safetensors.torch import load_file

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": SFT_CONVERSATION}, ensure_ascii=False) + "\n")
    config = SftConfig.model_validate(
        {
            "train": [{"uri": str(data)}],
            "validation": [{"uri": str(data)}],
            "lora": {"r": 4, "dropout": 0.0},
            "num_steps": 2,
            "checkpoint_every": 1,
            "micro_batch_size": 1,
            "global_batch_size": 1,
            "learning_rate": 1e-2,
            "warmup_ratio": 0.0,
            "activation_checkpointing": False,
        }
    )
    tok, _, _ = stage.load_tokenizer(tiny_llama_dir)
    plan = training.decide_runtime(config, facts=DeviceFacts(cuda=False))
    train, val, _, _ = stage.prepare_data(config, tok, None)
    out = tmp_path / "trainer"

    def trainer():
        model = training.load_model(tiny_llama_dir, plan)
        return training.build_trainer(
            config, model, tok, train, val, out, plan, callbacks=[seal_checkpoints_callback()]
        )

    trainer().train()
    first, second = out / "checkpoint-1", out / "checkpoint-2"
    assert verify(first) is None and verify(second) is None
    assert set(read_markers(second)[0]["files"]) >= {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json"}
    uninterrupted = load_file(str(second / "adapter_model.safetensors"))
    assert latest_checkpoint(out) == second

    weights = second / "adapter_model.safetensors"
    flip_byte(weights, weights.stat().st_size // 2)  # a byte inside a tensor: the file still loads
    with caplog.at_level(logging.WARNING, logger="dilforge.sft"):
        resume = latest_checkpoint(out)
    assert resume == first and (out / "damaged-checkpoint-2").is_dir()
    assert "adapter_model.safetensors does not match its sha256" in caplog.text

    resumed = trainer()
    assert resumed.train(resume_from_checkpoint=str(resume)).global_step == 2
    assert verify(second) is None  # step 2 written and sealed again
    again = load_file(str(second / "adapter_model.safetensors"))
    assert again.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
