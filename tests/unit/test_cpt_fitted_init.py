"""The `fitted` transplant (issue 24): new output rows by ridge least squares toward the base model's joint
log-probability of their pieces. The batched solve equals a dense reference built position by position,
and on held-out text the fitted rows take less mass from base-tokenised text than mean-of-pieces."""

from __future__ import annotations

import factories
import pytest
import torch
from dilforge_shared.bpb import build_stream, stream_nll

torch.set_num_threads(1)

BASE_VOCAB = 60


def mapping_with(new_pieces: list[list[int]]):
    from dilforge_cpt.transplant import VocabMapping

    return VocabMapping(list(range(BASE_VOCAB)) + [-1] * len(new_pieces), [[] for _ in range(BASE_VOCAB)] + new_pieces)


def tiny_model(tied: bool = True):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(factories.tiny_llama_config(BASE_VOCAB, tie_word_embeddings=tied)).eval()


def sample_of(model, ids: torch.Tensor):
    from dilforge_cpt.fitted_init import PieceSample

    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
    return PieceSample(h, ids[:, 1:], torch.zeros(len(ids), dtype=torch.bool))


def text_with_pieces(seed: int, shape, pieces: list[list[int]]) -> torch.Tensor:
    """Random base ids with the new tokens' pieces planted often, so full and partial matches occur."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, BASE_VOCAB, shape, generator=gen)
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
    new = prior.double()[BASE_VOCAB:]
    if retain_only:
        other = (~sample.is_retain).repeat_interleave(L)
        y[other] = h[other] @ new.T
    gram = h.T @ h
    lam = ridge * float(torch.diagonal(gram).mean())
    return torch.linalg.solve(gram + lam * torch.eye(d, dtype=torch.float64), h.T @ y + lam * new.T).T


def test_fit_rows_equals_the_dense_position_by_position_fit():
    from dilforge_cpt.fitted_init import fit_rows

    pieces = [[3, 7], [3, 7, 11], [5, 2, 9, 1], [8], [3, 12]]
    model = tiny_model()
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
    assert fit.new_ids.tolist() == list(range(BASE_VOCAB, BASE_VOCAB + len(pieces)))
    # a one-piece new token's target is its piece's own logit everywhere: without the prior the fit is that row
    exact = fit_rows(sample, prior, prior, mapping_with(pieces), ridge=1e-9, rho=-2.5)
    torch.testing.assert_close(exact.rows[3], head[8], atol=1e-3 * float(head[8].norm()), rtol=0)


def test_rho_defaults_to_the_mean_log_probability_of_second_pieces():
    from dilforge_cpt.fitted_init import fit_rows

    pieces = [[3, 7], [4, 9]]
    model = tiny_model()
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
    from dilforge_cpt.fitted_init import fit_rows

    gen = torch.Generator().manual_seed(3)
    pieces = [torch.randint(0, BASE_VOCAB, (2 + i % 3,), generator=gen).tolist() for i in range(12)]
    model = tiny_model(tied)
    mapping = mapping_with(pieces)
    train = text_with_pieces(4, (8, 64), pieces)
    held_out = text_with_pieces(5, (1, 60), pieces)[0].tolist()
    stream = build_stream(["x" * 60], [held_out], None, 0)
    rows = transplant.prepare(model, BASE_VOCAB + len(pieces))
    transplant.transplant(model, rows, mapping, "mean_of_pieces", seed=0)
    kept = torch.tensor([k >= 0 for k in mapping.kept])
    full_mean, base_nll = stream_nll(model, stream, 64, 32, kept=kept)[0]
    kept_rows = model.get_output_embeddings().weight.detach()[kept].clone()
    prior = model.get_output_embeddings().weight.detach().clone()
    fit = fit_rows(sample_of(model, train), prior, prior, mapping)
    transplant.transplant(model, rows, mapping, "fitted", seed=0, head_new_rows=(fit.new_ids, fit.rows))
    full_fit, base_again = stream_nll(model, stream, 64, 32, kept=kept)[0]
    assert base_again == pytest.approx(base_nll, rel=1e-6)
    assert full_mean - base_nll > 0.05  # mean-of-pieces leaks measurably on this model
    assert full_fit - base_nll < 0.5 * (full_mean - base_nll)
    assert torch.equal(model.get_output_embeddings().weight.detach()[kept], kept_rows)
    if not tied:  # the input rows stay the mean of their pieces
        assert torch.equal(model.get_input_embeddings().weight.detach(), prior_inputs(rows, mapping))


def prior_inputs(rows, mapping):
    from dilforge_cpt.transplant import new_rows

    return new_rows(rows["embed"], mapping, "mean_of_pieces", 0.02, 0)


def test_base_tokenised_expands_new_tokens_into_their_pieces():
    import numpy as np
    from dilforge_cpt.fitted_init import base_tokenised, stage_ids_of_base

    mapping = mapping_with([[3, 7], [5, 2, 9]])
    stage = stage_ids_of_base(mapping)
    window = np.array([1, BASE_VOCAB, 4, BASE_VOCAB + 1, 6])
    assert base_tokenised(window, mapping, stage, 20) == [1, 3, 7, 4, 5, 2, 9, 6]
    assert base_tokenised(window, mapping, stage, 5) == [1, 3, 7, 4, 5]
