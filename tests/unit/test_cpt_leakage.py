"""Vocabulary leakage (issue 24): the measure is the base model's BPB when the new rows take nothing and
exactly log(1 + new-row mass) more otherwise; the offset/calibrated initialisations give the intended
logits; the loop records leakage at every validation and its counter-measure pulls it back."""

from __future__ import annotations

import math

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
    transplant.transplant(model, rows, mapping, "mean_of_pieces", seed=0)
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    (full, restricted), count2, _ = stream_nll(model, stream, 64, 32, kept=kept)
    assert count2 == count
    assert restricted == pytest.approx(base_nll, rel=1e-6)  # the base model's own NLL, no second model
    assert full > restricted  # the new rows took mass
    by_hand = leakage_by_hand(model, stream, kept)
    assert full == pytest.approx(by_hand[0], rel=1e-6) and restricted == pytest.approx(by_hand[1], rel=1e-6)


def test_fit_directions_finds_the_constant_and_the_language_direction():
    from dilforge_cpt import transplant

    gen = torch.Generator().manual_seed(0)
    n, d = 2000, 32
    hidden = torch.randn(n, d, generator=gen)
    hidden[:, 0] = 8.0 + 0.01 * torch.randn(n, generator=gen)  # nearly constant coordinate
    is_retain = torch.arange(n) % 2 == 0
    hidden[:, 1] = 0.1 * torch.randn(n, generator=gen) + 3.0 * is_retain  # retain text apart along one axis
    const, retain = transplant.fit_directions(hidden, is_retain)
    torch.testing.assert_close(hidden @ const, torch.ones(n), atol=0.02, rtol=0)
    score = hidden @ retain
    assert float(score[is_retain].mean() - score[~is_retain].mean()) == pytest.approx(1.0, abs=0.02)
    assert transplant.fit_directions(hidden, torch.zeros(n, dtype=torch.bool))[1] is None


@pytest.mark.parametrize("tied", [True, False])
def test_offset_init_lowers_each_new_logit_by_ln_pieces(tied):
    """On hidden states it was not fitted on, a new row's logit under `offset` is its mean-of-pieces
    logit minus ln(number of pieces), within 1 %; kept rows are untouched; untied: the input rows stay
    the mean of the pieces."""
    from dilforge_cpt import transplant

    model = model_with_constant_direction(tied)
    mapping = extended_mapping()
    rows = transplant.prepare(model, BASE_VOCAB + NUM_NEW)
    transplant.transplant(model, rows, mapping, "mean_of_pieces", seed=0)
    mean_rows = model.get_output_embeddings().weight.detach().clone()
    mean_inputs = model.get_input_embeddings().weight.detach().clone()
    const, _ = transplant.fit_directions(hidden_of(model, random_ids(5)), None)
    transplant.transplant(model, rows, mapping, "offset", seed=0, calibration=transplant.Calibration(const))
    head = model.get_output_embeddings().weight.detach()
    fresh = hidden_of(model, random_ids(6))  # kept tokens only: same hidden states as before
    new = torch.tensor([k < 0 for k in mapping.kept])
    lnk = torch.log(transplant.num_pieces(mapping)[new])
    shift = fresh @ head[new].T - fresh @ mean_rows[new].T
    torch.testing.assert_close(shift, -lnk[None, :].expand_as(shift), atol=0.01 * float(lnk.max()), rtol=0)
    assert torch.equal(head[~new], mean_rows[~new])
    if not tied:
        assert torch.equal(model.get_input_embeddings().weight.detach(), mean_inputs)


def test_large_negative_calibrated_offset_makes_base_tokenisation_equal_the_base_model():
    """The leakage-free limit: new rows moved far down along the constant direction give base-tokenised
    text the base model's BPB (the measure is exact, not an estimate)."""
    from dilforge_cpt import transplant

    model = model_with_constant_direction(True)
    docs = ["a" * 30]
    stream = build_stream(docs, [random_ids(7, (30,), 200).tolist()], None, 0)
    base_nll = stream_nll(model, stream, 64, 32)[0]
    mapping = extended_mapping()
    rows = transplant.prepare(model, BASE_VOCAB + NUM_NEW)
    transplant.transplant(model, rows, mapping, "mean_of_pieces", seed=0)
    const, _ = transplant.fit_directions(hidden_of(model, random_ids(8)), None)
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    leaky = stream_nll(model, stream, 64, 32, kept=kept)[0][0]
    transplant.transplant(
        model, rows, mapping, "calibrated", seed=0, calibration=transplant.Calibration(const, alpha=0.0, beta=-30.0)
    )
    full, restricted = stream_nll(model, stream, 64, 32, kept=kept)[0]
    assert leaky - base_nll > 1e-3
    assert full == pytest.approx(base_nll, rel=1e-6) and restricted == pytest.approx(base_nll, rel=1e-6)


