"""Bits per byte: a model's negative log-likelihood in bits over the UTF-8 bytes of a text set.

Dividing by bytes instead of tokens makes models with different vocabularies comparable: a
tokenizer that needs fewer tokens does not look better per token by construction.

Method (docs/eval.md):
  * the documents of a set are joined with "\n" into one stream and tokenized once, with BOS in
    front, so the result does not depend on how the same text is cut into documents;
  * every text token is scored once, conditioned on what precedes it in the stream;
  * windows of `window` tokens end every `stride` tokens; a window scores only the tokens the
    previous one did not, so each token after the first window sees >= window - stride tokens of
    context (stride is capped at window - 1, which scores almost non-overlapping blocks);
  * BPB = sum of NLL in nats / ln 2 / UTF-8 bytes of the stream (separators included, since the
    tokens predicting them are scored).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass
class BpbResult:
    nll_nats: float
    num_bytes: int
    num_tokens: int          # tokens scored (text tokens, BOS excluded)
    num_windows: int
    seconds: float

    @property
    def bits(self) -> float:
        return self.nll_nats / math.log(2)

    @property
    def bpb(self) -> float:
        return self.bits / self.num_bytes if self.num_bytes else float("nan")

    @property
    def bits_per_token(self) -> float:
        return self.bits / self.num_tokens if self.num_tokens else float("nan")

    def summary(self) -> dict:
        return {"bpb": round(self.bpb, 5), "bits_per_token": round(self.bits_per_token, 5),
                "bytes_per_second": round(self.num_bytes / self.seconds, 1) if self.seconds else None,
                **{k: v for k, v in asdict(self).items() if k != "nll_nats"}, "bits": round(self.bits, 3)}


def pack(docs: Sequence[str]) -> str:
    """The stream a text set is scored as."""
    return "\n".join(docs)


def window_plan(num_positions: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window over positions 0..n-1, position 0 being BOS.

    Window k feeds positions [begin, end) and scores target positions [first_scored, end); every
    target 1..n-1 is scored exactly once, with at least window - stride tokens of context after the
    first window. The stride is capped at window - 1: the first position of a window has no context
    inside it, so consecutive windows must overlap by one token at least.
    """
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


def _hidden_and_head(model):
    """(decoder, lm_head) when the model exposes them, so logits are computed for scored positions only."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or getattr(model.config, "final_logit_softcapping", None):
        return None, None
    return decoder, head


@torch.inference_mode()
def score_ids(model, ids: Sequence[int], window: int, stride: int, batch_size: int = 8,
              chunk: int = 2048) -> tuple[float, int, int]:
    """Sum of NLL (nats) of ids[1:] given their prefixes, by sliding window; (nll, num_scored, num_windows)."""
    device = next(model.parameters()).device
    ids_t = torch.tensor(list(ids), dtype=torch.long)
    plans = window_plan(len(ids_t), window, stride)
    decoder, head = _hidden_and_head(model)
    total = torch.zeros((), dtype=torch.float64, device=device)
    scored = 0
    for i in range(0, len(plans), batch_size):
        group = plans[i:i + batch_size]
        width = max(e - b for b, e, _ in group)
        batch = torch.zeros((len(group), width), dtype=torch.long)
        for row, (b, e, _) in enumerate(group):
            batch[row, : e - b] = ids_t[b:e]   # right padding: causal attention never looks at it
        batch = batch.to(device)
        rows, cols, targets = [], [], []
        for row, (b, e, s) in enumerate(group):
            pos = torch.arange(s - 1 - b, e - 1 - b)          # logits at p predict token p+1
            rows.append(torch.full_like(pos, row))
            cols.append(pos)
            targets.append(ids_t[s:e])
        rows_t, cols_t = torch.cat(rows).to(device), torch.cat(cols).to(device)
        tgt = torch.cat(targets).to(device)
        if decoder is not None:
            hidden = decoder(input_ids=batch).last_hidden_state[rows_t, cols_t]
            for j in range(0, len(tgt), chunk):
                logits = head(hidden[j:j + chunk]).float()
                total += F.cross_entropy(logits, tgt[j:j + chunk], reduction="sum").double()
        else:
            logits = model(input_ids=batch).logits[rows_t, cols_t].float()
            total += F.cross_entropy(logits, tgt, reduction="sum").double()
        scored += len(tgt)
    return float(total), scored, len(plans)


def encode_stream(tokenizer, text: str) -> list[int]:
    """BOS + the text's tokens (a transformers tokenizer; no other special tokens)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is None:
        bos = tokenizer.eos_token_id
    if bos is None:
        raise ValueError("tokenizer has neither a BOS nor an EOS token to start the stream with")
    return [bos, *ids]


def bits_per_byte(model, tokenizer, docs: Sequence[str], window: int, stride: int, batch_size: int = 8) -> BpbResult:
    text = pack(docs)
    start = time.perf_counter()
    ids = encode_stream(tokenizer, text)
    nll, scored, windows = score_ids(model, ids, window, stride, batch_size)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return BpbResult(nll_nats=nll, num_bytes=len(text.encode("utf-8")), num_tokens=scored, num_windows=windows,
                     seconds=time.perf_counter() - start)


def default_window(model, requested: int | None, cap: int = 2048) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or cap
    return min(requested or cap, limit) if requested else min(limit, cap)
