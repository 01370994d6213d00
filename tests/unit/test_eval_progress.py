"""Progress of the long eval passes: the BPB bar's total matches the passes really made; log lines without a TTY."""

from __future__ import annotations

import logging

import pytest
from dilforge_eval import bpb, progress


@pytest.mark.parametrize("window,stride,batch_size", [(16, 8, 2), (32, 31, 1), (64, 32, 8), (16, 16, 3)])
def test_bpb_bar_total_equals_forward_passes(tiny_llama_dir, window, stride, batch_size):
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    docs = ["Bakı Azərbaycanın paytaxtıdır.", "Xəzər dənizinin sahilində yerləşir və böyük şəhərdir."] * 3
    num_tokens = len(tok(bpb.pack(docs), add_special_tokens=False)["input_ids"])
    total = progress.num_bpb_batches(num_tokens, window, stride, batch_size)
    with progress.forward_progress(model, total, "bpb", tty=False) as bar:
        bpb.bits_per_byte(model, tok, docs, window, stride, batch_size)
    assert bar.n == total
    model(input_ids=torch.tensor([[1, 2, 3]]))  # the hook is gone after the pass
    assert bar.n == total


def test_log_lines_without_a_tty_carry_counts_and_eta(caplog, monkeypatch):
    clock = iter([0.0, 10.0, 20.0, 20.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="dilforge.eval"):
        bar = progress.bar(4, "generate sft", unit="answer", log_every_s=5, tty=False)
        bar.update(1)  # t=10: 1 of 4 at 0.1/s -> 30 s left
        bar.update(1)  # t=20: 2 of 4 at 0.1/s -> 20 s left
        bar.close()
    assert [r.getMessage() for r in caplog.records] == [
        "generate sft: 1/4 answer (25%), 10s elapsed, ETA 30s",
        "generate sft: 2/4 answer (50%), 20s elapsed, ETA 20s",
        "generate sft: 2/4 answer (50%), 20s elapsed, ETA 20s (done)",
    ]


def test_short_pass_logs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="dilforge.eval"):
        bar = progress.bar(3, "bpb base/flores", tty=False, log_every_s=60)
        bar.update(3)
        bar.close()
    assert not caplog.records
