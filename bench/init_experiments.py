"""Embedding initialisations the CPT stage does not train, kept for the step-0 comparison and the
leakage benches (bench/leakage.py, bench/leakage_cpt.py); the stage imports nothing from here.

The stage initialises new rows as the mean of their pieces (dilforge_cpt.transplant). Measured against it
(docs/benchmarks.md, issue 24):
  mean_of_all     the mean of every base row
  random          normal(0, initializer_range)
  offset          mean_of_pieces, and each new *output* row moved along the constant direction b of the
                  final hidden states (h·b ≈ 1 for every h, fitted by ridge least squares on hidden
                  states sampled from the training corpora), so that its logit drops by ln(num pieces)
  fitted          mean_of_pieces input rows; new output rows fitted by ridge least squares so that
                  their logit is the base model's joint log-probability of their pieces (fitted_init.py)
  calibrated      mean_of_pieces + (beta - alpha·ln(num pieces))·b + gamma·d, d the direction that
                  tells retain text (English replay) from the rest (h·d ≈ 1 / 0), with (alpha, beta,
                  gamma) fitted on the sampled hidden states by the extended tokenisation's NLL
and `recalibrate`, the counter-measure that fits the calibrated offsets again on a trained model. Tied
embeddings stay tied unless `Settings.untie_embeddings` gives the LM head its own copy.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fitted_init  # noqa: E402
from dilforge_cpt import leakage, transplant  # noqa: E402
from dilforge_cpt.transplant import VocabMapping  # noqa: E402
from dilforge_cpt.validation import bpb_by_set, evaluate  # noqa: E402
from dilforge_shared.bpb import eval_mode  # noqa: E402

log = logging.getLogger("dilforge.bench.init")

METHODS = ("mean_of_pieces", "mean_of_all", "random", "offset", "calibrated", "fitted")
CALIBRATED = ("offset", "calibrated")  # need a Calibration (hidden states sampled from the training corpora)
FITTED = ("fitted",)  # new output rows given (fitted_init.py: ridge toward the pieces' joint log-probability)
# the step-0 comparison's default set: `fitted` is left out (it gives base-tokenised English the base
# model's BPB but costs Azerbaijani ×1.56 against mean-of-pieces; --methods fitted measures it)
COMPARED = ("mean_of_pieces", "mean_of_all", "random", "offset", "calibrated")


@dataclass
class Settings:
    """What the experimental initialisations need beyond the CPT config (formerly CPT config fields)."""

    retain_corpora: list[str] = field(default_factory=list)  # corpora in the base model's own language
    calibration_num_windows: int = 16  # training windows whose final hidden states are sampled
    calibration_retain_weight: float = 1.0  # retain positions' weight in the calibrated fit
    fit_ridge: float = 0.1  # the fitted method's ridge strength toward the mean-of-pieces rows
    untie_embeddings: bool = False  # give a tied LM head its own copy first
    calibration: Calibration | None = None  # fitted once, cached
    fit: fitted_init.Fit | None = None  # fitted once, cached


@dataclass(frozen=True)
class Calibration:
    """Directions in the final-hidden-state space and the offsets the calibrated methods use.
    The new output row of token t gets (beta - alpha·ln k_t)·const + gamma·retain added (k_t = its
    number of pieces); `offset` uses alpha = 1, beta = gamma = 0."""

    const: torch.Tensor  # b with h·b ≈ 1
    retain: torch.Tensor | None = None  # d with h·d ≈ 1 on retain text, ≈ 0 on the rest (None: no retain text)
    alpha: float = 1.0
    beta: float = 0.0
    gamma: float = 0.0

    def to_report(self) -> dict:
        return {
            "alpha": self.alpha,
            "beta": self.beta,
            "gamma": self.gamma,
            "const_norm": float(self.const.norm()),
            "retain_norm": float(self.retain.norm()) if self.retain is not None else None,
        }


def ridge(hidden: torch.Tensor, target: torch.Tensor, lam: float = 1.0, intercept: bool = False) -> torch.Tensor:
    """argmin_w |hidden·w (+ c) - target|² + lam·|w|² (float64); the intercept c is dropped from the result."""
    h = hidden.double()
    if intercept:
        h = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1)
    a = h.T @ h + lam * torch.eye(h.shape[1], dtype=h.dtype)
    w = torch.linalg.solve(a, h.T @ target.double())
    return (w[:-1] if intercept else w).float()


def fit_directions(
    hidden: torch.Tensor, is_retain: torch.Tensor | None, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, d): h·b ≈ 1 over all sampled hidden states; h·d + c ≈ 1 on retain positions and 0 elsewhere
    (None without both kinds of positions)."""
    const = ridge(hidden, torch.ones(len(hidden)), lam)
    if is_retain is None or bool(is_retain.all()) or not bool(is_retain.any()):
        return const, None
    return const, ridge(hidden, is_retain.float(), lam, intercept=True)