def test_fit_offsets_recovers_the_offsets_that_generated_the_text():
    """Targets drawn from a softmax whose new rows carry known (alpha, beta, gamma): the fit (with the
    hidden states fixed) finds them back; mass on retain text is given back through gamma."""
    from dilforge_cpt import transplant

    gen = torch.Generator().manual_seed(0)
    n, d = 6000, 16
    mapping = extended_mapping()
    vocab = BASE_VOCAB + NUM_NEW
    head = torch.randn(vocab, d, generator=gen) * 0.3
    hidden = torch.randn(n, d, generator=gen)
    hidden[:, 0] = 5.0
    is_retain = torch.arange(n) % 2 == 0
    hidden[is_retain, 1] += 2.0
    const, retain = transplant.fit_directions(hidden, is_retain)
    truth = transplant.Calibration(const, retain, alpha=1.5, beta=0.5, gamma=-2.0)
    logits = hidden @ transplant.offset_rows(head, mapping, truth).T
    targets = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
    fit = transplant.fit_offsets(transplant.Sample(hidden, targets, is_retain), head, mapping, const, retain)
    assert fit.alpha == pytest.approx(1.5, abs=0.25)
    assert fit.beta == pytest.approx(0.5, abs=0.25)
    assert fit.gamma == pytest.approx(-2.0, abs=0.4)


def test_calibration_retain_weight_moves_the_fit_toward_the_retain_text():
    """Retain text drawn with the new rows far down (beta -3), the other text with them up (beta +1), and no
    retain direction to tell them apart: the shared beta lands between, and toward -3 the more the retain
    positions weigh (calibration_retain_weight)."""
    from dilforge_cpt import transplant

    gen = torch.Generator().manual_seed(1)
    n, d = 6000, 16
    mapping = extended_mapping()
    head = torch.randn(BASE_VOCAB + NUM_NEW, d, generator=gen) * 0.3
    hidden = torch.randn(n, d, generator=gen)
    hidden[:, 0] = 5.0
    is_retain = torch.arange(n) % 2 == 0
    const, _ = transplant.fit_directions(hidden, None)
    targets = torch.empty(n, dtype=torch.long)
    for mask, beta in ((is_retain, -3.0), (~is_retain, 1.0)):
        rows = transplant.offset_rows(head, mapping, transplant.Calibration(const, alpha=0.0, beta=beta))
        targets[mask] = torch.multinomial((hidden[mask] @ rows.T).softmax(-1), 1, generator=gen).squeeze(1)
    sample = transplant.Sample(hidden, targets, is_retain)
    betas = [transplant.fit_offsets(sample, head, mapping, const, None, retain_weight=w).beta for w in (0.1, 1, 10)]
    assert -3.0 < betas[2] < betas[1] < betas[0] < 1.0, betas
    assert betas[2] < -1.5 and betas[0] > 0.5, betas


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
    text = format_table({"offset": row})
    assert "| offset | en | 1.0000 | 1.1000 | 1.1000 | 1.0200 | 1.0200 |" in text
    assert math.isfinite(row["en"]["bpb_base_model"])


class FakeFile:
    def __init__(self, label: str, num_windows: int):
        self.label, self.num_windows = label, num_windows

    def windows(self, seq_len: int) -> int:
        return self.num_windows


class FakeData:
    """Two corpora of windows: 'az' uses the new tokens, 'en' (the retain corpus) only base tokens."""

    def __init__(self, seq_len: int):
        self.files = [FakeFile("az", 4), FakeFile("en", 4)]
        self.seq_len = seq_len

    def window(self, corpus: int, index: int):
        high = BASE_VOCAB + NUM_NEW if corpus == 0 else BASE_VOCAB
        return random_ids(100 + 10 * corpus + index, (self.seq_len,), high).numpy()


def test_loop_counter_measure_recalibrates_when_leakage_returns():
    """Leakage on the English set above the tolerance at a validation: the new output rows are
    re-calibrated (fitted offsets on the current hidden states) and the leakage measured again is lower;
    below the tolerance nothing changes."""
    from types import SimpleNamespace

    from dilforge_cpt import transplant
    from dilforge_cpt.data import ValidationSet
    from dilforge_cpt.leakage import LeakageProbe
    from dilforge_cpt.loop import TrainState, track_leakage
    from dilforge_cpt.runtime import Runtime

    model = model_with_constant_direction(False)
    mapping = extended_mapping()
    rows = transplant.prepare(model, BASE_VOCAB + NUM_NEW)
    transplant.transplant(model, rows, mapping, "mean_of_pieces", seed=0)
    with torch.no_grad():  # "training" made the new rows loud everywhere: leakage returns
        new = torch.tensor([k < 0 for k in mapping.kept])
        model.get_output_embeddings().weight[new] *= 6.0
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    en = build_stream(["e" * 40], [random_ids(9, (40,), BASE_VOCAB).tolist()], None, 0)
    probe = LeakageProbe([ValidationSet("en", en)], kept, mapping)
    config = SimpleNamespace(
        seq_len=32,
        validation_stride=None,
        eval_micro_batch_size=None,
        micro_batch_size=4,
        retain_corpora=["en"],
        calibration_num_windows=8,
        leakage_sets=["en"],
        leakage_tolerance=0.01,
    )
    setup = SimpleNamespace(config=config, rt=Runtime(), leakage_probe=probe)
    state = TrainState()
    assert track_leakage(model, FakeData(32), setup, state, step=5)
    entry = state.leakage[-1]
    before, after = entry["sets"]["en"]["leakage"], entry["sets_after"]["en"]["leakage"]
    assert before > 0.01 and after < before / 2, (before, after)
    assert entry["recalibrated"]["over"] == {"en": before}
    head = model.get_output_embeddings().weight.detach().clone()
    config.leakage_tolerance = 10.0
    assert not track_leakage(model, FakeData(32), setup, state, step=6)
    assert "recalibrated" not in state.leakage[-1]
    assert torch.equal(model.get_output_embeddings().weight.detach(), head)
