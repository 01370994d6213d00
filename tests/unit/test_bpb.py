"""The one BPB (dilforge_shared.bpb): stream layout per family, hand-computed values, chunked scoring
equal to unchunked, rank shares, FSDP2 on a one-process gloo group, and CPT validation and eval
reporting the same number for the same model, text and window."""

from __future__ import annotations

import math

import pytest
import torch
from dilforge_eval.measures import sliding_window_bpb
from dilforge_shared.bpb import build_stream, stream_nll
from factories import manual_nll

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_and_tok(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_dir), dtype=torch.float32, trust_remote_code=False
    ).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)


DOCS = [
    "Bakı Azərbaycanın paytaxtıdır və ən böyük şəhəridir.",
    "Salam!",
    "Xəzər dənizi sahilində yerləşən şəhər qədim tarixə malikdir və çox gözəldir.",
]


def stream_for(tok, docs=DOCS):
    from dilforge_eval.measures import encode_stream

    return encode_stream(tok, docs)


def test_streams_frame_documents_with_the_family_separators():
    llama = build_stream(["ab", "ç"], [[5, 6], [7]], bos=1, doc_end=2)
    assert llama.ids == [1, 5, 6, 2, 1, 7]
    assert llama.scored == [False, True, True, False, False, True]
    assert llama.num_bytes == 2 + 2 and llama.num_text_tokens == 3  # ç is two bytes; separators count none
    chatml = build_stream(["ab", "c"], [[5, 6], [7]], bos=None, doc_end=0)
    assert chatml.ids == [0, 5, 6, 0, 7] and chatml.scored == [False, True, True, False, True]


def test_uniform_model_costs_log2_vocab_bits_per_text_token(model_and_tok):
    import copy

    model, tok = model_and_tok
    uniform = copy.deepcopy(model)
    with torch.no_grad():
        for p in uniform.parameters():
            p.zero_()
    stream = stream_for(tok)
    res = sliding_window_bpb(uniform, stream, window=8, stride=3)
    n_text = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in DOCS)
    assert res.num_tokens == n_text == stream.num_text_tokens
    assert res.num_bytes == sum(len(d.encode()) for d in DOCS)
    vocab = uniform.get_output_embeddings().weight.shape[0]
    assert res.bpb == pytest.approx(n_text * math.log2(vocab) / res.num_bytes, rel=1e-6)


@pytest.mark.parametrize("window,stride", [(8, 3), (16, 8), (512, 256)])
def test_sliding_windows_score_each_text_token_once_separators_as_context(model_and_tok, window, stride):
    model, tok = model_and_tok
    stream = stream_for(tok)
    expected, n = manual_nll(model, stream, window, stride)
    nll, scored, _ = stream_nll(model, stream, window, stride, batch_size=3)
    assert scored == n == stream.num_text_tokens
    assert nll == pytest.approx(expected, rel=1e-6)


def test_chunked_log_probs_equal_unchunked_and_full_logits(model_and_tok, monkeypatch):
    from dilforge_shared import bpb

    model, tok = model_and_tok
    stream = stream_for(tok)
    one = stream_nll(model, stream, 16, 8, batch_size=4, chunk_positions=1)[0]
    whole = stream_nll(model, stream, 16, 8, batch_size=4, chunk_positions=10**6)[0]
    monkeypatch.setattr(bpb, "_decoder_and_head", lambda m: (None, None))  # the model's own full logits
    full = stream_nll(model, stream, 16, 8, batch_size=4, chunk_positions=10**6)[0]
    assert abs(one - whole) <= 1e-5 * abs(whole) and abs(full - whole) <= 1e-5 * abs(whole)


def test_chunked_path_never_builds_logits_for_the_whole_batch(model_and_tok):
    model, tok = model_and_tok
    head = model.get_output_embeddings()
    rows: list[int] = []
    handle = head.register_forward_hook(lambda m, a, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0]))
    try:
        stream_nll(model, stream_for(tok), 32, 16, batch_size=4, chunk_positions=5)
    finally:
        handle.remove()
    # the model's forward computes one position per row (logits_to_keep=1); the scoring hook at most 5
    assert rows and max(rows) <= 5


