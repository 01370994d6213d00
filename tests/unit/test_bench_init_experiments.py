"""bench/init_experiments.py: the CPT initialisations the stage does not train (mean of all rows, random,
logit offsets, calibrated and fitted output rows) and the leakage re-calibration, kept reproducible for
bench/leakage.py and bench/leakage_cpt.py: the offset/calibrated initialisations give the intended
logits, the fitted rows' batched solve equals a dense reference and leaks less than mean-of-pieces, and
the re-calibration pulls returning leakage back."""

from __future__ import annotations

import factories
import pytest
import torch
from dilforge_shared.bpb import build_stream, stream_nll
from test_cpt_leakage import (
    BASE_VOCAB,
    NUM_NEW,
    extended_mapping,
    hidden_of,
    model_with_constant_direction,
    random_ids,
)
from test_cpt_transplant import base_and_new, model_for

torch.set_num_threads(1)

exp = factories.load_bench("init_experiments")


@pytest.fixture(scope="module")
def toks(tmp_path_factory, tiny_tokenizer_dir):
    return base_and_new(tmp_path_factory, tiny_tokenizer_dir)


def test_fit_directions_finds_the_constant_and_the_language_direction():

    gen = torch.Generator().manual_seed(0)
    n, d = 2000, 32
    hidden = torch.randn(n, d, generator=gen)
    hidden[:, 0] = 8.0 + 0.01 * torch.randn(n, generator=gen)  # nearly constant coordinate
    is_retain = torch.arange(n) % 2 == 0
    hidden[:, 1] = 0.1 * torch.randn(n, generator=gen) + 3.0 * is_retain  # retain text apart along one axis
    const, retain = exp.fit_directions(hidden, is_retain)
    torch.testing.assert_close(hidden @ const, torch.ones(n), atol=0.02, rtol=0)
    score = hidden @ retain
    assert float(score[is_retain].mean() - score[~is_retain].mean()) == pytest.approx(1.0, abs=0.02)
    assert exp.fit_directions(hidden, torch.zeros(n, dtype=torch.bool))[1] is None


@pytest.mark.parametrize("tied", [True, False])
def test_offset_init_lowers_each_new_logit_by_ln_pieces(tied):
    """On hidden states it was not fitted on, a new row's logit under `offset` is its mean-of-pieces
    logit minus ln(number of pieces), within 1 %; kept rows are untouched; untied: the input rows stay
    the mean of the pieces."""
    from dilforge_cpt import transplant

    model = model_with_constant_direction(tied)
    mapping = extended_mapping()
    rows = transplant.prepare(model, BASE_VOCAB + NUM_NEW)
    transplant.transplant(model, rows, mapping)
    mean_rows = model.get_output_embeddings().weight.detach().clone()
    mean_inputs = model.get_input_embeddings().weight.detach().clone()
    const, _ = exp.fit_directions(hidden_of(model, random_ids(5)), None)
    exp.write_rows(model, rows, mapping, "offset", 0, calibration=exp.Calibration(const))
    head = model.get_output_embeddings().weight.detach()
    fresh = hidden_of(model, random_ids(6))  # kept tokens only: same hidden states as before
    new = torch.tensor([k < 0 for k in mapping.kept])
    lnk = torch.log(exp.num_pieces(mapping)[new])
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
    transplant.transplant(model, rows, mapping)
    const, _ = exp.fit_directions(hidden_of(model, random_ids(8)), None)
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    leaky = stream_nll(model, stream, 64, 32, kept=kept)[0][0]
    exp.write_rows(model, rows, mapping, "calibrated", 0, calibration=exp.Calibration(const, alpha=0.0, beta=-30.0))
    full, restricted = stream_nll(model, stream, 64, 32, kept=kept)[0]
    assert leaky - base_nll > 1e-3
    assert full == pytest.approx(base_nll, rel=1e-6) and restricted == pytest.approx(base_nll, rel=1e-6)


