"""The SFT stage through the coordinator on a 2-layer, 64-dim Llama: files, manifest, learning, merge, resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.backends.local import write_inputs
from dilforge_coordinator.cli import app
from dilforge_coordinator.pipeline import build_hyperparameters, stage_refs
from dilforge_sft.config import SftConfig
from dilforge_shared.contract import OPT_ML_ENV, OptMl
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import fetch, publish
from dilforge_shared.training import verify
from factories import flip_byte
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Azərbaycanın paytaxtı hansı şəhərdir?"}]


def sft_section(data_root: Path, **overrides) -> dict:
    section = {
        "train": [{"uri": str(data_root / "az/sft/khazar08_native_train.jsonl"), "layout": "instruction"}],
        "validation": [
            {"uri": str(data_root / "az/sft/khazar08_native_eval.jsonl"), "layout": "instruction", "max_docs": 16}
        ],
        "system_prompt": "Sən Azərbaycan dilində cavab verən köməkçisən.",
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "max_length": 128,
        "learning_rate": 3e-3,
        "num_steps": 12,
        "micro_batch_size": 4,
        "global_batch_size": 4,
        "eval_micro_batch_size": 8,
        "activation_checkpointing": False,
        "log_every": 2,
        "checkpoint_every": 6,
        "warmup_ratio": 0.0,
    }
    section.update(overrides)
    return section


@pytest.fixture(scope="module")
def cpt_uri(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny Llama published as a CPT model artifact in a local store."""
    store = tmp_path_factory.mktemp("cptstore")
    uri = f"{store}/artifacts/cpt/tiny0000"
    manifest = Manifest(
        code_version="test",
        kind="model",
        artifact_id="tiny0000",
        run_id="fixture",
        stage="cpt",
        producer=current_producer("dilforge-test"),
        config={},
        data_dir="pending",
        files=[],
    )
    publish(uri, tiny_llama_dir, manifest)
    return uri


def coordinator(*args: str, workdir: Path):
    os.environ["DILFORGE_WORKDIR"] = str(workdir)
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, data_root, cpt_uri):
    root = tmp_path_factory.mktemp("sft")
    cfg = {"run_id": "sft-it", "store": {"uri": str(root / "store")}, "sft": sft_section(data_root)}
    (root / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    res = coordinator("run", "sft", "--config", str(root / "p.yaml"), "--input", f"cpt={cpt_uri}", workdir=root / "w")
    assert res.exit_code == 0, res.output
    uri = res.output.strip().splitlines()[-1].split("artifact: ")[1]
    return fetch(uri), root


def logits(model, tok):
    import torch

    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits


def test_publishes_adapter_and_merged_with_lineage(sft_run, cpt_uri):
    art, _ = sft_run
    m = art.manifest
    assert (m.kind, m.stage) == ("adapter", "sft")
    files = {f.path for f in m.files}
    assert {
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "adapter/tokenizer.json",
        "merged/model.safetensors",
        "merged/config.json",
        "merged/tokenizer.json",
    } <= files
    assert not any(f.endswith((".bin", ".pt")) for f in files)
    names = {r.name: r for r in m.inputs}
    assert names["cpt"].uri == cpt_uri and names["cpt"].kind == "manifest"
    assert {"data:khazar08_native_train.jsonl", "data:khazar08_native_eval.jsonl"} <= set(names)
    adapter_cfg = json.loads((art.path / "adapter/adapter_config.json").read_text())
    assert adapter_cfg["r"] == 8 and adapter_cfg["base_model_name_or_path"] == cpt_uri
    assert set(adapter_cfg["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_training_lowers_validation_loss_and_counts_data(sft_run):
    metrics = sft_run[0].manifest.metrics
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"] - 0.05
    assert metrics["optimizer_steps"] == 12
    assert [h["step"] for h in metrics["train_loss_history"]] == [1, 2, 4, 6, 8, 10, 12]
    train = metrics["data"]["train"]
    assert train["num_records"] == 75 and train["num_bad_records"] == 0
    assert train["num_system_prompts_added"] == 75
    assert train["num_conversations"] + train["num_long_dropped_no_assistant_left"] == 75
    assert train["num_long_truncated"] > 0  # max_length 128 with a 512-token vocab cuts long answers
    assert metrics["data"]["validation"]["num_records"] == 16
    assert metrics["chat_template"] == "tokenizer" and metrics["device"] == "cpu" and metrics["bf16"] is False
    assert metrics["family"] == "llama3" and metrics["attention"] == "sdpa"
    assert metrics["activation_checkpointing"] is False


def test_adapter_changes_outputs_and_merged_equals_base_plus_adapter(sft_run, tiny_llama_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    art, _ = sft_run
    tok = AutoTokenizer.from_pretrained(str(art.path / "adapter"), trust_remote_code=False)
    base = logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False), tok)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False), str(art.path / "adapter")
    ).eval()
    with_adapter = logits(peft_model, tok)
    merged = logits(AutoModelForCausalLM.from_pretrained(str(art.path / "merged"), trust_remote_code=False), tok)
    assert (with_adapter - base).abs().max().item() > 1e-2
    torch.testing.assert_close(merged, with_adapter, atol=1e-4, rtol=1e-4)


