"""The SFT stage end to end on a tiny random Llama whose tokenizer is ChatML (SmolLM2's specials)."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.cli import app
from dilforge_shared.store import fetch
from factories import build_tiny_llama
from sft_factories import build_chatml_tokenizer
from typer.testing import CliRunner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory, data_root):
    root = tmp_path_factory.mktemp("sftchatml")
    model_dir = build_tiny_llama(root / "model", build_chatml_tokenizer(root / "tokenizer"))
    sft = {
        "base_model": str(model_dir),
        "train": [
            {"uri": str(data_root / "az/sft/khazar08_native_train.jsonl"), "layout": "instruction", "max_docs": 32}
        ],
        "validation": [
            {"uri": str(data_root / "az/sft/khazar08_native_eval.jsonl"), "layout": "instruction", "max_docs": 8}
        ],
        "system_prompt": "Sən köməkçisən.",
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "max_length": 128,
        "learning_rate": 3e-3,
        "num_steps": 4,
        "micro_batch_size": 4,
        "global_batch_size": 4,
        "eval_micro_batch_size": 8,
        "log_every": 1,
        "checkpoint_every": 4,
        "warmup_ratio": 0.0,
        "packing": True,
        "save_merged": False,
        "num_label_preview_examples": 2,
    }
    cfg = {"run_id": "sft-chatml", "store": {"uri": str(root / "store")}, "sft": sft}
    (root / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    os.environ["DILFORGE_WORKDIR"] = str(root / "w")
    res = CliRunner().invoke(app, ["run", "sft", "--config", str(root / "p.yaml")])
    assert res.exit_code == 0, res.output
    return fetch(res.output.strip().splitlines()[-1].split("artifact: ")[1]), model_dir


def test_chatml_run_follows_the_family_and_trains(chatml_run):
    art, _ = chatml_run
    metrics = art.manifest.metrics
    assert metrics["family"] == "chatml" and metrics["chat_template"] == "family:chatml"
    assert metrics["attention"] == "sdpa" and metrics["activation_checkpointing"] is False  # CPU fallback, auto off
    assert metrics["optimizer_steps"] == 4
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]


def test_chatml_label_preview_trains_assistant_text_and_im_end_only(chatml_run):
    art, _ = chatml_run
    rows = [json.loads(line) for line in (art.path / "label_preview.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows
    for row in rows:
        assert "<|eot_id|>" not in row["text"]
        # every complete assistant turn ends its trained text with <|im_end|> (max_length may cut the last one)
        complete = re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", row["text"], re.DOTALL)
        assert row["trained_text"].count("<|im_end|>") == len(complete) and row["trained_text"]
        assert all(turn in row["trained_text"] for turn in complete)
        assert "<|im_start|>" not in row["trained_text"] and "Sən köməkçisən." not in row["trained_text"]


def test_chatml_adapter_weights_moved_and_tokenizer_keeps_the_training_template(chatml_run):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    art, _ = chatml_run
    weights = load_file(str(art.path / "adapter/adapter_model.safetensors"))
    lora_b = [t for name, t in weights.items() if "lora_B" in name]
    assert lora_b and all(t.abs().max().item() > 0 for t in lora_b)  # B starts at zero
    tok = AutoTokenizer.from_pretrained(str(art.path / "adapter"), trust_remote_code=False)
    assert tok.pad_token == "<|endoftext|>" and "generation %}" in tok.chat_template


def test_chatml_adapter_describes_its_family_to_stock_generate(chatml_run):
    from generation_checks import assert_stock_generate_stops_at_end_of_turn, expected_ids, published_ids
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    art, model_dir = chatml_run
    tok = AutoTokenizer.from_pretrained(str(art.path / "adapter"), trust_remote_code=False)
    assert published_ids(art.path / "adapter") == expected_ids(tok)
    assert expected_ids(tok)["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), 0]
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=False)
    model = PeftModel.from_pretrained(base, str(art.path / "adapter")).merge_and_unload().eval()
    model.generation_config = GenerationConfig.from_pretrained(str(art.path / "adapter"))
    assert_stock_generate_stops_at_end_of_turn(model, tok)