def test_fit_offsets_recovers_the_offsets_that_generated_the_text():
    """Targets drawn from a softmax whose new rows carry known (alpha, beta, gamma): the fit (with the
    hidden states fixed) finds them back; mass on retain text is given back through gamma."""

    gen = torch.Generator().manual_seed(0)
    n, d = 6000, 16
    mapping = extended_mapping()
    vocab = BASE_VOCAB + NUM_NEW
    head = torch.randn(vocab, d, generator=gen) * 0.3
    hidden = torch.randn(n, d, generator=gen)
    hidden[:, 0] = 5.0
    is_retain = torch.arange(n) % 2 == 0
    hidden[is_retain, 1] += 2.0
    const, retain = exp.fit_directions(hidden, is_retain)
    truth = exp.Calibration(const, retain, alpha=1.5, beta=0.5, gamma=-2.0)
    logits = hidden @ exp.offset_rows(head, mapping, truth).T
    targets = torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
    fit = exp.fit_offsets(exp.Sample(hidden, targets, is_retain), head, mapping, const, retain)
    assert fit.alpha == pytest.approx(1.5, abs=0.25)
    assert fit.beta == pytest.approx(0.5, abs=0.25)
    assert fit.gamma == pytest.approx(-2.0, abs=0.4)


def test_calibration_retain_weight_moves_the_fit_toward_the_retain_text():
    """Retain text drawn with the new rows far down (beta -3), the other text with them up (beta +1), and no
    retain direction to tell them apart: the shared beta lands between, and toward -3 the more the retain
    positions weigh (calibration_retain_weight)."""

    gen = torch.Generator().manual_seed(1)
    n, d = 6000, 16
    mapping = extended_mapping()
    head = torch.randn(BASE_VOCAB + NUM_NEW, d, generator=gen) * 0.3
    hidden = torch.randn(n, d, generator=gen)
    hidden[:, 0] = 5.0
    is_retain = torch.arange(n) % 2 == 0
    const, _ = exp.fit_directions(hidden, None)
    targets = torch.empty(n, dtype=torch.long)
    for mask, beta in ((is_retain, -3.0), (~is_retain, 1.0)):
        rows = exp.offset_rows(head, mapping, exp.Calibration(const, alpha=0.0, beta=beta))
        targets[mask] = torch.multinomial((hidden[mask] @ rows.T).softmax(-1), 1, generator=gen).squeeze(1)
    sample = exp.Sample(hidden, targets, is_retain)
    betas = [exp.fit_offsets(sample, head, mapping, const, None, retain_weight=w).beta for w in (0.1, 1, 10)]
    assert -3.0 < betas[2] < betas[1] < betas[0] < 1.0, betas
    assert betas[2] < -1.5 and betas[0] > 0.5, betas


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


def test_recalibration_pulls_returning_leakage_back():
    """Leakage on the English set after "training" made the new rows loud: the re-calibration (offsets fitted
    again on the current hidden states) lowers it by more than half."""
    from types import SimpleNamespace

    from dilforge_cpt import transplant
    from dilforge_cpt.data import ValidationSet
    from dilforge_cpt.leakage import LeakageProbe, measure
    from dilforge_cpt.runtime import Runtime

    model = model_with_constant_direction(False)
    mapping = extended_mapping()
    rows = transplant.prepare(model, BASE_VOCAB + NUM_NEW)
    transplant.transplant(model, rows, mapping)
    with torch.no_grad():
        new = torch.tensor([k < 0 for k in mapping.kept])
        model.get_output_embeddings().weight[new] *= 6.0
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    en = build_stream(["e" * 40], [random_ids(9, (40,), BASE_VOCAB).tolist()], None, 0)
    probe = LeakageProbe([ValidationSet("en", en)], kept, mapping)
    config = SimpleNamespace(seq_len=32, validation_stride=None, eval_micro_batch_size=None, micro_batch_size=4)
    rt = Runtime()
    before = measure(model, probe, config, rt)["en"]["leakage"]
    settings = exp.Settings(retain_corpora=["en"], calibration_num_windows=8)
    exp.recalibrate(model, mapping, FakeData(32), config, settings, rt)
    after = measure(model, probe, config, rt)["en"]["leakage"]
    assert before > 0.01 and after < before / 2, (before, after)


