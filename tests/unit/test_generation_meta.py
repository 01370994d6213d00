"""Published model folders describe their family to stock consumers (issue 20 item 1): bos/eos/pad and the
chat template, so `AutoModelForCausalLM.generate` ends an answer at the end of the turn, both families."""

from __future__ import annotations

import json
import os

import pytest

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_shared.families import CHATML, LLAMA3
from dilforge_shared.specials import describe_model_folder, generation_ids
from factories import build_tiny_llama
from generation_checks import assert_stock_generate_stops_at_end_of_turn, expected_ids, published_ids
from sft_factories import build_chatml_tokenizer


def test_generation_ids_list_every_stop_the_vocabulary_has():
    llama = {
        "<|begin_of_text|>": 0,
        "<|end_of_text|>": 1,
        "<|finetune_right_pad_id|>": 4,
        "<|eom_id|>": 8,
        "<|eot_id|>": 9,
    }
    assert generation_ids(LLAMA3, llama) == {"bos_token_id": 0, "eos_token_id": [9, 8, 1], "pad_token_id": 4}
    del llama["<|eom_id|>"]
    assert generation_ids(LLAMA3, llama)["eos_token_id"] == [9, 1]
    chatml = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}  # SmolLM2's ids
    assert generation_ids(CHATML, chatml) == {"bos_token_id": None, "eos_token_id": [2, 0], "pad_token_id": 0}
    with pytest.raises(Exception, match="<|im_end|>"):
        generation_ids(CHATML, {"<|endoftext|>": 0})


@pytest.fixture(params=["llama3", "chatml"])
def folder(request, tmp_path, tiny_tokenizer_dir):
    """A tiny random Llama saved the way the defect left it: eos = the end of text only."""
    tok_dir = tiny_tokenizer_dir if request.param == "llama3" else build_chatml_tokenizer(tmp_path / "tok")
    out = build_tiny_llama(tmp_path / "model", tok_dir)
    end_of_text = LLAMA3.doc_end if request.param == "llama3" else CHATML.doc_end
    doc = json.loads((tok_dir / "tokenizer.json").read_text())
    eot_free = {t["content"]: t["id"] for t in doc["added_tokens"]}[end_of_text]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((out / name).read_text())
        cfg["eos_token_id"] = eot_free
        (out / name).write_text(json.dumps(cfg))
    return out


def test_stock_generate_runs_past_the_turn_before_and_stops_at_it_after(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    before = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False).eval()
    with pytest.raises(AssertionError):  # the check fails on the defective folder
        assert_stock_generate_stops_at_end_of_turn(before, tok)

    family, ids = describe_model_folder(folder)
    assert ids == expected_ids(tok) == published_ids(folder)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == ids["eos_token_id"]
    after = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False).eval()
    assert after.config.eos_token_id == ids["eos_token_id"]
    out = assert_stock_generate_stops_at_end_of_turn(after, tok)
    assert out[-1] == tok.convert_tokens_to_ids(family.eot)
    assert tok.chat_template  # the family's template (written by the tokenizer stage / factories) is there


def test_a_folder_without_a_template_gets_the_familys(tmp_path):
    tok_dir = build_chatml_tokenizer(tmp_path / "tok", num_lines=200)
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    family, ids = describe_model_folder(tok_dir)
    assert family is CHATML and (tok_dir / "chat_template.jinja").read_text() == CHATML.chat_template
    assert json.loads((tok_dir / "generation_config.json").read_text())["eos_token_id"] == ids["eos_token_id"]
    assert not (tok_dir / "config.json").exists()  # an adapter-like folder: no model config invented
