"""The one device / precision / kernels policy every stage and `coordinator chat` asks.

Pure functions of the machine's facts (`DeviceFacts`), so they are tested without a GPU; only `probe_device`
imports torch. device `auto` = cuda when available; precision `auto` = bf16 on a CUDA device with bf16, on a
bf16-native CPU only where the stage allows it (CPT training), fp32 elsewhere so measurements compare;
Liger only on CUDA for `llama`; attention: `choose_attention`. An impossible request is a ConfigError."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import ConfigError

Device = Literal["cuda", "cpu"]
Precision = Literal["bf16", "fp32"]
LigerSetting = Literal["auto", "on", "off"]

# The model types whose layers the Liger kernels we apply (apply_liger_kernel_to_llama) patch.
LIGER_MODEL_TYPES = frozenset({"llama"})


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine offers; passed in by tests, probed by `probe_device` in a real run."""

    cuda: bool
    bf16_supported: bool = False  # the CUDA device computes in bf16 natively (Ampere or newer)
    cpu_bf16: bool = False  # the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 instructions)
    flash_attn: bool = False  # the flash-attn package is importable


def probe_device() -> DeviceFacts:
    """The facts of this machine (imports torch here, never at module import)."""
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
    device: Device
    precision: Precision
    liger: bool
    attention: str  # transformers' attn_implementation
    attention_reason: str  # why this kernel

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    def torch_dtype(self):
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32


def choose_device(requested: str, facts: DeviceFacts, field: str = "device") -> Device:
    if requested not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"{field}: {requested!r} is not one of auto, cpu, cuda")
    if requested == "cuda" and not facts.cuda:
        raise ConfigError(f"{field}: 'cuda' requested but no CUDA device is available; use auto or cpu")
    return "cuda" if requested != "cpu" and facts.cuda else "cpu"


def choose_precision(
    requested: str,
    device: Device,
    facts: DeviceFacts,
    field: str = "precision",
    cpu_bf16: bool = True,
    auto_cpu_bf16: bool = False,
) -> Precision:
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
    return "bf16" if auto_cpu_bf16 and cpu_bf16 and facts.cpu_bf16 else "fp32"


def choose_liger(requested: LigerSetting, device: Device, model_type: str | None = None, field: str = "liger") -> bool:
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


def choose_attention(
    requested: str, device: Device, facts: DeviceFacts, packing: bool = False, field: str = "attention"
) -> tuple[str, str]:
    """(attn_implementation, reason).

    Packed rows hold several documents told apart by position ids. flash-attention's varlen path and flex
    attention take those boundaries natively; SDPA gets a dense block-diagonal mask instead, which disables
    its flash kernel on CUDA: fine on CPU, avoided on GPU."""
    if requested == "flash_attention_2" and not (device == "cuda" and facts.flash_attn):
        raise ConfigError(f"{field}: flash_attention_2 needs CUDA and the flash-attn package; use auto")
    if requested != "auto":
        return requested, f"set by {field}"
    if not packing:
        return "sdpa", "no packing: padded rows, sdpa's own causal kernels"
    if device != "cuda":
        return "sdpa", (
            "packing on CPU: no varlen/flex kernel worth compiling here; sdpa gets a "
            "block-diagonal mask from the position ids (dense, N^2 per packed row)"
        )
    if facts.flash_attn:
        return "flash_attention_2", "packing on CUDA: flash-attn varlen kernel on the collator's cu_seq_lens, no mask"
    return "flex_attention", (
        "packing on CUDA without flash-attn: flex attention with a block-sparse "
        "mask of document boundaries (no N^2 mask)"
    )


def decide(
    stage: str,
    *,
    device: str = "auto",
    precision: str = "auto",
    liger: LigerSetting = "off",
    attention: str = "auto",
    packing: bool = False,
    model_type: str | None = None,
    cpu_bf16: bool = True,
    auto_cpu_bf16: bool = False,
    facts: DeviceFacts | None = None,
) -> RuntimePolicy:
    """The whole policy for one stage's process; config errors name `<stage>.<field>`."""
    facts = probe_device() if facts is None else facts
    dev = choose_device(device, facts, f"{stage}.device")
    return RuntimePolicy(
        dev,
        choose_precision(precision, dev, facts, f"{stage}.precision", cpu_bf16, auto_cpu_bf16),
        choose_liger(liger, dev, model_type, f"{stage}.liger"),
        *choose_attention(attention, dev, facts, packing, f"{stage}.attention"),
    )