def num_pieces(mapping: VocabMapping) -> torch.Tensor:
    return torch.tensor([max(1, len(p)) for p in mapping.pieces], dtype=torch.float32)


def offset_rows(rows: torch.Tensor, mapping: VocabMapping, cal: Calibration) -> torch.Tensor:
    """`rows` with the calibrated offset added to the new tokens' rows (kept rows untouched)."""
    out = rows.detach().float().clone()
    new = torch.tensor([k < 0 for k in mapping.kept], dtype=torch.bool)
    scale = cal.beta - cal.alpha * torch.log(num_pieces(mapping)[new])
    delta = scale[:, None] * cal.const[None, :]
    if cal.retain is not None and cal.gamma:
        delta = delta + cal.gamma * cal.retain[None, :]
    out[new] += delta
    return out.to(rows.dtype)


@dataclass(frozen=True)
class Sample:
    """Final hidden states of the extended model at sampled positions, the next token at each, and
    whether the position is in retain text (English replay)."""

    hidden: torch.Tensor  # [n, d]
    targets: torch.Tensor  # [n] stage ids
    is_retain: torch.Tensor  # [n] bool


def fit_offsets(
    sample: Sample,
    head: torch.Tensor,
    mapping: VocabMapping,
    const: torch.Tensor,
    retain: torch.Tensor | None,
    max_iter: int = 30,
    start: tuple[float, float, float] = (1.0, 0.0, 0.0),
    retain_weight: float = 1.0,
) -> Calibration:
    """(alpha, beta, gamma) minimising the mean next-token NLL of the sample, the retain positions' mean
    weighted `retain_weight` against the other positions' 1, with the hidden states held fixed (a convex
    problem in three numbers; the kept rows' log-sum-exp and the new rows' base logits are computed once). `head` holds the rows
    the offsets are added to (mean of pieces at step 0, the trained rows when re-calibrating)."""
    new = torch.tensor([k < 0 for k in mapping.kept], dtype=torch.bool)
    new_pos = torch.full((len(new),), -1, dtype=torch.long)
    new_pos[new] = torch.arange(int(new.sum()))
    lnk = torch.log(num_pieces(mapping)[new])
    h, w = sample.hidden.float(), head.detach().float()
    groups, weights = [], []
    for m, weight in ((sample.is_retain, retain_weight), (~sample.is_retain, 1.0)):
        if bool(m.any()):
            groups.append(m)
            weights.append(weight)
    cached = []
    with torch.no_grad():
        for m in groups:
            hg, tg = h[m], sample.targets[m]
            lse_kept = torch.cat([torch.logsumexp(hg[j : j + 512] @ w[~new].T, 1) for j in range(0, len(hg), 512)])
            cached.append(
                {
                    "lse_kept": lse_kept,
                    "new": hg @ w[new].T,
                    "target": (hg * w[tg]).sum(1),
                    "pos": new_pos[tg],
                    "sb": hg @ const,
                    "sd": hg @ retain if retain is not None else torch.zeros(len(hg)),
                }
            )
    params = torch.tensor(list(start), requires_grad=True)

    def nll(c: dict, p: torch.Tensor) -> torch.Tensor:
        logits = c["new"] + (p[1] - p[0] * lnk)[None, :] * c["sb"][:, None] + p[2] * c["sd"][:, None]
        lse = torch.logaddexp(c["lse_kept"], torch.logsumexp(logits, 1))
        is_new = c["pos"] >= 0
        target = torch.where(is_new, logits.gather(1, c["pos"].clamp(min=0)[:, None]).squeeze(1), c["target"])
        return (lse - target).mean()

    opt = torch.optim.LBFGS([params], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        p = params if retain is not None else params * torch.tensor([1.0, 1.0, 0.0])
        loss = sum(weight * nll(c, p) for weight, c in zip(weights, cached, strict=True)) / sum(weights)
        loss.backward()
        return loss

    opt.step(closure)
    alpha, beta, gamma = params.detach().tolist()
    return Calibration(const, retain, alpha, beta, gamma if retain is not None else 0.0)


def untie(model) -> None:
    """Give a tied model's LM head its own copy of the embedding (config.tie_word_embeddings = False),
    so output rows can change without moving input rows; a stock LlamaForCausalLM loads it as is."""
    emb, head_module = model.get_input_embeddings(), model.get_output_embeddings()
    if head_module.weight is not emb.weight:
        return
    head_module.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def experimental_rows(base_rows: torch.Tensor, mapping: VocabMapping, method: str, std: float, seed: int):
    """The [new_vocab, dim] matrix of one weight for mean_of_pieces, mean_of_all or random."""
    if method == "mean_of_pieces":
        return transplant.new_rows(base_rows, mapping)
    base = base_rows.detach().float()
    size, dim = len(mapping.kept), base.shape[1]
    if method == "random":
        out = torch.randn(size, dim, generator=torch.Generator().manual_seed(seed)) * std
    elif method == "mean_of_all":
        out = base.mean(0, keepdim=True).expand(size, dim).clone()
    else:
        raise ValueError(f"unknown row method {method!r}")
    kept = torch.tensor([(i, k) for i, k in enumerate(mapping.kept) if 0 <= k < base.shape[0]], dtype=torch.long)
    if len(kept):
        out[kept[:, 0]] = base[kept[:, 1]]
    return out.to(base_rows.dtype)


def write_rows(
    model,
    base_rows: dict[str, torch.Tensor],
    mapping: VocabMapping,
    method: str,
    seed: int,
    calibration: Calibration | None = None,
    head_new_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write one initialisation's rows into `model`. The calibrated methods need `calibration` and move
    only the output rows (the tied matrix, or the LM head of an untied model); `fitted` needs
    `head_new_rows` = (new ids, their output rows)."""
    if method not in METHODS:
        raise ValueError(f"unknown transplant method {method!r}")
    if method in CALIBRATED and calibration is None:
        raise ValueError(f"transplant method {method!r} needs a calibration (sampled hidden states)")
    if method in FITTED and head_new_rows is None:
        raise ValueError(f"transplant method {method!r} needs its fitted output rows")
    std = float(getattr(model.config, "initializer_range", 0.02))
    rows_method = "mean_of_pieces" if method in CALIBRATED + FITTED else method

    def output(rows: torch.Tensor) -> torch.Tensor:
        if method in CALIBRATED:
            return offset_rows(rows, mapping, calibration)
        if method in FITTED:
            rows = rows.clone()
            rows[head_new_rows[0]] = head_new_rows[1].to(rows.dtype)
        return rows

    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        emb_rows = experimental_rows(base_rows["embed"], mapping, rows_method, std, seed)
        if head is emb:
            emb.copy_(output(emb_rows))
            return
        emb.copy_(emb_rows)
        head_base = base_rows.get("head", base_rows["embed"])
        head.copy_(output(experimental_rows(head_base, mapping, rows_method, std, seed + 1)))


def calibration_windows(data, settings: Settings, seq_len: int) -> tuple[list[np.ndarray], list[bool]]:
    """The first windows of the training corpora: half of `calibration_num_windows` from the retain
    corpora, half from the others (all from every corpus without retain corpora), spread evenly."""
    labels = [tf.label for tf in data.files]
    retain = [i for i, name in enumerate(labels) if name in settings.retain_corpora]
    other = [i for i in range(len(labels)) if i not in retain]
    kinds = [(retain, True), (other, False)] if retain and other else [(list(range(len(labels))), False)]
    per_kind = max(1, settings.calibration_num_windows // len(kinds))
    windows, flags = [], []
    for corpora, is_retain in kinds:
        for j, c in enumerate(corpora):
            n = per_kind // len(corpora) + (1 if j < per_kind % len(corpora) else 0)
            for i in range(min(n, data.files[c].windows(seq_len))):
                windows.append(data.window(c, i))
                flags.append(is_retain)
    return windows, flags


@torch.no_grad()
def final_hidden(model, x: torch.Tensor, batch_size: int, rt) -> torch.Tensor:
    """[windows × (len - 1), d] final hidden states (after the last norm) predicting each next token."""
    out: list[torch.Tensor] = []
    decoder = model.get_decoder()

    def grab(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        out.append(hidden[:, :-1].float().reshape(-1, hidden.shape[-1]).cpu())

    handle = decoder.register_forward_hook(grab)
    try:
        with eval_mode(model), rt.autocast():
            for k in range(0, len(x), batch_size):
                model(input_ids=x[k : k + batch_size], logits_to_keep=1)
    finally:
        handle.remove()
    return torch.cat(out)


def sample_hidden(model, data, config, settings: Settings, rt) -> Sample:
    windows, flags = calibration_windows(data, settings, config.seq_len)
    x = torch.from_numpy(np.stack(windows)).to(rt.device)
    hidden = final_hidden(model, x, config.micro_batch_size, rt)
    positions = x.shape[1] - 1
    return Sample(
        hidden, x[:, 1:].reshape(-1).cpu(), torch.tensor(flags, dtype=torch.bool).repeat_interleave(positions)
    )


def calibrate(model, pending, data, config, settings: Settings, rt) -> Calibration:
    """The calibrated methods' directions and offsets, fitted once on the mean-of-pieces model's hidden states."""
    if settings.calibration is None:
        transplant.transplant(model, pending.base_rows, pending.mapping)
        sample = sample_hidden(model, data, config, settings, rt)
        const, retain = fit_directions(sample.hidden, sample.is_retain if settings.retain_corpora else None)
        settings.calibration = fit_offsets(
            sample,
            model.get_output_embeddings().weight.detach().cpu(),
            pending.mapping,
            const,
            retain,
            retain_weight=settings.calibration_retain_weight,
        )
        pending.report["calibration"] = {
            **settings.calibration.to_report(),
            "num_positions": len(sample.targets),
            "num_retain_positions": int(sample.is_retain.sum()),
        }
    return settings.calibration


def fit_output_rows(model, pending, data, config, settings: Settings, rt) -> fitted_init.Fit:
    """The fitted method's new output rows, fitted once on the base model's hidden states over the
    calibration windows in the base tokenisation."""
    if settings.fit is None:
        transplant.transplant(model, pending.base_rows, pending.mapping)
        windows, flags = calibration_windows(data, settings, config.seq_len)
        stage = fitted_init.stage_ids_of_base(pending.mapping)
        x = torch.tensor([fitted_init.base_tokenised(w, pending.mapping, stage, config.seq_len) for w in windows])
        hidden = final_hidden(model, x.to(rt.device), config.micro_batch_size, rt)
        sample = fitted_init.PieceSample(
            hidden.reshape(len(x), x.shape[1] - 1, -1), x[:, 1:], torch.tensor(flags, dtype=torch.bool)
        )
        prior = model.get_output_embeddings().weight.detach().float().cpu()
        settings.fit = fitted_init.fit_rows(sample, prior, prior, pending.mapping, ridge=settings.fit_ridge)
        pending.report["fit"] = settings.fit.to_report()
    return settings.fit


def apply(model, pending, method: str, data, config, settings: Settings, rt) -> None:
    """Write `method`'s rows into the resized model (`model_init.load_model`'s PendingTransplant)."""
    cal = fit = None
    if method in CALIBRATED:
        cal = calibrate(model, pending, data, config, settings, rt)
        if method == "offset":
            cal = Calibration(cal.const)
    if method in FITTED:
        fitted = fit_output_rows(model, pending, data, config, settings, rt)
        fit = (fitted.new_ids, fitted.rows)
    write_rows(model, pending.base_rows, pending.mapping, method, config.seed, calibration=cal, head_new_rows=fit)


def recalibrate(model, mapping: VocabMapping, data, config, settings: Settings, rt) -> Calibration:
    """The counter-measure against leakage that returns during training: the calibrated offsets fitted
    again, from zero, on the current model's hidden states and added to its trained new output rows."""
    sample = sample_hidden(model, data, config, settings, rt)
    const, retain = fit_directions(sample.hidden, sample.is_retain if settings.retain_corpora else None)
    head = model.get_output_embeddings().weight
    rows = head.detach().float().cpu()
    cal = fit_offsets(sample, rows, mapping, const, retain, start=(0.0, 0.0, 0.0))
    with torch.no_grad():
        head.copy_(offset_rows(rows, mapping, cal).to(device=head.device, dtype=head.dtype))
    return cal


def compare_initialisations(
    model, pending, val, config, settings: Settings, rt, data, probe=None, methods=None, trained="mean_of_pieces"
):
    """Step-0 validation (and leakage, with a probe) of each initialisation, `trained` last so the model
    ends with its rows. Returns the table {method: {set: row}} and the BPB per method."""
    methods = [m for m in (methods or COMPARED) if m != trained] + [trained]
    if settings.untie_embeddings:
        untie(model)
    table, bpb = {}, {}
    for method in methods:
        apply(model, pending, method, data, config, settings, rt)
        result = evaluate(model, val, config, rt, desc=f"step-0 {method}")
        bpb[method] = bpb_by_set(result)
        log.info("transplant %s: step-0 val_bpb=%.4f", method, result["val_bpb"])
        if probe is not None:
            table[method] = leakage.step0_row(bpb_by_set(result), leakage.measure(model, probe, config, rt))
    if table:
        log.info("step-0 leakage table:\n%s", leakage.format_table(table))
    return table, bpb
