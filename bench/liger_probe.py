"""Which Liger code a model holds and which Liger kernels ran: measurement probes for the GPU bench
(bench/gpu_cpt.py) and the tests, not used by the stage (which only applies the kernels, dilforge_cpt.sharding)."""

from __future__ import annotations

import contextlib
import importlib


def liger_parts(model) -> list[str]:
    """The modules of `model` that run Liger code (Liger module classes or forwards bound by Liger, the model's
    own forward included). Empty for a plain model."""

    def liger(fn) -> bool:
        fn = getattr(fn, "__func__", fn)
        return (getattr(fn, "__module__", "") or "").startswith("liger_kernel")

    return [
        name or "<model>"
        for name, module in model.named_modules()
        if type(module).__module__.startswith("liger_kernel") or liger(vars(module).get("forward"))
    ]


LIGER_FUNCTIONS = {  # kernel name -> (module, autograd Function) whose calls prove the kernel ran
    "rope": ("liger_kernel.ops.rope", "LigerRopeFunction"),
    "rms_norm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
    "swiglu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
    "fused_linear_cross_entropy": (
        "liger_kernel.ops.fused_linear_cross_entropy",
        "LigerFusedLinearCrossEntropyFunction",
    ),
}


@contextlib.contextmanager
def counting_calls(functions: dict[str, type]):
    """Counts calls of each autograd Function's `apply` while inside, restored after: which Liger kernels
    actually RAN in a step (a bound forward proves only that a kernel was patched in)."""
    counts = dict.fromkeys(functions, 0)
    saved = []
    for name, cls in functions.items():
        original = cls.apply
        saved.append((cls, vars(cls).get("apply")))

        def counted(*a, _name=name, _original=original, **k):
            counts[_name] += 1
            return _original(*a, **k)

        cls.apply = staticmethod(counted)
    try:
        yield counts
    finally:
        for cls, own in saved:
            if own is None:
                del cls.apply
            else:
                cls.apply = own


def liger_functions() -> dict[str, type]:
    out = {}
    for name, (module, cls) in LIGER_FUNCTIONS.items():
        with contextlib.suppress(ImportError, AttributeError):
            out[name] = getattr(importlib.import_module(module), cls)
    return out
