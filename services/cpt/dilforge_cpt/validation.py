"""Validation of the model being trained: loss per text token and bits per byte, overall and per
validation set, by the shared definition (`dilforge_shared.bpb`) that eval reports too."""

from __future__ import annotations

import logging
import math

import torch
from dilforge_shared.bpb import eval_mode, stream_nll
from dilforge_shared.progress import Progress

from .config import CptConfig
from .data import ValidationSet
from .metrics import SET_PREFIX  # a validation row's `val_bpb/<set>`, as CptMetrics reads it
from .runtime import Runtime

log = logging.getLogger("dilforge.cpt")


def window_and_stride(config: CptConfig) -> tuple[int, int]:
    return config.seq_len, config.validation_stride or max(1, config.seq_len // 2)


def score_sets(
    model, sets: list[ValidationSet], config: CptConfig, rt: Runtime, desc: str, kept: torch.Tensor | None = None
) -> list[tuple[float, float]]:
    """Per set, `bpb.stream_nll`'s (NLL, text tokens), or with `kept` (NLL, NLL over the kept rows' softmax):
    each rank scores its share of the windows in eval mode under the run's autocast, the sums are all-reduced.
    Validation and the leakage pass both score through here."""
    window, stride = window_and_stride(config)
    batch_size = config.eval_micro_batch_size or config.micro_batch_size
    sums: list[float] = []
    with eval_mode(model), rt.autocast():
        for vs in sets:
            with Progress(f"{desc} {vs.name}", 0, unit="batches", log=log, enabled=rt.is_main) as progress:
                nll, count, _ = stream_nll(
                    model,
                    vs.stream,
                    window,
                    stride,
                    batch_size,
                    rank=rt.rank,
                    world=rt.world,
                    on_batch=progress.batches,
                    kept=kept,
                )
            sums += [*nll] if kept is not None else [nll, float(count)]
    sums = rt.all_sum(sums)
    return list(zip(sums[0::2], sums[1::2], strict=True))


def evaluate(
    model, val: list[ValidationSet], config: CptConfig, rt: Runtime, desc: str = "validation"
) -> dict[str, float]:
    """val_loss (nats per text token) and val_bpb over all sets, and `val_bpb/<set>` for each set."""
    sums = score_sets(model, val, config, rt, desc)
    nll_total, count_total = sum(nll for nll, _ in sums), sum(count for _, count in sums)
    bytes_total = sum(vs.stream.num_bytes for vs in val)
    out = {"val_loss": nll_total / max(count_total, 1.0), "val_bpb": nll_total / math.log(2) / max(bytes_total, 1)}
    for vs, (nll, _) in zip(val, sums, strict=True):
        out[f"{SET_PREFIX}{vs.name}"] = nll / math.log(2) / max(vs.stream.num_bytes, 1)
    return out


def bpb_by_set(row: dict) -> dict[str, float]:
    """{set name: bpb} from a validation row."""
    return {k.removeprefix(SET_PREFIX): v for k, v in row.items() if k.startswith(SET_PREFIX)}
