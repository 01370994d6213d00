"""The one device / precision / kernels policy every stage and `coordinator chat` asks.

Pure functions of the machine's facts (`DeviceFacts`), so they are tested without a GPU; only `probe_device`
imports torch. An impossible request is a ConfigError naming the field."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

# The model types whose layers the Liger kernels we apply (apply_liger_kernel_to_llama) patch.
LIGER_MODEL_TYPES = frozenset({"llama"})


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine offers; passed in by tests, probed by `probe_device` in a real run."""

    cuda: bool
    bf16_supported: bool = False  # the CUDA device computes in bf16 natively (Ampere or newer)
    cpu_bf16: bool = False  # the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 instructions)
    flash_attn: bool = False  # the flash-attn package is importable (SFT's packed attention)


def probe_device() -> DeviceFacts:
    import torch

    cuda = torch.cuda.is_available()
    return DeviceFacts(
        cuda=cuda,
        bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()),
        cpu_bf16=cpu_computes_bf16(),
        flash_attn=importlib.util.find_spec("flash_attn") is not None,
    )


def cpu_computes_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU has bf16 arithmetic instructions (Linux: the kernel's CPU flags). Without them torch
    emulates bf16 on CPU, slower than fp32, so `auto` must not choose it."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class RuntimePolicy:  # the decision for one process
    device: str  # cuda or cpu
    precision: str  # bf16 or fp32
    liger: bool

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    def torch_dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32


def choose_precision(
    requested: str, device: str, facts: DeviceFacts, field: str, cpu_bf16: bool, auto_cpu: bool
) -> str:
    """auto: bf16 on a CUDA device with bf16, on a bf16-native CPU only where the stage asks (`auto_cpu`: CPT
    training), else fp32 so measurements compare. `cpu_bf16` False refuses bf16 on CPU."""
    if requested == "fp32":
        return "fp32"
    if requested == "bf16":
        if not (facts.bf16_supported if device == "cuda" else cpu_bf16):
            raise ConfigError(f"{field}: bf16 needs a CUDA GPU with bf16 support; use auto or fp32")
        return "bf16"
    if requested != "auto":
        raise ConfigError(f"{field}: {requested!r} is not one of auto, bf16, fp32")
    if device == "cuda":
        return "bf16" if facts.bf16_supported else "fp32"
    return "bf16" if auto_cpu and cpu_bf16 and facts.cpu_bf16 else "fp32"


def choose_liger(requested: str, device: str, model_type: str | None = None, field: str = "liger") -> bool:
    """Whether the Liger layer kernels apply; model_type None = not known yet (checked again later)."""
    if requested == "off":
        return False
    if device != "cuda":
        problem = "the Liger kernels need CUDA"
    elif model_type is not None and model_type not in LIGER_MODEL_TYPES:
        problem = f"no Liger kernels for model_type {model_type!r} (only {', '.join(sorted(LIGER_MODEL_TYPES))})"
    else:
        return True
    if requested == "on":
        raise ConfigError(f"{field}: {problem}; use auto or off")
    return False


def decide(
    stage: str,
    *,
    device: str = "auto",
    precision: str = "auto",
    liger: str = "off",
    model_type: str | None = None,
    cpu_bf16: bool = True,
    auto_cpu_bf16: bool = False,
    facts: DeviceFacts | None = None,
) -> RuntimePolicy:
    """The whole policy for one stage's process (device `auto` = cuda when available); config errors name
    `<stage>.<field>`."""
    facts = probe_device() if facts is None else facts
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"{stage}.device: {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not facts.cuda:
        raise ConfigError(f"{stage}.device: 'cuda' requested but no CUDA device is available; use auto or cpu")
    dev = "cuda" if device != "cpu" and facts.cuda else "cpu"
    return RuntimePolicy(
        dev,
        choose_precision(precision, dev, facts, f"{stage}.precision", cpu_bf16, auto_cpu_bf16),
        choose_liger(liger, dev, model_type, f"{stage}.liger"),
    )
