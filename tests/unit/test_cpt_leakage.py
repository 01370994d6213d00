"""Vocabulary leakage (issue 24): the measure is the base model's BPB when the new rows take nothing and
exactly log(1 + new-row mass) more otherwise; the step-0 row and table. (The experimental
initialisations and the re-calibration are tested in test_bench_init_experiments.py.)"""

from __future__ import annotations

import math
import re

import factories
import pytest
import torch
from dilforge_shared.bpb import build_stream, stream_nll

torch.set_num_threads(1)

BASE_VOCAB, NUM_NEW = 300, 40


def extended_mapping():
    """Every base token kept at its own id, then NUM_NEW new tokens of 1-4 pieces each."""
    from dilforge_cpt.transplant import VocabMapping

    gen = torch.Generator().manual_seed(1)
    pieces = [[] for _ in range(BASE_VOCAB)]
    for i in range(NUM_NEW):
        pieces.append(torch.randint(10, BASE_VOCAB, (1 + i % 4,), generator=gen).tolist())
    return VocabMapping(list(range(BASE_VOCAB)) + [-1] * NUM_NEW, pieces)


def model_with_constant_direction(tied: bool, massive: float = 20.0):
    """A tiny Llama whose residual stream has one large coordinate in every embedding row (as real LLMs'
    "massive activations" do), so its final hidden states have a nearly constant direction."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(factories.tiny_llama_config(BASE_VOCAB, tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = massive
        if not tied:
            model.get_output_embeddings().weight.normal_(0, 0.5)
    return model


def hidden_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.get_decoder()(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)


def random_ids(seed: int, shape=(6, 48), high=BASE_VOCAB) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def leakage_by_hand(model, stream, kept: torch.Tensor) -> tuple[float, float]:
    """(full-softmax NLL, kept-rows NLL) of a stream short enough for one window, from full logits."""
    ids = torch.tensor(stream.ids)
    scored = torch.tensor(stream.scored)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].double()
    targets, mask = ids[1:], scored[1:]
    full = -(logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1))[mask].sum()
    restricted = logits.masked_fill(~kept, float("-inf")).log_softmax(-1)
    return float(full), float(-(restricted.gather(1, targets[:, None]).squeeze(1))[mask].sum())


@pytest.mark.parametrize("tied", [True, False])
def test_kept_rows_nll_is_the_base_models_and_the_gap_is_the_new_rows_mass(tied):
    from dilforge_cpt import transplant

    model = model_with_constant_direction(tied)
    docs = ["x" * 20, "y" * 15]
    enc = [random_ids(3, (20,), 200).tolist(), random_ids(4, (15,), 200).tolist()]
    stream = build_stream(docs, enc, None, 0)
    base_nll, count, _ = stream_nll(model, stream, 64, 32)
    mapping = extended_mapping()
    rows = transplant.prepare(model, BASE_VOCAB + NUM_NEW)
    transplant.transplant(model, rows, mapping)
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    (full, restricted), count2, _ = stream_nll(model, stream, 64, 32, kept=kept)
    assert count2 == count
    assert restricted == pytest.approx(base_nll, rel=1e-6)  # the base model's own NLL, no second model
    assert full > restricted  # the new rows took mass
    by_hand = leakage_by_hand(model, stream, kept)
    assert full == pytest.approx(by_hand[0], rel=1e-6) and restricted == pytest.approx(by_hand[1], rel=1e-6)


def test_base_to_new_ids_and_probe_refusal():
    from dilforge_cpt.leakage import base_to_new_ids
    from dilforge_cpt.transplant import VocabMapping

    assert base_to_new_ids(VocabMapping([2, 0, 1, -1], [[], [], [], [0, 1]]), 3) == [1, 2, 0]
    assert base_to_new_ids(VocabMapping([0, -1, 2], [[], [0], []]), 3) is None  # base token 1 was dropped


def test_step0_row_and_table():
    from dilforge_cpt.leakage import format_table, step0_row

    row = step0_row(
        {"en": 1.1, "az": 2.0}, {"en": {"bpb_base_tokenization": 1.02, "bpb_kept_rows": 1.0, "leakage": 0.02}}
    )
    assert row["en"]["extended_vs_base"] == pytest.approx(1.1)
    assert row["en"]["base_tokenization_vs_base"] == pytest.approx(1.02)
    assert row["az"] == {"bpb_extended": 2.0}
    text = re.sub(r" *\| *", " | ", format_table({"offset": row}))  # one space around each cell
    assert "| offset | en | 1.0000 | 1.1000 | 1.1000 | 1.0200 | 1.0200 |" in text
    assert "| offset | az | — | 2.0000 | — | — | — |" in text  # no base-model figure for that set
    assert math.isfinite(row["en"]["bpb_base_model"])
