"""The assistant-only label mask, token by token, through the stage's own data + SFTTrainer path."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dilforge_sft.config import SftConfig
from factories import SFT_CONVERSATION, sft_expected_tokens

# the known conversation and its hand-written mask live in factories (shared with the end-to-end test)
CONV = SFT_CONVERSATION
expected_tokens = sft_expected_tokens


@pytest.fixture(scope="module")
def stage_parts(tiny_llama_dir, tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    from dilforge_sft import stage, training
    from dilforge_shared.runtime_policy import DeviceFacts

    path = tmp_path_factory.mktemp("mask") / "chat.jsonl"
    # the second record's only assistant turn starts after 40 tokens of user text
    late = [{"role": "user", "content": " ".join(["Azərbaycan"] * 40)}, {"role": "assistant", "content": "Bəli."}]
    path.write_text("\n".join(json.dumps({"messages": m}, ensure_ascii=False) for m in (CONV, late)) + "\n")
    tok, _, source = stage.load_tokenizer(tiny_llama_dir)
    plan = training.decide_runtime(
        SftConfig.model_validate({"train": [{"uri": str(path)}]}), facts=DeviceFacts(cuda=False)
    )
    return stage, tok, source, plan, str(path)


def prepared_labels(stage_parts, tiny_llama_dir, tmp_path, max_length):
    from dilforge_sft import training

    stage, tok, _, plan, path = stage_parts
    config = SftConfig.model_validate(
        {"train": [{"uri": path}], "validation": [{"uri": path}], "max_length": max_length, "lora": {"r": 4}}
    )
    train, val, counts, _ = stage.prepare_data(config, tok, None)
    trainer = training.build_trainer(config, training.load_model(tiny_llama_dir, plan), tok, train, val, tmp_path, plan)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    return rows, counts


def test_template_from_tokenizer_has_generation_markers(stage_parts):
    _, _, source, _, _ = stage_parts
    assert source == "tokenizer"


def test_label_mask_equals_hand_written_mask(stage_parts, tiny_llama_dir, tmp_path):
    tok = stage_parts[1]
    ids, labels = expected_tokens(tok)
    rows, counts = prepared_labels(stage_parts, tiny_llama_dir, tmp_path, max_length=1024)
    assert rows[0]["input_ids"] == ids
    assert rows[0]["labels"] == labels
    assert counts.num_long_truncated == 0 and counts.num_conversations == 2
    # both assistant <|eot_id|> are trained, the other three are not
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert [lab == eot for t, lab in zip(ids, labels, strict=False) if t == eot] == [False, False, True, False, True]


def test_label_mask_truncated_at_max_length(stage_parts, tiny_llama_dir, tmp_path):
    tok = stage_parts[1]
    ids, labels = expected_tokens(tok)
    cut = ids.index(tok.convert_tokens_to_ids("<|eot_id|>"), labels.index(next(x for x in labels if x != -100))) + 4
    rows, counts = prepared_labels(stage_parts, tiny_llama_dir, tmp_path, max_length=cut)
    assert rows[0]["input_ids"] == ids[:cut]
    assert rows[0]["labels"] == labels[:cut]
    assert len(rows) == 1  # the late-answer conversation has no assistant token in its window
    assert counts.num_long_truncated == 1
    assert counts.num_long_dropped_no_assistant_left == 1


def test_the_chat_template_is_applied_once_per_conversation(stage_parts, tiny_llama_dir, tmp_path, monkeypatch):
    """The length rule's tokenisation is the only one: TRL takes the tokenised examples as they are."""
    from dilforge_sft import training

    stage, tok, _, plan, path = stage_parts
    calls = []
    real = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = SftConfig.model_validate({"train": [{"uri": path}], "validation": [{"uri": path}], "lora": {"r": 4}})
    train, val, _, _ = stage.prepare_data(config, tok, None)
    trainer = training.build_trainer(config, training.load_model(tiny_llama_dir, plan), tok, train, val, tmp_path, plan)
    assert len(trainer.train_dataset) == len(trainer.eval_dataset) == 2
    assert len(calls) == 4  # two conversations in each split, one template application each


