"""The eval stage through the real entrypoint and coordinator, fed model/tokenizer/cpt/sft artifacts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import metrics_samples
import pytest
import torch
from dilforge_coordinator.integrity import recompute_artifact_id
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import fetch, publish, read_manifest


def _publish(store: Path, stage: str, kind: str, folder: Path, metrics: dict, manifest_stage: str | None = None) -> str:
    uri = f"{store.resolve().as_uri()}/artifacts/{stage}/fake-{stage}"
    m = Manifest(
        code_version="test",
        kind=kind,
        artifact_id=f"fake-{stage}",
        run_id="fixture",
        stage=manifest_stage or stage,
        producer=current_producer("tests"),
        config={},
        data_dir="pending",
        files=[],
        metrics=metrics,
    )
    publish(uri, folder, m)
    return uri


def _sft_adapter(cpt_dir: Path, out: Path, base_uri: str) -> Path:
    """A LoRA adapter with non-zero B, so applying it changes the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(cpt_dir), trust_remote_code=False)
    torch.manual_seed(
        5
    )  # before get_peft_model: lora_A's init draws from the global RNG (else the golden depends on test order)
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    adapter = out / "adapter"
    peft.save_pretrained(str(adapter), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(cpt_dir), trust_remote_code=False).save_pretrained(str(adapter))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base_uri
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _eval_section(data: Path, prompts: str) -> dict:
    flores = str(data / "az/dev/flores200.dev.partial_from_sib200.tsv")
    return {
        "text_sets": [
            {"uri": flores, "text_field": "azj_Latn", "name": "flores"},
            {"uri": str(data / "az/train/udhr_azj_latn.txt"), "name": "udhr"},
            {"uri": flores, "text_field": "eng_Latn", "name": "flores-en"},
        ],
        "parallel_sets": [
            {
                "name": "flores",
                "az": {"uri": flores, "text_field": "azj_Latn"},
                "en": {"uri": flores, "text_field": "eng_Latn"},
            }
        ],
        "morph": {
            "segmented": [str(data / "az/morph/az-lang-nlp_golden_morph.tsv")],
            "conllu": [str(data / "az/morph/ud_az_tuecl-ud-test.conllu")],
            "num_words_per_source": 100,
        },
        "prompts": str(prompts),
        "generation": {"max_new_tokens": 6, "num_prompts": 2, "repetition_penalty": 1.2, "no_repeat_ngram_size": 3},
        "bpb": {"window": 64, "stride": 32},
        "max_bytes_per_set": 3000,
        "assistant": {"per_language": 2, "max_new_tokens": 5, "batch_size": 3},
    }


def _coordinator(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp / "work"),
        "DILFORGE_CACHE": str(tmp / "cache"),
    }
    return subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp,
        check=False,
    )


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, tiny_tokenizer_dir, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("eval-up")
    store = tmp / "store"
    tok_uri = _publish(store, "tokenizer", "tokenizer", tiny_tokenizer_dir, metrics_samples.sample("tokenizer"))
    cpt_uri = _publish(store, "cpt", "model", tiny_llama_dir, metrics_samples.sample("cpt"))
    sft_dir = _sft_adapter(fetch(cpt_uri).path, tmp / "sft", cpt_uri)
    sft_uri = _publish(store, "sft", "adapter", sft_dir, metrics_samples.sample("sft", base_model=cpt_uri))
    import factories

    base_dir = factories.build_tiny_llama(tmp / "base", tiny_tokenizer_dir, seed=1)
    # the model stage's artifact: a plain HF folder inside (here in model/, found by models.resolve)
    factories.build_tiny_llama(tmp / "base-artifact" / "model", tiny_tokenizer_dir, seed=1)
    # (recorded as produced by "cpt" while the manifest schema predates the model stage; eval reads only the files)
    model_uri = _publish(
        store, "model", "model", tmp / "base-artifact", metrics_samples.sample("model"), manifest_stage="cpt"
    )
    return {
        "tmp": tmp,
        "store": store,
        "tokenizer": tok_uri,
        "cpt": cpt_uri,
        "sft": sft_uri,
        "base": base_dir,
        "model": model_uri,
    }


