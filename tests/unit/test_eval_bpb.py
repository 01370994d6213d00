"""Eval's bits per byte: the shared definition (tests/unit/test_bpb.py) through a transformers tokenizer;
window bookkeeping, the summary row, and the default window."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

from dilforge_eval import measures as eval_bpb  # noqa: E402 - after set_num_threads, before any torch work
from dilforge_shared.bpb import window_plan  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tok(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_dir), dtype=torch.float32, trust_remote_code=False
    ).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)


@pytest.mark.parametrize(
    "n,window,stride", [(1, 8, 4), (2, 8, 4), (9, 8, 8), (40, 8, 3), (40, 8, 1), (17, 16, 16), (100, 32, 16)]
)
def test_window_plan_scores_every_token_once_with_enough_context(n, window, stride):
    plans = window_plan(n, window, stride)
    scored = [t for b, e, s in plans for t in range(s, e)]
    assert scored == list(range(1, n))
    for i, (b, e, s) in enumerate(plans):
        assert e - b <= window and b < s <= e
        if i > 0:  # after the first window every target sees >= window - stride tokens of context (>= 1)
            assert s - b >= max(1, window - stride)
            assert s == plans[i - 1][1]


def test_window_plan_rejects_bad_stride():
    with pytest.raises(ValueError):
        window_plan(10, 4, 5)
    with pytest.raises(ValueError):
        window_plan(10, 1, 1)


def test_eval_bpb_frames_documents_by_the_tokenizers_family_and_matches_a_hand_computation(model_and_tok):
    import math

    from factories import manual_nll

    model, tok = model_and_tok
    docs = ["Qız yoldaşına namə yazdı.", "Sabah biz muzeyə gedəcəyik."]
    stream = eval_bpb.encode_stream(tok, docs)
    bos, end = tok.convert_tokens_to_ids("<|begin_of_text|>"), tok.convert_tokens_to_ids("<|end_of_text|>")
    first, second = (tok(d, add_special_tokens=False)["input_ids"] for d in docs)
    assert stream.ids == [bos, *first, end, bos, *second]  # Llama 3's pre-training framing
    assert stream.num_bytes == eval_bpb.text_bytes(docs) == len(docs[0].encode()) + len(docs[1].encode())
    res = eval_bpb.bits_per_byte(model, tok, docs, window=8, stride=3)
    nll, n = manual_nll(model, stream, 8, 3)
    assert res.num_tokens == n == len(first) + len(second)  # separators are context, never scored
    assert res.bpb == pytest.approx(nll / math.log(2) / stream.num_bytes, rel=1e-6)
    row = eval_bpb.bpb_summary(res)
    assert row.bpb == round(res.bpb, 5) and row.num_tokens == n and row.num_bytes == stream.num_bytes


def test_bpb_changes_with_the_text_not_with_how_it_is_batched(model_and_tok):
    model, tok = model_and_tok
    lines = ["Bakı gözəl şəhərdir.", "Xəzər dənizi sahildədir.", "Qış soyuq keçdi.", "Yaz gəlir."]
    ref = eval_bpb.bits_per_byte(model, tok, lines, 16, 8, batch_size=1).bpb
    assert eval_bpb.bits_per_byte(model, tok, lines, 16, 8, batch_size=5).bpb == pytest.approx(ref, rel=1e-6)
    assert eval_bpb.bits_per_byte(model, tok, lines[::-1], 16, 8).bpb != pytest.approx(ref, rel=1e-6)


def test_default_window_respects_model_limit(model_and_tok):
    model, _ = model_and_tok
    assert eval_bpb.default_window(model, None) == 2048
    assert eval_bpb.default_window(model, 100) == 100
    assert eval_bpb.default_window(model, 10_000) == model.config.max_position_embeddings
