"""Vocabulary transplant: kept rows are exact copies, new rows are means of the base pieces' rows."""

from __future__ import annotations

import factories
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def toks(tmp_path_factory, tiny_tokenizer_dir):
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
    transplant.transplant(model, rows, mapping, "mean_of_pieces", seed=0)
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


def test_mean_of_all_and_random(toks):
    from dilforge_cpt import transplant

    base, new = toks
    mapping = transplant.build_mapping(base, new)
    model = model_for(base.get_vocab_size(True), True)
    emb0 = model.get_input_embeddings().weight.detach().clone()
    rows = transplant.prepare(model, new.get_vocab_size(True))
    new_ids = [i for i, k in enumerate(mapping.kept) if k < 0]
    kept_ids = [(i, k) for i, k in enumerate(mapping.kept) if k >= 0]

    transplant.transplant(model, rows, mapping, "mean_of_all", seed=0)
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[new_ids[0]], emb0.mean(0), rtol=0, atol=1e-6)
    assert all(torch.equal(emb[i], emb0[k]) for i, k in kept_ids)

    transplant.transplant(model, rows, mapping, "random", seed=0)
    emb = model.get_input_embeddings().weight
    std = float(emb[new_ids].detach().std())
    assert 0.01 < std < 0.03  # initializer_range 0.02
    assert all(torch.equal(emb[i], emb0[k]) for i, k in kept_ids)


def test_same_vocab_detection(toks):
    from dilforge_cpt.transplant import same_vocab

    base, new = toks
    assert same_vocab(base, base) and not same_vocab(base, new)
