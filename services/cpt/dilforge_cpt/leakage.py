"""Vocabulary leakage: how much probability a transplant's new rows take on text the base model already handled.

Each validation set is also scored in the base model's tokenisation (in the stage's ids): there every input and
target is a base token, so what the base model scored is lost only to the new rows' softmax mass. The same pass
scores the softmax over the kept rows only (the base model's own BPB at step 0), so leakage =
bpb_base_tokenization / bpb_kept_rows - 1, with no second model. Defined for extend strategies only."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tabulate import tabulate
from tokenizers import Tokenizer

from .config import CptConfig
from .data import TokenIds, ValidationSet, build_validation
from .runtime import Runtime
from .transplant import VocabMapping
from .validation import score_sets


@dataclass(frozen=True)
class LeakageProbe:
    """The validation sets in the base model's tokenisation (stage ids) and which rows are kept."""

    sets: list[ValidationSet]
    kept: torch.Tensor  # bool per vocabulary row of the stage's tokenizer
    mapping: VocabMapping  # the stage id of each base token (bench/init_experiments.py re-calibrates with it)


def base_to_new_ids(mapping: VocabMapping, base_vocab_size: int) -> list[int] | None:
    """The stage's id of every base token, or None when some base token is not in the stage's vocabulary."""
    out = [-1] * base_vocab_size
    for new_id, base_id in enumerate(mapping.kept):
        if 0 <= base_id < base_vocab_size:
            out[base_id] = new_id
    return None if min(out, default=0) < 0 else out


def build_probe(
    config: CptConfig,
    base_tok: Tokenizer,
    mapping: VocabMapping,
    tok: Tokenizer,
    ids: TokenIds,
    endpoint_url: str | None,
) -> tuple[LeakageProbe | None, str | None]:
    """(probe, None) or (None, why there is none)."""
    remap = base_to_new_ids(mapping, base_tok.get_vocab_size(with_added_tokens=True))
    if remap is None:
        return None, "some base tokens are not in the stage's vocabulary: base tokenisation is not expressible"

    def encode(docs: list[str]) -> list[list[int]]:
        return [[remap[t] for t in enc.ids] for enc in base_tok.encode_batch(docs, add_special_tokens=False)]

    sets = build_validation(config.validation, tok, ids, config.num_validation_docs, endpoint_url, encode=encode)
    kept = torch.tensor([k >= 0 for k in mapping.kept], dtype=torch.bool)
    return LeakageProbe(sets, kept, mapping), None


def measure(model, probe: LeakageProbe, config: CptConfig, rt: Runtime) -> dict[str, dict[str, float]]:
    """{set: {bpb_base_tokenization, bpb_kept_rows, leakage}} (summed over ranks)."""
    out = {}
    for vs, nlls in zip(probe.sets, score_sets(model, probe.sets, config, rt, "leakage", probe.kept), strict=True):
        bits = 1 / math.log(2) / max(vs.stream.num_bytes, 1)
        full, kept = (nll * bits for nll in nlls)
        out[vs.name] = {"bpb_base_tokenization": full, "bpb_kept_rows": kept, "leakage": full / kept - 1}
    return out


def step0_row(ext_by_set: dict[str, float], leak: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """One initialisation's step-0 row per set: extended-tokenizer BPB and base-tokenisation BPB, each
    next to (and as a ratio of) the base model's BPB on the same text."""
    out = {}
    for name, ext in ext_by_set.items():
        row = leak.get(name)
        if row is None:
            out[name] = {"bpb_extended": ext}
            continue
        base = row["bpb_kept_rows"]
        out[name] = {
            "bpb_base_model": base,
            "bpb_extended": ext,
            "extended_vs_base": ext / base,
            "bpb_base_tokenization": row["bpb_base_tokenization"],
            "base_tokenization_vs_base": row["bpb_base_tokenization"] / base,
        }
    return out


def format_table(table: dict[str, dict[str, dict[str, float]]]) -> str:
    """The step-0 leakage table as Markdown (tabulate): one row per (initialisation, set), — where a set has no
    base-model figure."""
    columns = {
        "bpb_base_model": "base model BPB",
        "bpb_extended": "extended tokenizer BPB",
        "extended_vs_base": "× base",
        "bpb_base_tokenization": "base tokenisation BPB",
        "base_tokenization_vs_base": "× base",
    }
    rows = [[method, name, *map(r.get, columns)] for method, sets in table.items() for name, r in sets.items()]
    head = ["initialisation", "set", *columns.values()]
    return tabulate(rows, head, "pipe", floatfmt=".4f", missingval="—")
