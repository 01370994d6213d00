"""What a run reports: metric rows to TensorBoard, log lines and a progress bar, and the throughput
numbers behind them (FLOPs per token, device peak, memory)."""

from __future__ import annotations

import contextlib
import logging
import math
import resource
from pathlib import Path
from typing import Any

import torch
from dilforge_shared.progress import Progress, fmt_value

from .config import CptConfig
from .runtime import Runtime

log = logging.getLogger("dilforge.cpt")

# Peak dense (no sparsity) bf16 tensor-core TFLOP/s by device name as torch.cuda.get_device_name
# reports it (NVIDIA datasheets), for MFU. The first entry whose key is in the name wins, so variants
# come before their family; override with cpt.peak_tflops_per_device.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # H200 SXM
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),  # H100 SXM (HBM3)
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("B200", 2250.0),
)


def flops_per_token(model_config, num_params: int, seq_len: int, phase: int = 2, causal: bool = True) -> float:
    """Training FLOPs per token (PaLM appendix B) for MFU: 6·N + 6·L·d·T in phase 2, N the non-embedding
    parameters plus the LM head, attention counted causal (`causal=False`: the dense 12·L·d·T). Phase 1 freezes
    the blocks: 4·N + 2·V·d (the LM head's weight gradient) + attention."""
    d, layers, vocab = model_config.hidden_size, model_config.num_hidden_layers, model_config.vocab_size
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    matmul_params = num_params if tied else num_params - vocab * d
    attention = (6.0 if causal else 12.0) * layers * d * seq_len
    if phase == 1:
        return 4.0 * matmul_params + 2.0 * vocab * d + attention
    return 6.0 * matmul_params + attention


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation against `peak_flops`: the device's datasheet peak (PEAK_TFLOPS) or the
    matmul ceiling measured on the device in the same run (bench/gpu_ceilings.py); reports give both."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops else None


def device_peak_tflops(name: str) -> float | None:
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def peak_flops(config: CptConfig, rt: Runtime) -> float | None:
    if config.peak_tflops_per_device:
        return config.peak_tflops_per_device * 1e12
    tflops = device_peak_tflops(torch.cuda.get_device_name(rt.device)) if rt.cuda else None
    return tflops * 1e12 if tflops else None


def peak_memory_gb(rt: Runtime) -> float:
    if rt.cuda:
        return torch.cuda.max_memory_allocated(rt.device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux; never reset


class PeakMemory:
    """Peak memory of training and of evaluation kept apart (CUDA: the allocator's peak is reset at
    each phase start and around each evaluation; CPU: the process's max RSS, which cannot be reset)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.train_gb = 0.0

    def _reset(self) -> None:
        if self.rt.cuda:
            torch.cuda.reset_peak_memory_stats(self.rt.device)

    def start_phase(self) -> None:
        self.train_gb = 0.0
        self._reset()

    def training_gb(self) -> float:
        return max(self.train_gb, peak_memory_gb(self.rt))

    @contextlib.contextmanager
    def evaluating(self):
        """Yields a dict whose `gb` is the evaluation's own peak afterwards (None on CPU)."""
        self.train_gb = self.training_gb()
        self._reset()
        out: dict[str, float | None] = {"gb": None}
        try:
            yield out
        finally:
            if self.rt.cuda:
                out["gb"] = peak_memory_gb(self.rt)
            self._reset()


class MetricsLog:
    """Where metric rows go besides the TrainState: TensorBoard (rank 0), parseable `key=value` log
    lines, and a progress bar on a TTY."""

    def __init__(self, tb_dir: Path | None, total_steps: int, rt: Runtime, start_step: int):
        self.rt = rt
        self.writer = None
        self.progress = Progress("cpt", total_steps, unit="steps", initial=start_step, log=log, enabled=rt.is_main)
        if rt.is_main and tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tb_dir))

    def record(self, step: int, values: dict[str, Any], kind: str = "train") -> dict | None:
        """The row {"step": step, **values} on global rank 0 (written out), None elsewhere."""
        if not self.rt.is_main:
            return None
        row = {"step": step, **values}
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
        self.progress.write(" ".join(f"{k}={fmt_value(v)}" for k, v in row.items()))
        return row

    def tick(self, loss: float) -> None:
        self.progress.update(1, loss=loss)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()  # flushes
        self.progress.close()
