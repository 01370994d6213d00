"""Vocabulary transplant: move a base model onto a new tokenizer.

Shared tokens keep their base embedding and LM-head rows; a new token's row is the mean of the base rows of the
pieces the base tokenizer splits it into (the mean of all rows if none). Tied embeddings stay tied. Other
initialisations are compared in bench/init_experiments.py (docs/benchmarks.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer


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


def new_rows(base_rows: torch.Tensor, mapping: VocabMapping) -> torch.Tensor:
    """The [new_vocab, dim] matrix for one weight (embedding or LM head): kept rows copied, new rows the
    mean of their pieces' rows."""
    base = base_rows.detach().float()
    size, dim = len(mapping.kept), base.shape[1]
    overall = base.mean(0)
    out = torch.empty(size, dim)
    for i, ids in enumerate(mapping.pieces):
        valid = [j for j in ids if j < base.shape[0]]
        out[i] = base[valid].mean(0) if valid else overall
    kept = torch.tensor([(i, k) for i, k in enumerate(mapping.kept) if 0 <= k < base.shape[0]], dtype=torch.long)
    if len(kept):
        out[kept[:, 0]] = base[kept[:, 1]]
    return out.to(base_rows.dtype)


def transplant(model, base_rows: dict[str, torch.Tensor], mapping: VocabMapping) -> None:
    """Write the new embedding (and untied LM-head) rows into `model`, whose vocab is already the new size."""
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        emb.copy_(new_rows(base_rows["embed"], mapping))
        if head is not emb:
            head.copy_(new_rows(base_rows.get("head", base_rows["embed"]), mapping))


def prepare(model, new_vocab_size: int) -> dict[str, torch.Tensor]:
    """Snapshot the base rows, then resize the model's vocab (keeping ties). Returns the base rows."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    rows = {"embed": emb.detach().clone()}
    if head is not emb:
        rows["head"] = head.detach().clone()
    model.resize_token_embeddings(new_vocab_size, mean_resizing=False)
    return rows