def test_stock_generate_stops_at_end_of_turn_on_adapter_and_merged(sft_run, tiny_llama_dir):
    from generation_checks import assert_stock_generate_stops_at_end_of_turn, expected_ids, published_ids
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    art, _ = sft_run
    tok = AutoTokenizer.from_pretrained(str(art.path / "merged"), trust_remote_code=False)
    want = expected_ids(tok)
    assert published_ids(art.path / "merged") == published_ids(art.path / "adapter") == want
    merged = AutoModelForCausalLM.from_pretrained(str(art.path / "merged"), trust_remote_code=False).eval()
    assert merged.config.eos_token_id == want["eos_token_id"]
    assert_stock_generate_stops_at_end_of_turn(merged, tok)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    with_adapter = PeftModel.from_pretrained(base, str(art.path / "adapter")).merge_and_unload().eval()
    with_adapter.generation_config = GenerationConfig.from_pretrained(str(art.path / "adapter"))
    assert_stock_generate_stops_at_end_of_turn(with_adapter, tok)


def test_chat_command_answers_from_the_adapter_artifact(sft_run):
    art, root = sft_run
    res = coordinator("chat", art.uri, "--prompt", PROMPT[0]["content"], "--max-new-tokens", "8", workdir=root / "w")
    assert res.exit_code == 0, res.output
    assert res.output.strip()  # a random tiny model still emits some text


def test_bad_record_fails_naming_file_and_line(tmp_path, data_root, cpt_uri):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "Salam", "response": "Salam!"}\n{"instruction": "Necəsən?"}\n')
    cfg = {
        "run_id": "sft-bad",
        "store": {"uri": str(tmp_path / "store")},
        "sft": sft_section(data_root, train=[{"uri": str(bad), "layout": "instruction"}]),
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    res = coordinator(
        "run", "sft", "--config", str(tmp_path / "p.yaml"), "--input", f"cpt={cpt_uri}", workdir=tmp_path / "w"
    )
    assert res.exit_code == 1
    assert f"{bad}:2: bad instruction record: field 'response' is missing" in res.output
    assert not list((tmp_path / "store").rglob("manifest.json"))


def test_resumes_from_the_latest_good_checkpoint_with_a_direct_base_model(tmp_path, data_root, tiny_llama_dir):
    """Run 1 stops after checkpoints at steps 1 and 2, both sealed with digests; a byte of checkpoint-2's adapter
    is flipped; run 2 (same /opt/ml) sets it aside with a warning and continues from step 1 to step 4."""
    opt = OptMl(tmp_path / "optml")
    env = {**os.environ, OPT_ML_ENV: str(opt.root)}

    def run(max_steps: int, name: str) -> dict:
        config = SftConfig.model_validate(
            sft_section(
                data_root,
                base_model=str(tiny_llama_dir),
                num_steps=max_steps,
                checkpoint_every=1,
                save_merged=False,
                log_every=1,
            )
        )
        write_inputs(opt, build_hyperparameters(config, str(tmp_path / "store" / name), "resume", {}))
        proc = subprocess.run(
            [sys.executable, "-m", "dilforge_sft", "train"], env=env, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs.append(proc.stdout + proc.stderr)
        return fetch(str(tmp_path / "store" / name)).manifest

    logs: list[str] = []
    first = run(2, "a")
    assert first.metrics["resumed_from_step"] == 0
    checkpoints = opt.checkpoint_dir / "trainer"
    assert [verify(checkpoints / f"checkpoint-{step}") for step in (1, 2)] == [None, None]  # sealed by the stage
    adapter = checkpoints / "checkpoint-2" / "adapter_model.safetensors"
    flip_byte(adapter, adapter.stat().st_size // 2)
    second = run(4, "b")
    assert "checkpoint-2 is damaged" in logs[1] and (checkpoints / "damaged-checkpoint-2").is_dir()
    assert second.metrics["resumed_from_step"] == 1 and second.metrics["optimizer_steps"] == 4
    assert [h["step"] for h in second.metrics["train_loss_history"]] == [1, 2, 3, 4]
    assert second.metrics["eval_loss_before"] == first.metrics["eval_loss_before"]
    base_ref = next(r for r in second.inputs if r.name == f"model:{tiny_llama_dir}")
    assert base_ref.kind == "data" and base_ref.uri == str(tiny_llama_dir) and len(base_ref.sha256) == 64
    planned = stage_refs(SftConfig.model_validate(second.config), {})  # what the coordinator would fingerprint
    assert sorted((r.name, r.sha256) for r in second.inputs) == sorted((r.name, r.sha256) for r in planned)


@pytest.mark.gpu
def test_cuda_plan_uses_bf16_and_liger_and_trains(tiny_llama_dir, tmp_path, data_root):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dilforge_sft import stage, training

    config = SftConfig.model_validate(sft_section(data_root, num_steps=2, activation_checkpointing=True))
    plan = training.decide_runtime(config)
    assert plan.device == "cuda" and plan.bf16 and plan.liger
    tok, _, _ = stage.load_tokenizer(tiny_llama_dir)
    train, val, _, _ = stage.prepare_data(config, tok, None)
    trainer = training.build_trainer(
        config, training.load_model(tiny_llama_dir, plan), tok, train, val, tmp_path, plan, checkpointing=True
    )
    out = trainer.train()
    assert out.global_step == 2 and math.isfinite(out.training_loss)


def test_output_is_golden_for_its_code_version(sft_run):
    """The sft stage's code version is bumped whenever what it publishes for this run changes (tests/golden.py)."""
    import golden

    art, _ = sft_run
    m = art.manifest.metrics
    golden.check(
        "sft",
        {
            "files": sorted(f.path for f in art.manifest.files),
            "losses": [h["loss"] for h in m["train_loss_history"]],
            **{k: m[k] for k in ("eval_loss_before", "eval_loss_after", "optimizer_steps")},
        },
    )
