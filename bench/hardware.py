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
    """UTC date, CPU (and whether it computes bf16), cores (and affinity), GPU, torch threads, python and library
    versions."""
    from dilforge_shared.runtime_policy import cpu_computes_bf16  # CPT's precision auto trains in bf16 with them

    bf16 = "with" if cpu_computes_bf16() else "without"
    parts = [
        f"date {datetime.now(UTC).isoformat(timespec='seconds')}",
        f"CPU {cpu_model()} ({bf16} bf16 instructions), {os.cpu_count()} cores "
        f"(affinity {len(os.sched_getaffinity(0))})",
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