def test_mean_of_all_and_random(toks):
    from dilforge_cpt import transplant

    base, new = toks
    mapping = transplant.build_mapping(base, new)
    model = model_for(base.get_vocab_size(True), True)
    emb0 = model.get_input_embeddings().weight.detach().clone()
    rows = transplant.prepare(model, new.get_vocab_size(True))
    new_ids = [i for i, k in enumerate(mapping.kept) if k < 0]
    kept_ids = [(i, k) for i, k in enumerate(mapping.kept) if k >= 0]

    exp.write_rows(model, rows, mapping, "mean_of_all", 0)
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[new_ids[0]], emb0.mean(0), rtol=0, atol=1e-6)
    assert all(torch.equal(emb[i], emb0[k]) for i, k in kept_ids)

    exp.write_rows(model, rows, mapping, "random", 0)
    emb = model.get_input_embeddings().weight
    std = float(emb[new_ids].detach().std())
    assert 0.01 < std < 0.03  # initializer_range 0.02
    assert all(torch.equal(emb[i], emb0[k]) for i, k in kept_ids)


FIT_VOCAB = 60


def mapping_with(new_pieces: list[list[int]]):
    from dilforge_cpt.transplant import VocabMapping

    return VocabMapping(list(range(FIT_VOCAB)) + [-1] * len(new_pieces), [[] for _ in range(FIT_VOCAB)] + new_pieces)


def fit_model(tied: bool = True):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(factories.tiny_llama_config(FIT_VOCAB, tie_word_embeddings=tied)).eval()


def sample_of(model, ids: torch.Tensor):
    from fitted_init import PieceSample

    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
    return PieceSample(h, ids[:, 1:], torch.zeros(len(ids), dtype=torch.bool))


