"""The one device / precision / kernels policy every stage and `coordinator chat` asks.

Each stage used to answer "cuda or cpu? bf16 or fp32? Liger? which attention kernel?" on its own,
and the answers disagreed (CPT chose bf16 on any CUDA GPU, eval only on one with bf16 support; SFT
applied the Llama Liger kernels to any architecture). Here the rules are written once, as pure
functions of the facts about the machine (`DeviceFacts`), so they are tested without a GPU by
passing the facts in. Only `probe_device` looks at the machine, and it imports torch lazily: this
module stays importable by the torch-free coordinator and shared library.

Rules:
- device: `auto` = cuda when available; `cuda` without a CUDA device is a config error.
- precision: `auto` = bf16 on a CUDA device with bf16 support; on a CPU that computes bf16 natively
  (AVX512-BF16 or AMX) only where the stage asks for it (`auto_cpu_bf16=True`: CPT's training, autocast
  over fp32 weights, about twice as fast there); fp32 otherwise. Measuring stages (eval, chat) keep
  fp32 on CPU so their figures compare across machines. `bf16` on a CUDA device without bf16 support
  is a config error, and on CPU where the stage does not allow it (`cpu_bf16=False`: SFT, whose
  trainer is only exercised in fp32 on CPU).
- liger: only on CUDA (Triton kernels) and only for `llama` models (the kernels patched are
  Llama's); `on` where it cannot apply is a config error, `auto` quietly stays off.
- attention: see `choose_attention` (packing decides whether a varlen/flex kernel is worth it).
- SDPA backend on CUDA: see `choose_sdpa_backends`: by measurement (a table shipped with the repo,
  `attention_table.json`, or one measured on the machine and named by DILFORGE_ATTENTION_TABLE).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import ConfigError
from .settings import settings

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


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask (a container's cpuset, taskset), not the machine's count.
    CPU-bound stage work (tokenising, counting) sizes its worker processes by it."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class RuntimePolicy:
    """The decision for one process: logged at start and recorded in the manifest's metrics."""

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

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "precision": self.precision,
            "liger": self.liger,
            "attention": self.attention,
            "attention_reason": self.attention_reason,
        }


def choose_device(requested: str, facts: DeviceFacts, field: str = "device") -> Device:
    if requested == "cuda" and not facts.cuda:
        raise ConfigError(f"{field}: 'cuda' requested but no CUDA device is available; use auto or cpu")
    if requested not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"{field}: {requested!r} is not one of auto, cpu, cuda")
    return "cuda" if requested in ("auto", "cuda") and facts.cuda else "cpu"


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
        if device == "cuda" and not facts.bf16_supported:
            raise ConfigError(f"{field}: bf16 needs a CUDA GPU with bf16 support; use auto or fp32")
        if device == "cpu" and not cpu_bf16:
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
        if requested == "on":
            raise ConfigError(f"{field}: the Liger kernels need CUDA; use auto or off")
        return False
    if model_type is not None and model_type not in LIGER_MODEL_TYPES:
        if requested == "on":
            raise ConfigError(
                f"{field}: no Liger kernels for model_type {model_type!r} "
                f"(only {', '.join(sorted(LIGER_MODEL_TYPES))}); use auto or off"
            )
        return False
    return True


def choose_attention(
    requested: str, device: Device, facts: DeviceFacts, packing: bool = False, field: str = "attention"
) -> tuple[str, str]:
    """(attn_implementation, reason).

    Packing is padding-free (TRL's BFD): one row holds several documents told apart only by
    position ids that restart at 0. Kernels that take those boundaries natively are flash-attention's
    varlen path (cu_seq_lens from the collator) and flex attention (a block-sparse BlockMask built from
    the position ids). SDPA and eager get the same boundaries from transformers as a dense
    block-diagonal N x N mask (N = batch x max_length), which on CUDA disables SDPA's flash kernel and
    costs about batch-size times the attention work: fine on CPU, avoided on GPU.
    """
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
    chosen_device = choose_device(device, facts, f"{stage}.device")
    implementation, reason = choose_attention(attention, chosen_device, facts, packing, f"{stage}.attention")
    return RuntimePolicy(
        device=chosen_device,
        precision=choose_precision(
            precision, chosen_device, facts, f"{stage}.precision", cpu_bf16=cpu_bf16, auto_cpu_bf16=auto_cpu_bf16
        ),
        liger=choose_liger(liger, chosen_device, model_type, f"{stage}.liger"),
        attention=implementation,
        attention_reason=reason,
    )


# ---- SDPA backend by measurement ---------------------------------------------------------------
# torch.nn.attention.SDPBackend names, in torch's own default priority on CUDA.
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
ATTENTION_TABLE = Path(__file__).with_name("attention_table.json")


def load_attention_table(path: str | Path | None = None) -> tuple[dict, str]:
    """(measurements, source): DILFORGE_ATTENTION_TABLE if set (bench/gpu_ceilings.py writes one on the
    machine), else the table shipped with the repo. Measurements: {device name: {"shape": ..., "tflops":
    {backend: forward+backward TFLOP/s}, "date": ...}}."""
    path = Path(path or settings().attention_table or ATTENTION_TABLE)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, f"{path} (missing)"
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    measurements = data.get("measurements", {})
    if not isinstance(measurements, dict):
        raise ConfigError(f"{path}: measurements must be an object keyed by device name")
    return measurements, str(path)


def choose_sdpa_backends(
    device: Device,
    device_name: str | None,
    available: Sequence[str],
    measurements: Mapping[str, Mapping],
    source: str = "table",
) -> tuple[tuple[str, ...], str]:
    """(SDPA backends in priority order, reason). () = leave torch's own choice.

    On CUDA the fastest backend MEASURED on this device (forward+backward on the model's attention
    shape) that is also available here goes first; the others follow in torch's order, so a shape the
    first cannot take (a mask, a head dim) still runs. A device with no measurement keeps torch's order,
    and the reason says so: the rule never guesses a speed.
    """
    if device != "cuda":
        return (), "cpu: torch's own SDPA choice (flash-cpu or math)"
    entry = next((m for key, m in measurements.items() if device_name and key in device_name), None)
    if entry is None:
        return (), (
            f"no attention measurement for {device_name!r} in {source}: torch's default order "
            f"({', '.join(SDPA_BACKENDS[:3])}); run bench/gpu_ceilings.py on this GPU to measure"
        )
    speeds = {b: float(t) for b, t in entry.get("tflops", {}).items() if b in available and t}
    if not speeds:
        return (), f"{source}: none of the measured backends is available here; torch's default order"
    best = max(speeds, key=speeds.get)
    order = (best, *[b for b in SDPA_BACKENDS if b != best and b in available])
    ranked = ", ".join(f"{b} {t:.0f}" for b, t in sorted(speeds.items(), key=lambda kv: -kv[1]))
    return order, (
        f"measured on {device_name} ({entry.get('shape', 'model shape')}, {entry.get('date', 'undated')}; "
        f"{source}): {ranked} TFLOP/s fwd+bwd -> {best} first"
    )


def available_sdpa_backends() -> list[str]:
    """The SDPA backends this torch build and device can run (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        return ["MATH"]
    out = []
    checks = {
        "FLASH_ATTENTION": torch.backends.cuda.flash_sdp_enabled,
        "CUDNN_ATTENTION": getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False),
        "EFFICIENT_ATTENTION": torch.backends.cuda.mem_efficient_sdp_enabled,
        "MATH": torch.backends.cuda.math_sdp_enabled,
    }
    for name in SDPA_BACKENDS:
        if checks[name]():
            out.append(name)
    return out
