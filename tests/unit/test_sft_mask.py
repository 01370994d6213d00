"""The assistant-only label mask, token by token, through the stage's own data + SFTTrainer path."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dilforge_shared.configs.sft import SftConfig

CONV = [
    {"role": "system", "content": "Sən köməkçisən."},
    {"role": "user", "content": "Salam!"},
    {"role": "assistant", "content": "Salam, necə kömək edim?"},
    {"role": "user", "content": "Bakı haradadır?"},
    {"role": "assistant", "content": "Bakı Azərbaycanın paytaxtıdır."},
]

# Hand-written: (text, is the token in the loss?). Headers, system and user text are masked; assistant
# content and the <|eot_id|> that closes each assistant turn are not; the "\n\n" after the assistant
# header belongs to the header.
EXPECTED = [
    ("<|begin_of_text|>", 0),
    ("<|start_header_id|>", 0), ("system", 0), ("<|end_header_id|>", 0), ("\n\nSən köməkçisən.", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("\n\nSalam!", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0), ("\n\n", 0),
    ("Salam, necə kömək edim?", 1), ("<|eot_id|>", 1),
    ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("\n\nBakı haradadır?", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0), ("\n\n", 0),
    ("Bakı Azərbaycanın paytaxtıdır.", 1), ("<|eot_id|>", 1),
]


def expected_tokens(tok) -> tuple[list[int], list[int]]:
    ids, labels = [], []
    for text, on in EXPECTED:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        labels += [t if on else -100 for t in seg]
    return ids, labels


@pytest.fixture(scope="module")
def stage_parts(tiny_llama_dir, tmp_path_factory):
    import torch
    torch.set_num_threads(1)
    from dilforge_sft import stage
    path = tmp_path_factory.mktemp("mask") / "chat.jsonl"
    # the second record's only assistant turn starts after 40 tokens of user text
    late = [{"role": "user", "content": " ".join(["Azərbaycan"] * 40)}, {"role": "assistant", "content": "Bəli."}]
    path.write_text("\n".join(json.dumps({"messages": m}, ensure_ascii=False) for m in (CONV, late)) + "\n")
    tok, source = stage.load_tokenizer(tiny_llama_dir)
    plan = stage.DevicePlan(device="cpu", bf16=False, liger=False)
    return stage, tok, source, plan, str(path)


def prepared_labels(stage_parts, tiny_llama_dir, tmp_path, max_length):
    stage, tok, _, plan, path = stage_parts
    config = SftConfig.model_validate({"train": [{"uri": path}], "validation": [{"uri": path}],
                                       "max_length": max_length, "lora": {"r": 4}})
    train, val, counts, _ = stage.prepare_data(config, tok, None)
    trainer = stage.build_trainer(config, stage.load_model(tiny_llama_dir, plan), tok, train, val, tmp_path, plan)
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
    assert [lab == eot for t, lab in zip(ids, labels) if t == eot] == [False, False, True, False, True]


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


def test_tokenizer_without_generation_markers_gets_trl_template(tiny_llama_dir, tmp_path):
    from dilforge_sft import stage
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    loaded, source = stage.load_tokenizer(tmp_path)
    assert source == "trl_llama3_training"
    enc = loaded.apply_chat_template(CONV, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels = expected_tokens(loaded)
    assert list(enc["input_ids"]) == ids
    assert [1 if lab != -100 else 0 for lab in labels] == list(enc["assistant_masks"])


def test_packing_keeps_each_conversations_mask_and_trains(stage_parts, tiny_llama_dir, tmp_path):
    stage, tok, _, plan, path = stage_parts
    ids, labels = expected_tokens(tok)
    config = SftConfig.model_validate({"train": [{"uri": path}], "validation": [{"uri": path}], "packing": True,
                                       "max_length": 1024, "lora": {"r": 4}, "max_steps": 1,
                                       "gradient_checkpointing": False, "per_device_batch_size": 1})
    train, val, _, _ = stage.prepare_data(config, tok, None)
    trainer = stage.build_trainer(config, stage.load_model(tiny_llama_dir, plan), tok, train, val, tmp_path, plan)
    assert len(trainer.train_dataset) == 1  # both conversations in one block
    row = trainer.train_dataset[0]
    seq = row["input_ids"]
    starts = [i for i in range(len(seq) - len(ids) + 1) if seq[i:i + len(ids)] == ids]
    assert len(starts) == 1 and len(seq) > len(ids)
    assert row["labels"][starts[0]:starts[0] + len(ids)] == labels
    assert trainer.train().global_step == 1


def test_latest_checkpoint_skips_incomplete_ones(tmp_path):
    from dilforge_sft.stage import latest_checkpoint
    assert latest_checkpoint(tmp_path) is None
    for step, state in ((2, "{}"), (4, "{}"), (6, None), (8, '{"trunc')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if state is not None:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"


def test_sigterm_flag_checkpoints_and_stops():
    from dilforge_sft.stage import stop_on_sigterm_callback
    from transformers import TrainerControl
    flag = {"stop": False}
    cb, control = stop_on_sigterm_callback(flag), TrainerControl()
    cb.on_step_end(None, None, control)
    assert not control.should_save and not control.should_training_stop
    flag["stop"] = True
    cb.on_step_end(None, None, control)
    assert control.should_save and control.should_training_stop