def test_label_preview_writes_ids_mask_and_decoded_text(stage_parts, tmp_path):
    from dilforge_sft import outputs

    stage, tok = stage_parts[0], stage_parts[1]
    ids, labels = expected_tokens(tok)
    rows = [{"input_ids": ids, "labels": labels}, {"input_ids": ids[:5], "labels": [-100] * 5}]
    path = tmp_path / stage.LABEL_PREVIEW_FILE
    assert outputs.write_label_preview(rows, tok, path, 1) == 1
    (only,) = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert only["index"] == 0 and only["input_ids"] == ids
    assert only["trained"] == [0 if lab == -100 else 1 for lab in labels]
    assert only["text"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nSən köməkçisən.")
    assert only["trained_text"] == "Salam, necə kömək edim?<|eot_id|>Bakı Azərbaycanın paytaxtıdır.<|eot_id|>"
    assert outputs.write_label_preview(rows, tok, path, 5) == 2
    assert [json.loads(line)["trained"] for line in path.read_text().splitlines()][1] == [0] * 5


def test_tokenizer_without_generation_markers_gets_the_family_template(tiny_llama_dir, tmp_path):
    from dilforge_sft import stage
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    loaded, family, source = stage.load_tokenizer(tmp_path)
    assert (family.name, source) == ("llama3", "family:llama3")
    enc = loaded.apply_chat_template(CONV, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels = expected_tokens(loaded)
    assert list(enc["input_ids"]) == ids
    assert [1 if lab != -100 else 0 for lab in labels] == list(enc["assistant_masks"])


def test_packing_keeps_each_conversations_mask_and_trains(stage_parts, tiny_llama_dir, tmp_path):
    from dilforge_sft import training

    stage, tok, _, plan, path = stage_parts
    ids, labels = expected_tokens(tok)
    config = SftConfig.model_validate(
        {
            "train": [{"uri": path}],
            "validation": [{"uri": path}],
            "packing": True,
            "max_length": 1024,
            "lora": {"r": 4},
            "num_steps": 1,
            "activation_checkpointing": False,
            "micro_batch_size": 1,
        }
    )
    train, val, _, _ = stage.prepare_data(config, tok, None)
    trainer = training.build_trainer(config, training.load_model(tiny_llama_dir, plan), tok, train, val, tmp_path, plan)
    assert len(trainer.train_dataset) == 1  # both conversations in one block
    row = trainer.train_dataset[0]
    seq = row["input_ids"]
    starts = [i for i in range(len(seq) - len(ids) + 1) if seq[i : i + len(ids)] == ids]
    assert len(starts) == 1 and len(seq) > len(ids)
    assert row["labels"][starts[0] : starts[0] + len(ids)] == labels
    assert trainer.train().global_step == 1


def test_sigterm_flag_checkpoints_and_stops():
    from dilforge_sft.training import stop_on_sigterm_callback
    from transformers import TrainerControl

    flag = {"stop": False}
    cb, control = stop_on_sigterm_callback(flag), TrainerControl()
    cb.on_step_end(None, None, control)
    assert not control.should_save and not control.should_training_stop
    flag["stop"] = True
    cb.on_step_end(None, None, control)
    assert control.should_save and control.should_training_stop


def test_progress_callback_counts_the_trainer_steps_from_a_resumed_step(caplog, monkeypatch):
    """SFT's steps go through the shared progress helper (the Trainer's tqdm is off): the count starts at the
    resumed step, follows `global_step` (an optimizer step, whatever the accumulation), and ends with a
    `(done)` line once a line was logged; ranks other than 0 show nothing."""
    import io
    import logging

    from dilforge_sft.training import progress_callback
    from dilforge_shared import progress as progress_mod
    from transformers import TrainerControl, TrainerState

    monkeypatch.setattr(progress_mod.sys, "stderr", io.StringIO())  # a job log, not a terminal
    times = iter([0.0, 40.0, 80.0, 120.0, 160.0, 0.0])
    monkeypatch.setattr(progress_mod, "_clock", lambda: next(times))
    state, control = TrainerState(max_steps=4, global_step=1, is_world_process_zero=True), TrainerControl()
    cb = progress_callback()
    with caplog.at_level(logging.INFO, logger="dilforge.sft"):
        cb.on_train_begin(None, state, control)
        for step in (2, 3):
            state.global_step = step
            cb.on_step_end(None, state, control)
        assert cb.progress.n == 3
        state.global_step = 4
        cb.on_step_end(None, state, control)
        cb.on_train_end(None, state, control)
    lines = [r.getMessage() for r in caplog.records if r.name == "dilforge.sft"]
    assert lines == [
        "sft: 2/4 steps (50%), 40s elapsed, ETA 80s",  # rate counted from the resumed step
        "sft: 3/4 steps (75%), 80s elapsed, ETA 40s",
        "sft: 4/4 steps (100%), 160s elapsed, ETA 0s (done)",
    ]
    other = progress_callback()
    other.on_train_begin(None, TrainerState(max_steps=4, is_world_process_zero=False), control)
    assert not other.progress.enabled


def test_sft_closes_its_step_progress_when_training_raises(monkeypatch):
    """The Trainer calls no callback when training raises; the stage closes the progress itself, so its
    heartbeat thread stops with the pass instead of logging `(in progress)` until the process exits."""
    from types import SimpleNamespace

    from dilforge_sft import stage
    from dilforge_sft.training import progress_callback
    from transformers import TrainerControl, TrainerState

    cb = progress_callback()
    cb.on_train_begin(None, TrainerState(max_steps=4, is_world_process_zero=True), TrainerControl())
    heartbeat = cb.progress

    def train(resume_from_checkpoint=None):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        stage.train(SimpleNamespace(train=train), None, cb)
    assert cb.progress is None and heartbeat._stop.is_set()
