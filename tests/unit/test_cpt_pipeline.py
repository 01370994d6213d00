"""The CPT loop's pipelining: batches prefetched on a thread without moving the sampler state a
checkpoint saves, host reads only on log steps with a non-finite step still stopping at the last
good state, and `compile: true` choosing only Liger's fused linear cross entropy and capturing the
decoder layers with no graph break."""

from __future__ import annotations

import json
import threading
import time

import factories
import numpy as np
import pytest
import torch
from dilforge_cpt.config import CptConfig
from dilforge_shared.contract import Terminated
from dilforge_shared.errors import DilforgeError

torch.set_num_threads(1)
VOCAB, SEQ = 64, 16


def config(**update) -> CptConfig:
    return factories.tiny_cpt_config(**update)


def packed(tmp_path):
    from dilforge_cpt.data import PackedData, TokenFile

    files = []
    for i, n in enumerate((40 * SEQ, 25 * SEQ)):
        path = tmp_path / f"c{i}.u32"
        if not path.exists():
            np.random.default_rng(i).integers(0, VOCAB, n).astype(np.uint32).tofile(path)
        files.append(TokenFile(path, n, 1, f"c{i}"))
    return PackedData(files, [1.0, 0.5], SEQ, seed=0)


# ---- 1. prefetching ------------------------------------------------------------------------
def test_prefetcher_yields_the_same_steps_and_rewinds_the_sampler_to_what_was_consumed(tmp_path):
    from dilforge_cpt.data import Prefetcher

    direct = packed(tmp_path)
    expected = [(direct.sampler.state_dict(), direct.next_step(8, 2, 1, 2)) for _ in range(5)]
    data = packed(tmp_path)
    prefetch = Prefetcher(data, 8, 2, 1, 2, torch.device("cpu"), depth=2)
    try:
        for before, arrays in expected[:3]:
            batches, sampler_before, _ = prefetch.next()
            assert sampler_before == before
            assert len(batches) == len(arrays) == 2
            for got, want in zip(batches, arrays, strict=False):
                assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(want))
        time.sleep(0.2)  # the worker runs ahead, bounded by the queue: 2 queued + 1 in hand at most
        assert 3 * 8 < data.sampler.position <= 6 * 8
        assert prefetch.consumed == expected[3][0]
    finally:
        prefetch.close()
    assert data.sampler.state_dict() == expected[3][0]  # back to exactly what the loop consumed
    assert not any(t.name == "cpt-prefetch" and t.is_alive() for t in threading.enumerate())


# ---- 2. host reads on log steps only -------------------------------------------------------
def run(tmp_path, root, cfg: CptConfig, stop_at=None):
    from dilforge_cpt.data import ValidationSet
    from dilforge_shared.bpb import build_stream
    from test_cpt_loop import train

    torch.manual_seed(0)
    data = packed(tmp_path)
    val = [ValidationSet("v", build_stream(["abc"], [[1, 2, 3, 4, 5]], bos=0, doc_end=63))]
    model, state = train(cfg, root, data, val, stop_at)
    return model, state, data


def test_reading_back_only_on_log_steps_trains_exactly_like_reading_every_step(tmp_path, monkeypatch):
    from dilforge_cpt import loop

    settled = []
    real = loop.settle

    def recording(pending, state, *args):
        settled.append([p.step for p in pending])
        return real(pending, state, *args)

    monkeypatch.setattr(loop, "settle", recording)
    every_model, every_state, _ = run(tmp_path, tmp_path / "every", config(log_every=1))
    assert settled == [[s] for s in range(1, 8)]
    settled.clear()
    lazy_model, lazy_state, data = run(tmp_path, tmp_path / "lazy", config(log_every=2))
    # steps 1-2 read at 2, 3 at the phase end, 4 at 4, 5-6 at 6, 7 at the end: never on a non-log step
    assert settled == [[1, 2], [3], [4], [5, 6], [7]]
    assert [h["step"] for h in lazy_state.history] == [2, 3, 4, 6, 7]
    assert lazy_state.sampler == every_state.sampler == data.sampler.state_dict()
    by_step = {h["step"]: h["loss"] for h in every_state.history}
    assert [h["loss"] for h in lazy_state.history] == [by_step[h["step"]] for h in lazy_state.history]
    for (name, a), b in zip(every_model.state_dict().items(), lazy_model.state_dict().values(), strict=False):
        assert torch.equal(a, b), name