def _keys(node) -> list[str]:
    if isinstance(node, dict):
        return [k for k, v in node.items() for k in (k, *_keys(v))]
    if isinstance(node, list):
        return [k for v in node for k in _keys(v)]
    return []


def _write_pipeline(path: Path, store: Path, run_id: str, section: dict) -> Path:
    path.write_text(json.dumps({"run_id": run_id, "store": {"uri": str(store)}, "eval": section}))
    return path


def test_eval_stage_reports_every_model_and_set(upstream, data_root):
    tmp = upstream["tmp"]
    prompts = "builtin:az-generation"
    cfg = _write_pipeline(tmp / "pipe.yaml", upstream["store"], "evalrun", _eval_section(data_root, prompts))
    proc = _coordinator(
        [
            "run",
            "eval",
            "--config",
            str(cfg),
            "--input",
            f"model={upstream['model']}",
            "--input",
            f"tokenizer={upstream['tokenizer']}",
            "--input",
            f"cpt={upstream['cpt']}",
            "--input",
            f"sft={upstream['sft']}",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = proc.stdout.strip().splitlines()[-1].split("artifact: ")[1]
    manifest, _ = read_manifest(uri)
    assert manifest.kind == "eval_report" and manifest.stage == "eval"
    assert {r.name for r in manifest.inputs} >= {"model", "tokenizer", "cpt", "sft", "data:flores", "data:udhr"}
    assert recompute_artifact_id(manifest) == manifest.artifact_id
    files = {f.path for f in manifest.files}
    assert {
        "report.html",
        "report.md",
        "metrics.json",
        "generations.jsonl",
        "plots/bpb_per_model.png",
        "plots/training_curves.png",
        "plots/fertility_per_vocab_size.png",
    } <= files
    m = manifest.metrics
    assert list(m["bpb"]) == ["base", "cpt", "sft"]
    assert m["models"]["base"]["origin"] == "artifact fake-model"  # the pipeline's model artifact is the base
    for model in ("base", "cpt", "sft"):
        assert set(m["bpb"][model]) == {"flores", "udhr", "flores-en"}
        assert 0 < m["bpb"][model]["flores"]["bpb"] < 20
    assert {k: v["language"] for k, v in m["text_sets"].items()} == {"flores": "az", "udhr": "az", "flores-en": "en"}
    for model in ("cpt", "sft"):  # change per set, against base, never averaged
        for s in ("flores", "udhr", "flores-en"):
            got = m["bpb_change"][model][s]
            assert got["change"] == pytest.approx(m["bpb"][model][s]["bpb"] / m["bpb"]["base"][s]["bpb"] - 1, abs=1e-4)
    h = m["headline"]
    assert (
        h["reference"] == "base"
        and h["gain"]["cpt"]["set"] == "flores"
        and h["gain"]["cpt"] == {"set": "flores", **m["bpb_change"]["cpt"]["flores"]}
    )
    assert set(h["retention"]["sft"]) == {"en"} and h["retention"]["sft"]["en"]["set"] == "flores-en"
    assert not [
        k
        for k in _keys(m)
        if any(w in k.lower() for w in ("mean", "average", "avg"))
        and k != "step0_val_bpb_mean_of_pieces"
        and k != "mean_of_pieces"
    ]
    assert m["transplant"]["step0_bpb"] == {"random": {"val": 5.27}, "mean_of_pieces": {"val": 2.81}}
    assert m["tokenizer_comparison"]["languages"] == ["az", "en"]
    assert m["bpb"]["sft"]["flores"]["bpb"] != m["bpb"]["cpt"]["flores"]["bpb"]  # the adapter was applied
    assert m["models"]["sft"]["adapter"] is True and m["models"]["cpt"]["adapter"] is False
    assert m["tokenizers"]["tokenizer"]["aliases"] == ["base", "cpt", "sft"]  # one tokenizer, listed once
    assert m["tokenizer_metrics"]["tokenizer"]["flores"]["tokens_per_word"] > 1
    assert 0 < m["parity"]["tokenizer"]["flores"]["parity"] < 1  # a tokenizer trained on az: English costs more
    assert set(m["morph"]["tokenizer"]) == {"az-lang-nlp_golden_morph.tsv", "ud_az_tuecl-ud-test.conllu", "all"}
    assert set(m["generation"]) == {"base", "cpt", "sft"} and set(m["generation"]["sft"]) == {"greedy", "sampled"}
    assert m["curves"]["cpt"] == {"loss": [4, 4.0], "validation/val_loss": [4, 4.1]}
    assert m["curves"]["sft"] == {"loss": [2, 2.5]}
    assert m["cost"]["cpt"]["total_tokens"] == 4096 and m["cost"]["sft"]["train_runtime_s"] == 2.5
    art = fetch(uri)
    gens = [json.loads(x) for x in (art.path / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 3 * 2 * 2
    html = (art.path / "report.html").read_text()
    for name in ("base", "cpt", "sft", "flores", "udhr", "flores-en"):
        assert re.search(f">{name} *<", html)
    assert html.index("<h2>Headline</h2>") < html.index("<h2>Bits per byte</h2>")
    assert "English retention: BPB vs base on flores-en" in html and "Step-0 BPB per initialisation" in html
    assert "Tokenizer strategies" in html and "Dead-token audit" in html
    a = m["assistant"]  # 2 prompts per language, and the Azerbaijani ones without diacritics, per model
    assert set(a["figures"]) == {"base", "cpt", "sft"} and a["thresholds"]["min_in_language"] == 0.9
    for groups in a["figures"].values():
        assert list(groups) == ["az", "en", "az-no-diacritics"] and all(g["n"] == 2 for g in groups.values())
        assert groups["az"]["ended_turn"]["n"] == 2 and 0 <= groups["az"]["in_language"]["low"] <= 1
        assert groups["az"]["chrf"]["n"] == 1  # the first two az prompts: one has a reference
    answers = [json.loads(x) for x in (art.path / "assistant_answers.jsonl").read_text().splitlines()]
    assert len(answers) == 3 * 3 * 2 and {r["group"] for r in answers} == {"az", "en", "az-no-diacritics"}
    assert all(r["num_new_tokens"] <= 5 and (r["num_new_tokens"] < 5 or not r["ended_turn"]) for r in answers)
    plain = next(r for r in answers if r["group"] == "az-no-diacritics")
    assert plain["prompt"] == "Azerbaycanin paytaxti haradir?" and plain["language"] == "az"
    assert {"assistant.base", "assistant.cpt", "assistant.sft"} <= set(m["seconds"])
    assert "<h2>Headline: the assistant</h2>" in html and "az-no-diacritics" in html
    full = json.loads((art.path / "metrics.json").read_text())
    assert len(full["curves"]["cpt"]["loss"]) == 4
    import golden  # the eval stage's code version is bumped whenever what it publishes here changes

    golden.check(
        "eval",
        {
            "files": sorted(f.path for f in manifest.files),
            "bpb": {model: {s: m["bpb"][model][s]["bpb"] for s in sorted(m["bpb"][model])} for model in m["bpb"]},
            "tokens_per_word": m["tokenizer_metrics"]["tokenizer"]["flores"]["tokens_per_word"],
            "parity": m["parity"]["tokenizer"]["flores"]["parity"],
            "generations": len(gens),
            "assistant_answers": len(answers),
        },
    )


def test_run_all_prints_report_path_and_bad_input_fails_cleanly(upstream, data_root, tmp_path):
    """Also: a base model given by artifact URI in `models:` (a model artifact with the HF folder inside)."""
    section = {
        "models": [{"label": "base", "uri": upstream["model"]}],
        "text_sets": [{"uri": str(data_root / "az/train/udhr_azj_latn.txt"), "name": "udhr"}],
        "bpb": {"window": 32},
        "max_bytes_per_set": 800,
    }
    cfg = _write_pipeline(tmp_path / "p.yaml", tmp_path / "store", "evalonly", section)
    proc = _coordinator(["run-all", "--config", str(cfg)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("report: ") and last.endswith("report.html")
    assert Path(last.removeprefix("report: ")).is_file()
    metrics = json.loads((Path(last.removeprefix("report: ")).parent / "metrics.json").read_text())
    assert metrics["models"]["base"]["origin"] == upstream["model"] and "udhr" in metrics["bpb"]["base"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "Salam"}\n{"id": "b", "kind": "essay", "prompt": "x"}\n')
    section["prompts"] = str(bad)
    cfg = _write_pipeline(tmp_path / "p2.yaml", tmp_path / "store", "evalbad", section)
    proc = _coordinator(["run-all", "--config", str(cfg)], tmp_path)
    assert proc.returncode != 0
    assert f"{bad}:2: field 'kind'" in proc.stderr
    assert not list((tmp_path / "store" / "artifacts" / "eval").glob("*/manifest.json"))[1:]  # only the first run's


def test_unloadable_sft_model_fails_unless_skipping_is_asked_for(upstream, data_root, tmp_path):
    """An adapter whose base cannot be found is an error by default, not a silently missing column."""
    orphan = _sft_adapter(fetch(upstream["cpt"]).path, tmp_path / "orphan", str(tmp_path / "no-such-base"))
    store = tmp_path / "store"
    sft_uri = _publish(store, "sft", "adapter", orphan, metrics_samples.sample("sft"))
    section = {
        "text_sets": [{"uri": str(data_root / "az/train/udhr_azj_latn.txt"), "name": "udhr"}],
        "bpb": {"window": 32},
        "max_bytes_per_set": 500,
    }
    cfg = _write_pipeline(tmp_path / "p.yaml", store, "orphan", section)
    proc = _coordinator(["run", "eval", "--config", str(cfg), "--input", f"sft={sft_uri}"], tmp_path)
    assert proc.returncode != 0
    assert f"sft artifact {sft_uri}" in proc.stderr and "on_unloadable_model: skip" in proc.stderr
    assert not list((store / "artifacts" / "eval").glob("*/manifest.json"))

    section.update(on_unloadable_model="skip", models=[{"label": "base", "uri": str(upstream["base"])}])
    cfg = _write_pipeline(tmp_path / "p2.yaml", store, "orphan2", section)
    proc = _coordinator(["run", "eval", "--config", str(cfg), "--input", f"sft={sft_uri}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (manifest,) = (store / "artifacts" / "eval").glob("*/manifest.json")
    skipped = json.loads(manifest.read_text())["metrics"]["skipped"]
    assert len(skipped) == 1 and skipped[0].startswith("sft model:")


def test_az_tiny_eval_section_measures_the_assistant(upstream, data_root, tmp_path):
    """The seconds-scale preset's own eval section: every model answers 3 prompts per group, scored."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    section = yaml.safe_load((root / "configs/az-tiny.yaml").read_text())["eval"]
    section = json.loads(json.dumps(section).replace("${DILFORGE_DATA}", str(data_root)))
    cfg = _write_pipeline(tmp_path / "tiny.yaml", upstream["store"], "tinyeval", section)
    inputs = [f"{k}={upstream[k]}" for k in ("model", "tokenizer", "cpt", "sft")]
    proc = _coordinator(["run", "eval", "--config", str(cfg), *[a for i in inputs for a in ("--input", i)]], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest, _ = read_manifest(proc.stdout.strip().splitlines()[-1].split("artifact: ")[1])
    a = manifest.metrics["assistant"]
    assert a["max_new_tokens"] == section["assistant"]["max_new_tokens"] and a["thresholds"]["language"] == "az"
    assert {m: {g: f["n"] for g, f in groups.items()} for m, groups in a["figures"].items()} == {
        m: {"az": 3, "en": 3, "az-no-diacritics": 3} for m in ("base", "cpt", "sft")
    }
    assert "assistant_answers.jsonl" in {f.path for f in manifest.files}
    assert "assistant sft / az-no-diacritics (n 3): in language" in proc.stdout + proc.stderr  # logged as well
    # the gate before serve/deploy/export finds this eval through the run record and judges the SFT model by it
    from dilforge_coordinator import gate

    found, label, source = gate.eval_section(upstream["sft"], str(upstream["store"]), "tinyeval", None)
    verdict = gate.judge(found, label, source)
    assert label == "sft" and source == f"eval artifact {manifest.artifact_id}"
    assert verdict.lines[0].startswith("assistant figures of the sft model") and len(verdict.lines) == 4
    assert verdict.refusal.startswith("sft model below the thresholds")  # a random 2-layer model
