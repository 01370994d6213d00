"""Vocabulary transplant: move a base model onto a new tokenizer.

Tokens whose string is in both vocabularies keep their base embedding and LM-head rows. A new
token's row is, by method:
  mean_of_pieces  the mean of the base rows of the pieces the base tokenizer splits its bytes into
                  (byte-level BPE tokens are re-tokenised by the base BPE model directly, so partial
                  UTF-8 sequences work; added/special tokens are encoded from their content)
  mean_of_all     the mean of every base row
  random          normal(0, initializer_range)
  offset          mean_of_pieces, and each new *output* row moved along the constant direction b of the
                  final hidden states (h·b ≈ 1 for every h, fitted by ridge least squares on hidden
                  states sampled from the training corpora), so that its logit drops by ln(num pieces)
                  everywhere: a new token's logit is otherwise the mean of its pieces' logits, which
                  overstates the joint probability of the pieces (issue 24's measured one-line fix)
  fitted          mean_of_pieces input rows; new output rows fitted by ridge least squares so that
                  their logit is the base model's joint log-probability of their pieces (fitted_init.py)
  calibrated      mean_of_pieces + (beta - alpha·ln(num pieces))·b + gamma·d, d the direction that
                  tells retain text (English replay) from the rest (h·d ≈ 1 / 0), with (alpha, beta,
                  gamma) fitted on the sampled hidden states by the extended tokenisation's NLL of
                  both languages (equal weight): the new rows keep their mass on new-language text
                  and give it back on the base model's language
Tied embeddings (Llama 3.2 1B) stay tied: one matrix, one set of rows, so the output offset also
moves the input row (by a short vector: |b| ≈ 0.3 against rows of norm ≈ 2-3 for SmolLM2);
`untie_embeddings` gives the LM head its own copy so the input rows stay the mean of their pieces.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

log = logging.getLogger("dilforge.cpt.transplant")

METHODS = ("mean_of_pieces", "mean_of_all", "random", "offset", "calibrated", "fitted")
CALIBRATED = ("offset", "calibrated")  # need a Calibration (hidden states sampled from the training corpora)
FITTED = ("fitted",)  # new output rows given (fitted_init.py: ridge toward the pieces' joint log-probability)
# compare_transplant_inits scores these at step 0: `fitted` is left out (it gives base-tokenised English the
# base model's BPB but costs Azerbaijani ×1.56 against mean-of-pieces, docs/benchmarks.md; bench/leakage.py
# --methods fitted measures it)
COMPARED = ("mean_of_pieces", "mean_of_all", "random", "offset", "calibrated")


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


@dataclass
class VocabMapping:
    """For each new id: the base id it keeps (or -1) and the base piece ids of new tokens."""

    kept: list[int]
    pieces: list[list[int]]

    @property
    def num_kept(self) -> int:
        return sum(1 for k in self.kept if k >= 0)


def same_vocab(a: Tokenizer, b: Tokenizer) -> bool:
    return a.get_vocab(with_added_tokens=True) == b.get_vocab(with_added_tokens=True)


def build_mapping(base: Tokenizer, new: Tokenizer) -> VocabMapping:
    base_vocab = base.get_vocab(with_added_tokens=True)
    added = {t.content for t in new.get_added_tokens_decoder().values()}
    size = new.get_vocab_size(with_added_tokens=True)
    kept, pieces = [-1] * size, [[] for _ in range(size)]
    for token, new_id in new.get_vocab(with_added_tokens=True).items():
        if token in base_vocab:
            kept[new_id] = base_vocab[token]
            continue
        ids: list[int] = []
        if token not in added:
            try:
                ids = [t.id for t in base.model.tokenize(token)]
            except Exception:  # noqa: BLE001 - a model without tokenize on raw pieces: fall back to decode + encode
                ids = []
        if not ids:
            text = token if token in added else new.decode([new_id], skip_special_tokens=False)
            ids = base.encode(text, add_special_tokens=False).ids
        pieces[new_id] = ids
    return VocabMapping(kept, pieces)


def new_rows(base_rows: torch.Tensor, mapping: VocabMapping, method: str, std: float, seed: int) -> torch.Tensor:
    """The [new_vocab, dim] matrix for one weight (embedding or LM head)."""
    if method not in METHODS:
        raise ValueError(f"unknown transplant method {method!r}")
    base = base_rows.detach().float()
    size, dim = len(mapping.kept), base.shape[1]
    gen = torch.Generator().manual_seed(seed)
    if method == "random":
        out = torch.randn(size, dim, generator=gen) * std
    elif method == "mean_of_all":
        out = base.mean(0, keepdim=True).expand(size, dim).clone()
    else:
        overall = base.mean(0)
        out = torch.empty(size, dim)
        for i, ids in enumerate(mapping.pieces):
            valid = [j for j in ids if j < base.shape[0]]
            out[i] = base[valid].mean(0) if valid else overall
    kept = torch.tensor([(i, k) for i, k in enumerate(mapping.kept) if 0 <= k < base.shape[0]], dtype=torch.long)
    if len(kept):
        out[kept[:, 0]] = base[kept[:, 1]]
    return out.to(base_rows.dtype)


def transplant(
    model,
    base_rows: dict[str, torch.Tensor],
    mapping: VocabMapping,
    method: str,
    seed: int,
    calibration: Calibration | None = None,
    head_new_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write new embedding (and untied LM-head) rows into `model`, whose vocab is already the new size.
    The calibrated methods (`CALIBRATED`) need `calibration` and move only the output rows (the tied
    matrix, or the LM head of an untied model); `fitted` needs `head_new_rows` = (new ids, their output
    rows), written over the output matrix (tied: the one matrix, so the input rows move too)."""
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
        emb_rows = new_rows(base_rows["embed"], mapping, rows_method, std, seed)
        if head is emb:
            emb.copy_(output(emb_rows))
            return
        emb.copy_(emb_rows)
        head_base = base_rows.get("head", base_rows["embed"])
        head_rows = new_rows(head_base, mapping, rows_method, std, seed + 1)
        head.copy_(output(head_rows))


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


def prepare(model, new_vocab_size: int) -> dict[str, torch.Tensor]:
    """Snapshot the base rows, then resize the model's vocab (keeping ties). Returns the base rows."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    rows = {"embed": emb.detach().clone()}
    if head is not emb:
        rows["head"] = head.detach().clone()
    model.resize_token_embeddings(new_vocab_size, mean_resizing=False)
    return rows