def text_with_pieces(seed: int, shape, pieces: list[list[int]]) -> torch.Tensor:
    """Random base ids with the new tokens' pieces planted often, so full and partial matches occur."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, FIT_VOCAB, shape, generator=gen)
    for row in ids:
        for start in range(0, shape[1] - 4, 5):
            ps = pieces[int(torch.randint(0, len(pieces), (1,), generator=gen))]
            cut = int(torch.randint(1, len(ps) + 1, (1,), generator=gen))  # sometimes only a prefix
            row[start : start + cut] = torch.tensor(ps[:cut])
    return ids


def dense_reference(sample, head, prior, pieces, ridge, rho, retain_only=False):
    """The same fit written out: every (position, new token) target computed from full log-softmaxes
    (retain_only: outside retain windows the target is the prior row's logit)."""
    w, L, d = sample.hidden.shape
    h = sample.hidden.reshape(-1, d).double()
    logits = sample.hidden.double() @ head.double().T  # [w, L, V] base rows only
    logp, lse = logits.log_softmax(-1).tolist(), torch.logsumexp(logits, -1)
    y = torch.empty(w * L, len(pieces), dtype=torch.float64)
    for wi in range(w):
        seq = sample.next_ids[wi].tolist()
        for i in range(L):
            for j, ps in enumerate(pieces):
                z = 0.0
                for m, p in enumerate(ps):
                    if i + m >= L:  # window ends inside the token
                        z += rho * (len(ps) - m)
                        break
                    z += logp[wi][i + m][p]
                    if seq[i + m] != p:  # the text leaves the token here: the rest estimated
                        z += rho * (len(ps) - m - 1)
                        break
                y[wi * L + i, j] = lse[wi, i] + z
    new = prior.double()[FIT_VOCAB:]
    if retain_only:
        other = (~sample.is_retain).repeat_interleave(L)
        y[other] = h[other] @ new.T
    gram = h.T @ h
    lam = ridge * float(torch.diagonal(gram).mean())
    return torch.linalg.solve(gram + lam * torch.eye(d, dtype=torch.float64), h.T @ y + lam * new.T).T


def test_fit_rows_equals_the_dense_position_by_position_fit():
    from fitted_init import fit_rows

    pieces = [[3, 7], [3, 7, 11], [5, 2, 9, 1], [8], [3, 12]]
    model = fit_model()
    sample = sample_of(model, text_with_pieces(0, (3, 40), pieces))
    head = model.get_output_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(1)
    prior = torch.cat([head, torch.randn(len(pieces), head.shape[1], generator=gen)])
    fit = fit_rows(sample, prior, prior, mapping_with(pieces), ridge=0.05, rho=-2.5)
    assert fit.num_full > 0 and fit.num_matched > fit.num_full  # both kinds of target occurred
    close = {"atol": 1e-5, "rtol": 1e-4}  # log-probabilities in float32, the solve in float64
    torch.testing.assert_close(fit.rows.double(), dense_reference(sample, head, prior, pieces, 0.05, -2.5), **close)
    mixed = type(sample)(sample.hidden, sample.next_ids, torch.tensor([True, False, True]))
    only = fit_rows(mixed, prior, prior, mapping_with(pieces), ridge=0.05, rho=-2.5, retain_only=True)
    torch.testing.assert_close(
        only.rows.double(), dense_reference(mixed, head, prior, pieces, 0.05, -2.5, retain_only=True), **close
    )
    assert not torch.allclose(only.rows, fit.rows, atol=1e-3)
    assert fit.new_ids.tolist() == list(range(FIT_VOCAB, FIT_VOCAB + len(pieces)))
    # a one-piece new token's target is its piece's own logit everywhere: without the prior the fit is that row
    exact = fit_rows(sample, prior, prior, mapping_with(pieces), ridge=1e-9, rho=-2.5)
    torch.testing.assert_close(exact.rows[3], head[8], atol=1e-3 * float(head[8].norm()), rtol=0)


def test_rho_defaults_to_the_mean_log_probability_of_second_pieces():
    from fitted_init import fit_rows

    pieces = [[3, 7], [4, 9]]
    model = fit_model()
    sample = sample_of(model, text_with_pieces(2, (2, 30), pieces))
    head = model.get_output_embeddings().weight.detach()
    prior = torch.cat([head, head[:2]])
    fit = fit_rows(sample, prior, prior, mapping_with(pieces))
    logp = (sample.hidden @ head.T).log_softmax(-1)
    expected = []
    for wi in range(2):
        seq = sample.next_ids[wi].tolist()
        for i in range(len(seq) - 1):
            expected += [float(logp[wi, i + 1, ps[1]]) for ps in pieces if seq[i] == ps[0]]
    assert fit.rho == pytest.approx(sum(expected) / len(expected), rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_fitted_rows_leak_less_than_mean_of_pieces_on_held_out_text(tied):
    """Held-out base-tokenised text (pieces planted as before, other seed): the full softmax's extra NLL
    over the kept-rows softmax (the leakage) is smaller with the fitted rows than with mean-of-pieces,
    and kept rows are untouched."""
    from dilforge_cpt import transplant
    from fitted_init import fit_rows

    gen = torch.Generator().manual_seed(3)
    pieces = [torch.randint(0, FIT_VOCAB, (2 + i % 3,), generator=gen).tolist() for i in range(12)]
    model = fit_model(tied)
    mapping = mapping_with(pieces)
    train = text_with_pieces(4, (8, 64), pieces)
    held_out = text_with_pieces(5, (1, 60), pieces)[0].tolist()
    stream = build_stream(["x" * 60], [held_out], None, 0)
    rows = transplant.prepare(model, FIT_VOCAB + len(pieces))
    transplant.transplant(model, rows, mapping)
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    full_mean, base_nll = stream_nll(model, stream, 64, 32, kept=kept)[0]
    kept_rows = model.get_output_embeddings().weight.detach()[kept].clone()
    prior = model.get_output_embeddings().weight.detach().clone()
    fit = fit_rows(sample_of(model, train), prior, prior, mapping)
    exp.write_rows(model, rows, mapping, "fitted", 0, head_new_rows=(fit.new_ids, fit.rows))
    full_fit, base_again = stream_nll(model, stream, 64, 32, kept=kept)[0]
    assert base_again == pytest.approx(base_nll, rel=1e-6)
    assert full_mean - base_nll > 0.05  # mean-of-pieces leaks measurably on this model
    assert full_fit - base_nll < 0.5 * (full_mean - base_nll)
    assert torch.equal(model.get_output_embeddings().weight.detach()[kept], kept_rows)
    if not tied:  # the input rows stay the mean of their pieces
        assert torch.equal(model.get_input_embeddings().weight.detach(), prior_inputs(rows, mapping))


def prior_inputs(rows, mapping):
    from dilforge_cpt.transplant import new_rows

    return new_rows(rows["embed"], mapping)


def test_base_tokenised_expands_new_tokens_into_their_pieces():
    import numpy as np
    from fitted_init import base_tokenised, stage_ids_of_base

    mapping = mapping_with([[3, 7], [5, 2, 9]])
    stage = stage_ids_of_base(mapping)
    window = np.array([1, FIT_VOCAB, 4, FIT_VOCAB + 1, 6])
    assert base_tokenised(window, mapping, stage, 20) == [1, 3, 7, 4, 5, 2, 9, 6]
    assert base_tokenised(window, mapping, stage, 5) == [1, 3, 7, 4, 5]