def test_rank_shares_sum_to_the_whole(model_and_tok):
    model, tok = model_and_tok
    stream = stream_for(tok)
    whole = stream_nll(model, stream, 8, 4, batch_size=2)
    parts = [stream_nll(model, stream, 8, 4, batch_size=2, rank=r, world=3) for r in range(3)]
    assert sum(p[1] for p in parts) == whole[1]
    # fp32 windows batched differently per rank: equal to fp32 rounding (a lost or doubled window is ~1/N off)
    assert sum(p[0] for p in parts) == pytest.approx(whole[0], rel=1e-6)


def test_fsdp2_one_process_gloo_gives_the_same_bpb_and_still_trains(model_and_tok):
    """FSDP2 gathers the root's embedding/norm/head in the model's own forward; the scoring hook sees them
    gathered, and the root is resharded afterwards so the next training step uses the live shards."""
    import copy
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model, tok = model_and_tok
    stream = stream_for(tok)
    expected = stream_nll(model, stream, 16, 8, batch_size=2, chunk_positions=7)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(model)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        got = stream_nll(sharded, stream, 16, 8, batch_size=2, chunk_positions=7)[0]
        assert got == pytest.approx(expected, rel=1e-5)
        sharded.train()
        opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
        x = torch.tensor([stream.ids[:12]])
        sharded(input_ids=x, labels=x).loss.backward()
        opt.step()
        after = stream_nll(sharded, stream, 16, 8, batch_size=2)[0]
        assert after != pytest.approx(expected, rel=1e-6)  # scoring sees the updated weights
    finally:
        dist.destroy_process_group()


def test_cpt_validation_and_eval_report_the_same_bpb(model_and_tok, tmp_path, tiny_llama_dir):
    from dilforge_cpt.config import CptConfig
    from dilforge_cpt.data import build_validation, load_tokenizer, special_ids
    from dilforge_cpt.runtime import Runtime
    from dilforge_cpt.validation import evaluate
    from dilforge_eval.measures import bits_per_byte
    from dilforge_shared.configs import DataSource

    model, tok = model_and_tok
    az, en = tmp_path / "az.txt", tmp_path / "en.txt"
    az.write_text("\n".join(DOCS) + "\n")
    en.write_text("The capital of France is Paris.\nIt rains.\n")
    fast = load_tokenizer(tiny_llama_dir)
    ids = special_ids(fast, "tok")
    sets = build_validation(
        [DataSource(uri=str(az), name="az"), DataSource(uri=str(en), name="en")],
        fast,
        ids,
        max_docs=10,
        endpoint_url=None,
    )
    config = CptConfig(
        scratch_model={},
        corpora=[{"uri": "a"}],
        validation=[{"uri": "b"}],
        seq_len=16,
        validation_stride=5,
        eval_micro_batch_size=3,
        phase1={"num_steps": 1},
    )
    cpt = evaluate(model, sets, config, Runtime())
    eval_az = bits_per_byte(model, tok, DOCS, window=16, stride=5, batch_size=2)
    eval_en = bits_per_byte(model, tok, ["The capital of France is Paris.", "It rains."], window=16, stride=5)
    assert cpt["val_bpb/az"] == pytest.approx(eval_az.bpb, rel=1e-6)
    assert cpt["val_bpb/en"] == pytest.approx(eval_en.bpb, rel=1e-6)
    total_bits = eval_az.bits + eval_en.bits
    assert cpt["val_bpb"] == pytest.approx(total_bits / (eval_az.num_bytes + eval_en.num_bytes), rel=1e-6)
    assert cpt["val_loss"] == pytest.approx(
        (eval_az.nll_nats + eval_en.nll_nats) / (eval_az.num_tokens + eval_en.num_tokens), rel=1e-6
    )


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_scores_in_eval_and_gives_the_model_its_own_mode_back_even_on_error(training):
    from dilforge_shared.bpb import eval_mode

    model = torch.nn.Sequential(torch.nn.Dropout(0.5))
    model.train(training)
    with eval_mode(model):
        assert not model.training and not model[0].training
    assert model.training is training and model[0].training is training
    with pytest.raises(RuntimeError, match="boom"), eval_mode(model):
        raise RuntimeError("boom")
    assert model.training is training
