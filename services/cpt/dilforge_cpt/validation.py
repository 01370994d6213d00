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


def score_set(model, vs: ValidationSet, config: CptConfig, rt: Runtime, desc: str, kept: torch.Tensor | None = None):
    """`bpb.stream_nll` of one set over this rank's share of its windows, under the run's autocast, with its
    progress logged; the caller holds `eval_mode` and all-reduces. Validation and the leakage pass both score
    through here."""
    window, stride = window_and_stride(config)
    batch_size = config.eval_micro_batch_size or config.micro_batch_size
    with Progress(f"{desc} {vs.name}", 0, unit="batches", log=log, enabled=rt.is_main) as progress, rt.autocast():
        return stream_nll(
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


@torch.no_grad()
def evaluate(
    model, val: list[ValidationSet], config: CptConfig, rt: Runtime, desc: str = "validation"
) -> dict[str, float]:
    """val_loss (nats per text token) and val_bpb over all sets, and `val_bpb/<set>` for each set; each rank
    scores its share of every set's windows, the sums are all-reduced."""
    sums: list[float] = []
    with eval_mode(model):
        for vs in val:
            nll, count, _ = score_set(model, vs, config, rt, desc)
            sums += [nll, float(count)]
    sums = rt.all_sum(sums)
    nll_total, count_total = sum(sums[0::2]), sum(sums[1::2])
    bytes_total = sum(vs.stream.num_bytes for vs in val)
    out = {"val_loss": nll_total / max(count_total, 1.0), "val_bpb": nll_total / math.log(2) / max(bytes_total, 1)}
    for i, vs in enumerate(val):
        out[f"{SET_PREFIX}{vs.name}"] = sums[2 * i] / math.log(2) / max(vs.stream.num_bytes, 1)
    return out


def bpb_by_set(row: dict) -> dict[str, float]:
    """{set name: bpb} from a validation row."""
    return {k.removeprefix(SET_PREFIX): v for k, v in row.items() if k.startswith(SET_PREFIX)}
