"""Progress of the long eval passes: the BPB bar is fed by the BPB pass itself (`Progress.batches` as the
`on_batch` callback), so its total is the number of forward passes really made (the log cadence and ETA of the
shared helper are tested in test_shared_progress.py)."""

from __future__ import annotations

import pytest
from dilforge_eval import measures
from dilforge_shared.progress import Progress


@pytest.mark.parametrize("window,stride,batch_size", [(16, 8, 2), (32, 31, 1), (64, 32, 8), (16, 16, 3)])
def test_bpb_bar_total_equals_forward_passes(tiny_llama_dir, window, stride, batch_size):
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    docs = ["Bakı Azərbaycanın paytaxtıdır.", "Xəzər dənizinin sahilində yerləşir və böyük şəhərdir."] * 3
    forwards = []
    handle = model.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    with Progress("bpb", unit="batches", tty=False) as bar:
        measures.bits_per_byte(model, tok, docs, window, stride, batch_size, on_batch=bar.batches)
    handle.remove()
    assert bar.total == bar.n == len(forwards) > 0
