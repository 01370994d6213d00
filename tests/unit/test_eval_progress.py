"""Progress of the long eval passes: the BPB bar's total matches the passes really made (the log cadence and ETA
of the shared helper are tested in test_shared_progress.py)."""

from __future__ import annotations

import pytest
from dilforge_eval import measures, progress


@pytest.mark.parametrize("window,stride,batch_size", [(16, 8, 2), (32, 31, 1), (64, 32, 8), (16, 16, 3)])
def test_bpb_bar_total_equals_forward_passes(tiny_llama_dir, window, stride, batch_size):
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    docs = ["Bakı Azərbaycanın paytaxtıdır.", "Xəzər dənizinin sahilində yerləşir və böyük şəhərdir."] * 3
    num_tokens = len(tok("\n".join(docs), add_special_tokens=False)["input_ids"])
    total = progress.num_bpb_batches(num_tokens, window, stride, batch_size)
    with progress.forward_progress(model, total, "bpb", tty=False) as bar:
        measures.bits_per_byte(model, tok, docs, window, stride, batch_size)
    assert bar.n == total
    model(input_ids=torch.tensor([[1, 2, 3]]))  # the hook is gone after the pass
    assert bar.n == total
