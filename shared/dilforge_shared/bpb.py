"""Sliding-window bits per byte of a text set: the one BPB that CPT validation and eval report (imports torch).

Documents form one stream framed as CPT packs them (`[bos] doc [doc_end]`); windows of `window` tokens end every
`stride`, each text token is scored once, separators are context only; BPB = NLL in nats / ln 2 / UTF-8 bytes,
so models with different tokenizers compare. Log-probs come from the final hidden states in chunks (no
full-vocabulary logits per batch), via a decoder hook, so FSDP2 gathers the head exactly as in training."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn import functional


@dataclass(frozen=True)
class TokenStream:
    """A text set as one stream: token ids, which of them are text (scored), and the text's bytes."""

    ids: list[int]
    scored: list[bool]
    num_bytes: int
    num_docs: int

    @property
    def num_text_tokens(self) -> int:
        return sum(self.scored)


def build_stream(docs: Sequence[str], encoded: Sequence[Sequence[int]], bos: int | None, doc_end: int) -> TokenStream:
    """`[bos] doc doc_end [bos] doc ...` from each document's text and its token ids (no special tokens)."""
    if len(docs) != len(encoded):
        raise ValueError(f"{len(docs)} documents but {len(encoded)} encodings")
    ids: list[int] = [] if bos is not None else [doc_end]
    scored: list[bool] = [False] * len(ids)
    for i, doc_ids in enumerate(encoded):
        separators = ([doc_end] if i else []) + ([bos] if bos is not None else [])
        ids += separators + [int(t) for t in doc_ids]
        scored += [False] * len(separators) + [True] * len(doc_ids)
    return TokenStream(ids, scored, sum(len(d.encode("utf-8")) for d in docs), len(docs))


def window_plan(num_positions: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window over positions 0..n-1 (position 0 is only context): window k feeds
    [begin, end) and scores targets [first_scored, end), each target 1..n-1 in exactly one window. The stride is
    capped at window - 1 (a window's first position has no context inside it, so windows overlap by one at least)."""
    if window < 2 or stride < 1 or stride > window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    stride = min(stride, window - 1)
    plans: list[tuple[int, int, int]] = []
    scored_until, end = 1, min(window, num_positions)
    while scored_until < num_positions:
        plans.append((max(0, end - window), end, scored_until))
        scored_until = end
        end = min(end + stride, num_positions)
    return plans


def _decoder_and_head(model):
    """(decoder, lm_head) when logits are a plain linear map of the decoder's output and the model's
    forward can skip computing them (`logits_to_keep`), else (None, None)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    if (
        decoder is None
        or head is None
        or getattr(cfg, "final_logit_softcapping", None)
        or getattr(cfg, "logit_scale", None)
        or "logits_to_keep" not in inspect.signature(model.forward).parameters
    ):
        return None, None
    return decoder, head


def _chunk_nll(logits: torch.Tensor, targets: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """Summed NLL (float64) of one chunk; with `kept` (bool per vocabulary row) a [2] tensor: under the
    full softmax and under the softmax restricted to the kept rows (which must hold every target)."""
    full = functional.cross_entropy(logits, targets, reduction="sum").double()
    if kept is None:
        return full
    restricted = functional.cross_entropy(logits.masked_fill(~kept, float("-inf")), targets, reduction="sum").double()
    return torch.stack([full, restricted])


def _batch_nll(
    model,
    batch: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    targets: torch.Tensor,
    chunk_positions: int,
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed NLL (float64; with `kept` see `_chunk_nll`) of `targets` at hidden positions (rows, cols) of one
    forward: the model's own (FSDP2's hooks gather the head, Liger/compile apply as in training) with
    `logits_to_keep=1`; a decoder hook scores the picked final hidden states, `chunk_positions` at a time."""
    decoder, head = _decoder_and_head(model)
    total = torch.zeros(() if kept is None else (2,), dtype=torch.float64, device=targets.device)
    if decoder is None:  # logits are not a plain linear map of the hidden states: the model computes them
        logits = model(input_ids=batch).logits[rows, cols]
        for j in range(0, len(targets), chunk_positions):
            total += _chunk_nll(logits[j : j + chunk_positions].float(), targets[j : j + chunk_positions], kept)
        return total

    def score(module, args, output):
        nonlocal total
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        picked = hidden[rows, cols]
        for j in range(0, len(targets), chunk_positions):
            logits = head(picked[j : j + chunk_positions]).float()
            total = total + _chunk_nll(logits, targets[j : j + chunk_positions], kept)

    handle = decoder.register_forward_hook(score)
    try:
        model(input_ids=batch, logits_to_keep=1)
    finally:
        handle.remove()
    return total


def _reshard(model) -> None:
    """After a no_grad forward FSDP2 leaves the root's parameters gathered; a later training forward
    would then use those stale copies after the optimizer updated the shards. Free them explicitly."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def eval_mode(model) -> Iterator[None]:
    """`model.eval()` for the block, the model's own training mode back afterwards (scoring runs inside
    training loops as well as on loaded models)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def stream_nll(
    model,
    stream: TokenStream,
    window: int,
    stride: int,
    batch_size: int = 8,
    chunk_positions: int = 1024,
    rank: int = 0,
    world: int = 1,
    on_batch: Callable[[int, int], None] | None = None,
    kept: torch.Tensor | None = None,
) -> tuple:
    """(NLL in nats, text tokens scored, windows) of this rank's round-robin share of the stream's windows.

    Every rank runs the same number of forwards (FSDP's collectives need it); sum the results over ranks. With
    `kept` (a bool per vocabulary row) it also returns the NLL under the softmax over the kept rows only: for a
    model whose kept rows are its base's, the difference is the vocabulary leakage (services/cpt leakage.py)."""
    device = next(model.parameters()).device
    ids_t = torch.tensor(stream.ids, dtype=torch.long)
    scored_t = torch.tensor(stream.scored, dtype=torch.bool)
    plans = window_plan(len(stream.ids), window, stride)
    mine = plans[rank::world]
    num_batches = -(-len(plans[0::world]) // batch_size) if plans else 0
    total = torch.zeros(() if kept is None else (2,), dtype=torch.float64, device=device)
    kept = kept.to(device) if kept is not None else None
    count = 0
    for k in range(num_batches):
        group = mine[k * batch_size : (k + 1) * batch_size]
        if not group:
            b, e, _ = plans[0]
            group = [(b, e, e)]  # scores nothing
        width = max(e - b for b, e, _ in group)
        batch = torch.zeros((len(group), width), dtype=torch.long)
        rows, cols, targets = [], [], []
        for row, (b, e, s) in enumerate(group):
            batch[row, : e - b] = ids_t[b:e]  # right padding: causal attention never looks at it
            t = torch.arange(s, e)
            t = t[scored_t[s:e]]
            rows.append(torch.full_like(t, row))
            cols.append(t - 1 - b)  # the hidden state at p predicts token p + 1
            targets.append(ids_t[t])
        rows_t, cols_t = torch.cat(rows).to(device), torch.cat(cols).to(device)
        tgt = torch.cat(targets).to(device)
        total += _batch_nll(model, batch.to(device), rows_t, cols_t, tgt, chunk_positions, kept)
        count += len(tgt)
        if on_batch is not None:
            on_batch(k + 1, num_batches)
    _reshard(model)
    nll = float(total) if kept is None else tuple(total.tolist())
    return nll, count, len(mine)
