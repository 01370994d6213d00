"""`coordinator export` (issue 34): a CPT artifact of SmolLM2 on an extended tokenizer (the CPT stage, run here)
exported as GGUF by llama.cpp's own converter, then read by a real llama.cpp runtime (llama-cpp-python):
identical token ids on every line of the eval sets, next-token agreement with transformers (f16 ≥ 99 %,
q8_0 ≥ 97 %), a chat answer through llama.cpp's OpenAI-compatible server that ends with "stop", q4_k_m by
llama.cpp's quantizer, the Modelfile; and the bad inputs: no model folder, a pre-tokenizer llama.cpp cannot
name, an unknown quant, an existing file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import factories
import pytest

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's runtime: scripts/setup.sh --export")

bench = factories.load_bench("export")


@pytest.fixture(scope="module")
def cpt_artifact(tmp_path_factory, data_root, smollm2_dir):
    """SmolLM2 moved onto an extended tokenizer and trained 2 steps by the CPT stage (a real artifact, its
    base named by folder in the config: the lineage export reads)."""
    from test_cpt_stage import FLORES, WIKI, artifact, run_cpt
    from tokenizers import Tokenizer

    tmp = tmp_path_factory.mktemp("export-cpt")
    tok_dir = tmp / "tokenizer"
    tok_dir.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy2(smollm2_dir / name, tok_dir / name)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    tok.add_tokens(["Azərbaycan", "Respublikası", "şəhəri", "haqqında"])
    tok.save(str(tok_dir / "tokenizer.json"))
    cpt = {
        "base_model": str(smollm2_dir),
        "corpora": [{"uri": WIKI, "max_docs": 200}],
        "validation": [{"uri": FLORES, "text_field": "azj_Latn", "name": "az"}],
        "num_validation_docs": 4,
        "seq_len": 32,
        "global_batch_size": 2,
        "micro_batch_size": 2,
        "phase1": {"num_steps": 2, "learning_rate": 0.01, "trainable": "new_rows"},
        "phase2": {"num_steps": 0},
        "eval_every": 100,
        "checkpoint_every": 100,
    }
    run_cpt(tmp, data_root, tok_dir, cpt)
    return artifact(tmp / "store")


def export(artifact_uri: str, out: Path, quant: str, *extra: str) -> subprocess.CompletedProcess:
    # --force: these artifacts are exported for the file checks; no eval measured them as an assistant (the gate)
    cmd = [sys.executable, "-m", "dilforge_coordinator.cli", "export", artifact_uri, "--out", str(out), "--force"]
    return subprocess.run([*cmd, "--quant", quant, *extra], capture_output=True, text=True, timeout=900, check=False)


@pytest.fixture(scope="module")
def exported(cpt_artifact, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for quant in ("f16", "q8_0"):
        proc = export(cpt_artifact.uri, out, quant)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        files[quant] = out / f"{cpt_artifact.manifest.run_id}-cpt-{quant}.gguf"
        assert files[quant].is_file(), sorted(p.name for p in out.iterdir())
    return out, files


def test_llama_cpp_reads_every_eval_line_with_the_same_ids_and_predicts_the_same_tokens(
    cpt_artifact, exported, data_root
):
    _, files = exported
    json_out = exported[0] / "parity.json"
    args = ["--hf", str(cpt_artifact.path), "--data", str(data_root), "--num-windows", "4", "--new-tokens", "16"]
    args += ["--gguf", str(files["f16"]), "--gguf", str(files["q8_0"]), "--chat", "--check", "f16=0.99"]
    args += ["--question", "What is the capital of France?"]  # the CPT here is SmolLM2-Instruct, 2 steps of new rows
    assert bench.main([*args, "--json", str(json_out)]) == 0
    results = json.loads(json_out.read_text())["results"]
    # q8_0's agreement is reported, not barred, on this untrained transplant: most Azerbaijani positions are
    # near-ties for a model that never learned the language (the bar is checked on the main job's SFT model,
    # scripts/ci_export.sh); f16 must agree as the runtime's own arithmetic allows
    assert min(results["q8_0"]["top1_agreement"].values()) > 0.85
    for quant in ("f16", "q8_0"):
        assert all(s["mismatched"] == 0 and s["lines"] > 400 for s in results[quant]["tokenization"].values())
        assert results[quant]["chat"]["finish_reason"] == "stop"
    assert results["q8_0"]["size_mb"] < 0.6 * results["f16"]["size_mb"]


def test_the_gguf_names_the_base_pre_tokenizer_and_the_end_of_turn(exported):
    _, files = exported
    from gguf import GGUFReader

    reader = GGUFReader(str(files["q8_0"]))

    def field(name):
        f = reader.fields[name]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if value.dtype.kind == "u" and value.dtype.itemsize == 1 else int(value[0])

    assert field("tokenizer.ggml.pre") == "smollm" and field("general.architecture") == "llama"
    tokens = reader.fields["tokenizer.ggml.tokens"]
    names = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    assert names[field("tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert "Azərbaycan" in names and len(names) == 49152 + 4
    assert "<|im_start|>" in field("tokenizer.chat_template")


def test_q4_k_m_and_the_modelfile(cpt_artifact, tmp_path):
    proc = export(cpt_artifact.uri, tmp_path, "q4_k_m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    gguf = tmp_path / f"{cpt_artifact.manifest.run_id}-cpt-q4_k_m.gguf"
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=64, verbose=False)
    assert llm.tokenize("Azərbaycan".encode(), add_bos=False, special=False) == [49152]
    modelfile = (tmp_path / f"{cpt_artifact.manifest.run_id}-cpt-q4_k_m.Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{gguf.name}\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "<|im_start|>assistant" in modelfile and "SYSTEM" not in modelfile  # a CPT artifact has no system prompt
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([gguf.name, gguf.stem + ".Modelfile"])  # no leftovers


def test_bad_inputs_are_one_line_errors_and_leave_nothing(cpt_artifact, exported, tmp_path, tiny_tokenizer_dir):
    out, files = exported
    before = sorted(p.name for p in out.iterdir())
    again = export(cpt_artifact.uri, out, "f16")
    assert again.returncode == 1 and "exists; exports are never overwritten" in again.stderr
    assert sorted(p.name for p in out.iterdir()) == before
    unknown = export(cpt_artifact.uri, tmp_path / "x", "q5_9")
    assert unknown.returncode == 1 and "--quant 'q5_9': choose one of f16, q8_0, q4_k_m" in unknown.stderr
    no_model = export(str(tiny_tokenizer_dir), tmp_path / "y", "f16")
    assert no_model.returncode == 1 and "no model to export" in no_model.stderr and "Traceback" not in no_model.stderr
    # a tokenizer with its own pre-tokenizer (as `replace` learns): refused, naming what to do
    base = tmp_path / "base-tok"
    shutil.copytree(cpt_artifact.path, base, ignore=shutil.ignore_patterns("*.safetensors"))
    doc = json.loads((base / "tokenizer.json").read_text())
    doc["pre_tokenizer"] = {"type": "Whitespace"}
    (base / "tokenizer.json").write_text(json.dumps(doc))
    replaced = export(cpt_artifact.uri, tmp_path / "z", "f16", "--base-tokenizer", str(base))
    assert replaced.returncode == 1 and "pre_tokenizer differs from the base model's" in replaced.stderr
    assert not (tmp_path / "z").exists() or not any((tmp_path / "z").iterdir())
