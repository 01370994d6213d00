"""Vocabulary transplant: kept rows are exact copies, new rows are means of the base pieces' rows."""

from __future__ import annotations

import factories
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def toks(tmp_path_factory, tiny_tokenizer_dir):
    return base_and_new(tmp_path_factory, tiny_tokenizer_dir)


def base_and_new(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny base tokenizer and a 600-token one learned on other text."""
    from dilforge_cpt.data import load_tokenizer

    new_dir = factories.build_tokenizer(tmp_path_factory.mktemp("t600") / "tok", vocab_size=600, num_lines=3000)
    return load_tokenizer(tiny_tokenizer_dir), load_tokenizer(new_dir)


def model_for(vocab: int, tied: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(factories.tiny_llama_config(vocab, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [True, False])
def test_mean_of_pieces_rows(toks, tied):
    from dilforge_cpt import transplant

    base, new = toks
    model = model_for(base.get_vocab_size(True), tied)
    emb0 = model.get_input_embeddings().weight.detach().clone()
    head0 = model.get_output_embeddings().weight.detach().clone()
    mapping = transplant.build_mapping(base, new)
    rows = transplant.prepare(model, new.get_vocab_size(True))
    transplant.transplant(model, rows, mapping)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    assert emb.shape[0] == new.get_vocab_size(True) == 856
    assert (head is emb) == tied

    base_vocab = base.get_vocab(with_added_tokens=True)
    kept = new_tokens = 0
    for token, i in new.get_vocab(with_added_tokens=True).items():
        if token in base_vocab:
            kept += 1
            assert torch.equal(emb[i], emb0[base_vocab[token]]), token
            if not tied:
                assert torch.equal(head[i], head0[base_vocab[token]]), token
            continue
        # an independent path: decode the new token to text and encode it with the base tokenizer
        text = new.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 piece: its bytes are not text on their own
            continue
        pieces = base.encode(text, add_special_tokens=False).ids
        new_tokens += 1
        torch.testing.assert_close(emb[i], emb0[pieces].mean(0), rtol=0, atol=1e-6)
        if not tied:
            torch.testing.assert_close(head[i], head0[pieces].mean(0), rtol=0, atol=1e-6)
    assert kept == mapping.num_kept and kept > 256  # the 256 specials + byte symbols + shared merges
    assert new_tokens > 20


def test_same_vocab_detection(toks):
    from dilforge_cpt.transplant import same_vocab

    base, new = toks
    assert same_vocab(base, base) and not same_vocab(base, new)


def test_a_base_model_without_a_tokenizer_is_named_as_configured(tmp_path):
    """The error names what the user wrote as base_model, not the local cache folder it was fetched to."""
    from types import SimpleNamespace

    from dilforge_cpt.model_init import BaseModel, load_model
    from dilforge_shared.errors import InputError

    tok = SimpleNamespace(get_vocab_size=lambda with_added_tokens: 8)
    with pytest.raises(InputError, match=r"^s3://models/base: base_model: no tokenizer.json beside the weights"):
        load_model(None, BaseModel(tmp_path, "s3://models/base"), tok, None, None)
