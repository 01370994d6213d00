"""Bits per byte: hand-computed values, window bookkeeping, and invariance to document boundaries."""

from __future__ import annotations

import math

import pytest

import torch
torch.set_num_threads(1)

from dilforge_eval import bpb as B


@pytest.fixture(scope="module")
def model_and_tok(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.mark.parametrize("n,window,stride", [(1, 8, 4), (2, 8, 4), (9, 8, 8), (40, 8, 3), (40, 8, 1), (17, 16, 16),
                                             (100, 32, 16)])
def test_window_plan_scores_every_token_once_with_enough_context(n, window, stride):
    plans = B.window_plan(n, window, stride)
    scored = [t for b, e, s in plans for t in range(s, e)]
    assert scored == list(range(1, n))
    for i, (b, e, s) in enumerate(plans):
        assert e - b <= window and b < s <= e
        if i > 0:  # after the first window every target sees >= window - stride tokens of context (>= 1)
            assert s - b >= max(1, window - stride)
            assert s == plans[i - 1][1]


def test_window_plan_rejects_bad_stride():
    with pytest.raises(ValueError):
        B.window_plan(10, 4, 5)
    with pytest.raises(ValueError):
        B.window_plan(10, 1, 1)


def test_uniform_model_gives_hand_computed_bpb(model_and_tok):
    """Zero weights → all logits 0 → every token costs log2(V) bits: BPB = tokens * log2(V) / bytes."""
    model, tok = model_and_tok
    import copy
    uniform = copy.deepcopy(model)
    with torch.no_grad():
        for p in uniform.parameters():
            p.zero_()
    docs = ["Azərbaycan dili", "Bakı şəhəri gözəldir."]
    text = "Azərbaycan dili\nBakı şəhəri gözəldir."
    n_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    vocab = uniform.get_output_embeddings().weight.shape[0]
    res = B.bits_per_byte(uniform, tok, docs, window=8, stride=3)
    # 15 + 1 + 21 characters; ə×5, ı, ş, ö take two bytes each: 37 + 7 = 44
    assert res.num_bytes == len(text.encode("utf-8")) == 44
    assert res.num_tokens == n_tokens
    assert res.bpb == pytest.approx(n_tokens * math.log2(vocab) / 44, rel=1e-6)  # float32 log-softmax


def test_bpb_equals_single_forward_sum(model_and_tok):
    """With a window covering the text, BPB is the plain sum of -log p(token | prefix) over bytes."""
    model, tok = model_and_tok
    docs = ["Qız yoldaşına namə yazdı.", "Sabah biz muzeyə gedəcəyik."]
    ids = B.encode_stream(tok, B.pack(docs))
    assert ids[0] == tok.bos_token_id
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    nll = -sum(logp[i - 1, ids[i]].item() for i in range(1, len(ids)))
    expected = nll / math.log(2) / len(B.pack(docs).encode())
    for window, stride in ((len(ids), 1), (512, 256)):
        assert B.bits_per_byte(model, tok, docs, window, stride).bpb == pytest.approx(expected, rel=1e-6)


def test_sliding_window_matches_manual_truncated_context(model_and_tok):
    """A small window: each token's NLL is computed from exactly the window the plan gives it."""
    model, tok = model_and_tok
    ids = B.encode_stream(tok, "Azərbaycan Respublikasının Konstitusiyası xalqın iradəsini ifadə edir.")
    window, stride = 8, 3
    nll = 0.0
    with torch.no_grad():
        for b, e, s in B.window_plan(len(ids), window, stride):
            logp = torch.log_softmax(model(torch.tensor([ids[b:e]])).logits[0].double(), -1)
            nll -= sum(logp[t - 1 - b, ids[t]].item() for t in range(s, e))
    got, scored, _ = B.score_ids(model, ids, window, stride, batch_size=3)
    assert scored == len(ids) - 1
    assert got == pytest.approx(nll, rel=1e-5)


def test_bpb_unchanged_when_documents_are_split_differently(model_and_tok):
    """Documents are one newline-joined stream scored by sliding windows, so where the document boundaries
    fall (within the window or across several windows) does not change BPB; scoring each document on its
    own would, since each would restart its context."""
    model, tok = model_and_tok
    lines = ["Bakı gözəl şəhərdir.", "Xəzər dənizi sahildədir.", "Qış soyuq keçdi.", "Yaz gəlir."]
    window, stride = 16, 8  # several windows over the ~40-token text
    splits = [["\n".join(lines)], ["\n".join(lines[:1]), "\n".join(lines[1:])],
              ["\n".join(lines[:3]), lines[3]], lines]
    results = [B.bits_per_byte(model, tok, docs, window, stride) for docs in splits]
    assert results[0].num_tokens > 2 * window
    assert len({r.num_bytes for r in results}) == 1
    assert all(abs(r.bpb - results[0].bpb) < 1e-9 for r in results)
    separate = [B.bits_per_byte(model, tok, [line], window, stride) for line in lines]
    per_doc = sum(r.bpb * r.num_bytes for r in separate) / sum(r.num_bytes for r in separate)
    assert abs(per_doc - results[0].bpb) > 1e-4  # the invariance comes from streaming, not from the text
    d = B.bits_per_byte(model, tok, [" ".join(lines)], window, stride)
    assert d.bpb != results[0].bpb  # the separator is text too: different text, different value


def test_default_window_respects_model_limit(model_and_tok):
    model, _ = model_and_tok
    assert B.default_window(model, None) == 2048
    assert B.default_window(model, 100) == 100
    assert B.default_window(model, 10_000) == model.config.max_position_embeddings
