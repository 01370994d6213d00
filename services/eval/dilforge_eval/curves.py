"""Training curves of the CPT/SFT stages, read typed from their manifests (`CptMetrics.curves`,
`SftMetrics.curves`: loss per logged step, and CPT's validation loss per validation step)."""

from __future__ import annotations

from dilforge_shared.metrics import CptMetrics, SftMetrics

Series = dict[str, list[tuple[float, float]]]  # name -> [(step, value)]


def training_curves(metrics: CptMetrics | SftMetrics) -> Series:
    return {k: sorted(v) for k, v in metrics.curves().items()}
