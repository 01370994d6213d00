"""Training curves of the CPT/SFT stages, read from their manifests or TensorBoard logs.

The stages record history differently as they evolve, so this reads any list of per-step records
(dicts with a `step` and numeric values) found in the manifest metrics (`history`, `log_history`,
...) and keeps the loss-like series; TensorBoard event files inside the artifact are the fallback.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("dilforge.eval")

Series = dict[str, list[tuple[float, float]]]   # name -> [(step, value)]


def _is_curve_key(key: str) -> bool:
    k = key.lower()
    return ("loss" in k or "perplexity" in k or k.endswith("ppl")) and "scale" not in k


def _records(node: Any, path: str = "") -> list[tuple[str, list[dict]]]:
    """Every list of step records in a metrics tree, with its path."""
    found = []
    if isinstance(node, list) and node and all(isinstance(r, dict) for r in node) \
            and sum(1 for r in node if "step" in r or "global_step" in r) >= max(1, len(node) // 2):
        found.append((path, node))
    elif isinstance(node, dict):
        for k, v in node.items():
            found += _records(v, f"{path}.{k}" if path else k)
    return found


def from_metrics(metrics: dict) -> Series:
    series: Series = {}
    for path, rows in _records(metrics):
        last = path.split(".")[-1]
        prefix = "" if last in ("history", "log_history", "train_history", "train_loss_history", "curves") else f"{last}/"
        for r in rows:
            step = r.get("step", r.get("global_step"))
            if not isinstance(step, (int, float)):
                continue
            for k, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and _is_curve_key(k):
                    series.setdefault(prefix + k, []).append((float(step), float(v)))
    return {k: sorted(v) for k, v in series.items() if v}


def from_tensorboard(root: Path) -> Series:
    files = sorted(root.rglob("*tfevents*")) if root.is_dir() else []
    if not files:
        return {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    series: Series = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        try:
            acc.Reload()
        except Exception as exc:  # noqa: BLE001 - a truncated event file should not sink the report
            log.warning("cannot read %s: %s", f, exc)
            continue
        for tag in acc.Tags().get("scalars", []):
            if _is_curve_key(tag):
                series.setdefault(tag, []).extend((float(e.step), float(e.value)) for e in acc.Scalars(tag))
    return {k: sorted(v) for k, v in series.items()}


def training_curves(metrics: dict, artifact_dir: Path | None) -> Series:
    series = from_metrics(metrics or {})
    if not series and artifact_dir is not None:
        series = from_tensorboard(artifact_dir)
    return series
