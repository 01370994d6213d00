"""The machine-and-date line every benchmark prints, so each number in docs/benchmarks.md names its hardware."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def describe(*libraries: str) -> str:
    """UTC date, CPU, cores (and affinity), GPU, torch threads, python and library versions."""
    parts = [
        f"date {datetime.now(UTC).isoformat(timespec='seconds')}",
        f"CPU {cpu_model()}, {os.cpu_count()} cores (affinity {len(os.sched_getaffinity(0))})",
    ]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        parts += [f"GPU {gpu}", f"torch {torch.__version__} ({torch.get_num_threads()} threads)"]
    except ImportError:
        pass
    parts.append(f"python {platform.python_version()}")
    for lib in libraries:
        try:
            parts.append(f"{lib} {version(lib)}")
        except PackageNotFoundError:
            parts.append(f"{lib} not installed")
    return "; ".join(parts)
