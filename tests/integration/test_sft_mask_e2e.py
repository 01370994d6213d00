"""The SFT loss mask end to end: coordinator → real stage on the tiny Llama → label_preview.jsonl in the
published artifact equals the hand-written mask of a known conversation, token by token, including a
conversation that max_length cuts in the middle of an assistant turn."""

from __future__ import annotations

import json
import os

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.cli import app
from dilforge_shared.store import fetch
from factories import SFT_CONVERSATION, SFT_EXPECTED_MASK, sft_expected_tokens
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

# SFT_CONVERSATION plus a third exchange, and that exchange's hand-written mask
EXTRA_TURNS = [
    {"role": "user", "content": "Gəncə haradadır?"},
    {"role": "assistant", "content": "Gəncə Azərbaycanın qərbində, Kür çayının yaxınlığındadır."},
]
EXTENDED_MASK = [
    *SFT_EXPECTED_MASK,
    ("<|start_header_id|>", 0),
    ("user", 0),
    ("<|end_header_id|>", 0),
    ("\n\nGəncə haradadır?", 0),
    ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0),
    ("assistant", 0),
    ("<|end_header_id|>", 0),
    ("\n\n", 0),
    ("Gəncə Azərbaycanın qərbində, Kür çayının yaxınlığındadır.", 1),
    ("<|eot_id|>", 1),
]


@pytest.fixture(scope="module")
def preview_run(tmp_path_factory, tiny_llama_dir):
    """One coordinator run on [known conversation, extended one]; max_length cuts the extended one 3 tokens
    into its last assistant answer, so one artifact holds an untouched and a truncated example."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    ids, labels = sft_expected_tokens(tok)
    ext_ids, ext_labels = sft_expected_tokens(tok, EXTENDED_MASK)
    last_answer = next(i for i in range(len(ids), len(ext_ids)) if ext_labels[i] != -100)
    cut = last_answer + 3
    assert len(ids) < cut < len(ext_ids) - 2 and all(lab != -100 for lab in ext_labels[last_answer : cut + 1])

    root = tmp_path_factory.mktemp("sftmask")
    chat = root / "chat.jsonl"
    chat.write_text(
        "\n".join(
            json.dumps({"messages": m}, ensure_ascii=False) for m in (SFT_CONVERSATION, SFT_CONVERSATION + EXTRA_TURNS)
        )
        + "\n"
    )
    sft = {
        "base_model": str(tiny_llama_dir),
        "train": [{"uri": str(chat)}],
        "validation": [{"uri": str(chat), "max_docs": 1}],
        "max_length": cut,
        "lora": {"r": 2, "alpha": 4, "dropout": 0.0},
        "num_steps": 1,
        "micro_batch_size": 2,
        "global_batch_size": 2,
        "eval_micro_batch_size": 1,
        "activation_checkpointing": False,
        "warmup_ratio": 0.0,
        "log_every": 1,
        "checkpoint_every": 100,
        "save_merged": False,
        "num_label_preview_examples": 5,
    }
    (root / "p.yaml").write_text(
        yaml.safe_dump({"run_id": "sft-mask", "store": {"uri": str(root / "store")}, "sft": sft}, allow_unicode=True)
    )
    os.environ["DILFORGE_WORKDIR"] = str(root / "w")
    res = CliRunner().invoke(app, ["run", "sft", "--config", str(root / "p.yaml")])
    assert res.exit_code == 0, res.output
    art = fetch(res.output.strip().splitlines()[-1].split("artifact: ")[1])
    rows = [json.loads(line) for line in (art.path / "label_preview.jsonl").read_text(encoding="utf-8").splitlines()]
    return art, rows, tok, (ids, labels), (ext_ids[:cut], ext_labels[:cut])


def trained(labels: list[int]) -> list[int]:
    return [0 if lab == -100 else 1 for lab in labels]


def test_preview_is_published_with_one_line_per_training_example(preview_run):
    art, rows, _, _, _ = preview_run
    assert "label_preview.jsonl" in {f.path for f in art.manifest.files}
    assert [r["index"] for r in rows] == [0, 1]  # 5 asked, the training set has 2
    assert art.manifest.metrics["num_label_preview_examples"] == 2
    assert art.manifest.metrics["data"]["train"]["num_long_truncated"] == 1


def test_preview_mask_equals_hand_written_mask(preview_run):
    _, rows, tok, (ids, labels), _ = preview_run
    assert rows[0]["input_ids"] == ids
    assert rows[0]["trained"] == trained(labels)
    assert rows[0]["trained_text"] == "Salam, necə kömək edim?<|eot_id|>Bakı Azərbaycanın paytaxtıdır.<|eot_id|>"
    assert rows[0]["text"] == tok.decode(ids)
    assert rows[0]["text"].startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nSən köməkçisən.")


def test_preview_mask_truncated_mid_assistant_turn(preview_run):
    _, rows, _, _, (cut_ids, cut_labels) = preview_run
    assert rows[1]["input_ids"] == cut_ids
    assert rows[1]["trained"] == trained(cut_labels)
    assert rows[1]["trained"][-3:] == [1, 1, 1]  # the window ends 3 tokens into the answer, no closing <|eot_id|>
    answer = EXTRA_TURNS[1]["content"]
    tail = rows[1]["trained_text"].split("<|eot_id|>")[-1]
    assert tail and answer.startswith(tail) and tail != answer