def test_a_non_finite_step_between_log_steps_stops_at_the_last_good_state(tmp_path, monkeypatch):
    """Step 5 (phase 2) gets an inf gradient; log_every 3 reads it back at step 6. The fused optimizer
    skipped steps 5 and 6 on the device, so the checkpoint at step 4 equals a run stopped at step 4."""
    from dilforge_cpt import loop

    with pytest.raises(Terminated, match="stopped by SIGTERM at step 4") as stopped:
        run(tmp_path, tmp_path / "ref", config(log_every=3), stop_at=4)
    ref_model = stopped.value.model
    real, calls = loop.run_step, []

    def poisoned(model, *args, **kwargs):
        calls.append(1)
        hook = None
        if len(calls) == 5:
            hook = model.model.layers[0].mlp.down_proj.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        try:
            return real(model, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()

    monkeypatch.setattr(loop, "run_step", poisoned)
    with pytest.raises(
        DilforgeError,
        match=r"non-finite gradient norm \(inf; .*\) at step 5 \(phase 2, lr [0-9e.+-]+\)"
        r".*checkpoint saved at step 4",
    ) as failed:
        run(tmp_path, tmp_path / "bad", config(log_every=3))
    assert len(calls) == 6  # step 6 ran (no host read in between) but did not step either
    saved = json.loads((tmp_path / "bad" / "step-00000004" / "state.json").read_text())
    ref = json.loads((tmp_path / "ref" / "step-00000004" / "state.json").read_text())
    assert saved["step"] == 4 and saved["step_in_phase"] == 1 and saved["tokens_seen"] == 4 * 4 * SEQ
    assert saved["sampler"] == ref["sampler"]
    for (name, a), b in zip(ref_model.state_dict().items(), failed.value.model.state_dict().values(), strict=False):
        assert torch.equal(a, b), name


# ---- 3. compile with Liger -----------------------------------------------------------------
def test_compile_selects_only_the_fused_linear_cross_entropy():
    from dilforge_cpt.sharding import liger_kernels

    assert liger_kernels(config()) == {
        "rope": True,
        "rms_norm": True,
        "swiglu": True,
        "fused_linear_cross_entropy": True,
    }
    assert liger_kernels(config(compile=True)) == {
        "rope": False,
        "rms_norm": False,
        "swiglu": False,
        "fused_linear_cross_entropy": True,
    }


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_compiled_layers_capture_graphs_without_a_break(monkeypatch, checkpointing):
    """The stage's own layout (shard_model) with compile on: forward + backward through a tiny Llama
    captures the decoder layers with no graph break (aot_eager: capture does not depend on the backend)."""
    from dilforge_cpt import sharding
    from dilforge_cpt.runtime import Runtime
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(sharding, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = config(compile=True, activation_checkpointing=checkpointing)
    model = sharding.shard_model(LlamaForCausalLM(factories.tiny_llama_config(VOCAB)), cfg, Runtime())
    x = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (2, SEQ)))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
    try:
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] >= 1
        assert all(p.grad is not None for p in model.parameters())
    finally:
        torch._dynamo.reset()


def test_the_graph_break_count_sees_a_compiler_disabled_rope(monkeypatch):
    """What Liger's RoPE does under compile (a `torch.compiler.disable`d dispatch) shows up as graph
    breaks in the same count, so the test above can fail."""
    import transformers.models.llama.modeling_llama as modeling
    from dilforge_cpt import sharding
    from dilforge_cpt.runtime import Runtime
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(sharding, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", torch.compiler.disable(modeling.apply_rotary_pos_emb))
    torch._dynamo.reset()
    counters.clear()
    model = sharding.shard_model(LlamaForCausalLM(factories.tiny_llama_config(VOCAB)), config(compile=True), Runtime())
    x = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (2, SEQ)))
    try:
        model(input_ids=x, labels=x).loss.backward()
        assert sum(counters["graph_break"].values()) >= 2  # at least one per layer
    finally:
        torch._dynamo.reset()


def test_fused_adamw_skips_a_non_finite_step_on_the_device_leaving_weights_and_moments():
    """The CPU side of tests/gpu/test_cpt_pipeline_gpu.py: found_inf keeps parameters, moments and the
    step count as they were, for the bad step and for a good step while the loop's flag is latched."""
    from cpt_steps import check_skip_on_device

    check_skip_on_device(torch.device("cpu"))
