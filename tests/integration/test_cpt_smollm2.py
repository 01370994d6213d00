"""CPT on a real pretrained model (SmolLM2-135M-Instruct, ChatML family) with an extended tokenizer.

After the transplant every kept token's embedding row is the base's, bit for bit, and a sentence whose
tokenization the extension did not change gets the base model's logits over the kept vocabulary; the
stage accepts the ChatML tokenizer end to end, and phase 1 `new_rows` leaves every kept row and every
backbone tensor bit-identical.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
NEW_TOKENS = ["Azərbaycan", " paytaxtı", " şəhəri", " Respublikası"]
UNCHANGED = "The capital of France is Paris. It is a large city."


@pytest.fixture(scope="module")
def extended_tokenizer_dir(tmp_path_factory, smollm2_dir) -> Path:
    """SmolLM2's tokenizer plus a few Azerbaijani tokens (appended ids; every base id unchanged)."""
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("smol-ext") / "tokenizer"
    out.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy2(smollm2_dir / name, out / name)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert tok.add_tokens(NEW_TOKENS) == len(NEW_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    return out


def test_transplant_keeps_rows_and_logits_of_unchanged_text(smollm2_dir, extended_tokenizer_dir):
    from dilforge_cpt.config import CptConfig
    from dilforge_cpt.data import load_tokenizer, special_ids
    from dilforge_cpt.model_init import BaseModel, load_model
    from dilforge_cpt.runtime import Runtime
    from dilforge_cpt.transplant import transplant
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(extended_tokenizer_dir)
    base_tok = load_tokenizer(smollm2_dir)
    ids = special_ids(tok, "extended")
    assert (ids.family, ids.bos) == ("chatml", None)
    config = CptConfig(
        base_model=str(smollm2_dir), corpora=[{"uri": "a"}], validation=[{"uri": "b"}], phase1={"num_steps": 1}
    )
    model, pending, report = load_model(config, BaseModel(smollm2_dir, str(smollm2_dir)), tok, ids, Runtime())
    transplant(model, pending.base_rows, pending.mapping)
    assert report["num_new"] == len(NEW_TOKENS) and report["num_kept"] == base_tok.get_vocab_size(True)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32, trust_remote_code=False)
    kept = torch.tensor([k for k in pending.mapping.kept if k >= 0])
    new_ids = torch.tensor([i for i, k in enumerate(pending.mapping.kept) if k >= 0])
    emb, base_emb = model.get_input_embeddings().weight, base.get_input_embeddings().weight
    assert torch.equal(emb[new_ids], base_emb[kept])
    assert model.get_output_embeddings().weight is emb  # still tied

    sentence = tok.encode(UNCHANGED, add_special_tokens=False).ids
    assert sentence == base_tok.encode(UNCHANGED, add_special_tokens=False).ids
    with torch.no_grad():
        x = torch.tensor([sentence])
        got = model(input_ids=x).logits[0, :, : base_emb.shape[0]]
        want = base(input_ids=x).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def initial_new_rows(smollm2_dir, tok_dir) -> torch.Tensor:
    """The new tokens' rows as the transplant initialises them (mean_of_pieces)."""
    from dilforge_cpt.config import CptConfig
    from dilforge_cpt.data import load_tokenizer, special_ids
    from dilforge_cpt.model_init import BaseModel, load_model
    from dilforge_cpt.runtime import Runtime
    from dilforge_cpt.transplant import transplant

    tok = load_tokenizer(tok_dir)
    config = CptConfig(
        base_model=str(smollm2_dir), corpora=[{"uri": "a"}], validation=[{"uri": "b"}], phase1={"num_steps": 1}
    )
    model, pending, _ = load_model(
        config, BaseModel(smollm2_dir, str(smollm2_dir)), tok, special_ids(tok, "t"), Runtime()
    )
    transplant(model, pending.base_rows, pending.mapping)
    new = torch.tensor([i for i, k in enumerate(pending.mapping.kept) if k < 0])
    return model.get_input_embeddings().weight[new].detach().clone()


def test_stage_trains_new_rows_only_on_chatml(tmp_path, data_root, smollm2_dir, extended_tokenizer_dir):
    from safetensors.torch import load_file
    from test_cpt_stage import FLORES, WIKI, artifact, run_cpt

    cpt = {
        "base_model": str(smollm2_dir),
        "transplant": "mean_of_pieces",
        "corpora": [{"uri": WIKI, "max_docs": 300}],
        "validation": [{"uri": FLORES, "text_field": "azj_Latn", "name": "az"}],
        "num_validation_docs": 4,
        "seq_len": 32,
        "global_batch_size": 2,
        "micro_batch_size": 2,
        "phase1": {"num_steps": 2, "learning_rate": 0.01, "trainable": "new_rows"},
        "phase2": {"num_steps": 0},
        "log_every": 1,
        "eval_every": 100,
        "checkpoint_every": 100,
    }
    run_cpt(tmp_path, data_root, extended_tokenizer_dir, cpt)
    art = artifact(tmp_path / "store")
    before = load_file(str(smollm2_dir / "model.safetensors"))
    after = load_file(str(art.path / "model.safetensors"))
    emb_key = "model.embed_tokens.weight"
    base_vocab = before[emb_key].shape[0]
    assert after[emb_key].shape[0] == base_vocab + len(NEW_TOKENS)
    assert torch.equal(after[emb_key][:base_vocab], before[emb_key].float())
    initial = initial_new_rows(smollm2_dir, extended_tokenizer_dir)
    assert not torch.equal(after[emb_key][base_vocab:], initial)  # the new rows trained
    for name, tensor in before.items():
        if name != emb_key and name in after:
            assert torch.equal(after[name], tensor.float()), name
    m = art.manifest.metrics
    assert m["transplant"]["num_new"] == len(NEW_TOKENS)
    assert set(m["transplant"]["step0_val_bpb_by_set"]["mean_of_pieces"]) == {"az"}
    assert m["final_val_bpb_by_set"]["az"] > 0
    # the published folder describes the ChatML family: stock generate ends the answer at <|im_end|>
    from generation_checks import assert_stock_generate_stops_at_end_of_turn, expected_ids, published_ids
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(art.path), trust_remote_code=False)
    assert published_ids(art.path) == expected_ids(tok)
    assert expected_ids(tok)["eos_token_id"] == [2, 0]  # <|im_end|>, <|endoftext|>: SmolLM2's ids
    model = AutoModelForCausalLM.from_pretrained(str(art.path), trust_remote_code=False).eval()
    assert assert_stock_generate_stops_at_end_of_turn(model, tok)[-1] == 2
