#!/usr/bin/env python
"""Import every production module the GPU machine runs, and the libraries its GPU path needs.

The device script (scripts/gpu_check.sh) runs this before any phase, and the CPU rehearsal
(scripts/gpu_rehearsal.sh) runs it in its replica of the device's environment: a wheel missing from
the carried set (`ModuleNotFoundError: No module named 'pydantic_settings'`) or a version conflict
fails here, in seconds, naming the module. Every module of shared/ and of each service is imported;
the coordinator is not (it runs on the host that submits work, not on the GPU machine: it needs
boto3/sagemaker, which the device does not have and does not need).

  python scripts/gpu_imports.py            # exit 1 and one line per module that fails
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "dilforge_shared": ROOT / "shared",
    "dilforge_tokenizer": ROOT / "services" / "tokenizer",
    "dilforge_cpt": ROOT / "services" / "cpt",
    "dilforge_sft": ROOT / "services" / "sft",
    "dilforge_eval": ROOT / "services" / "eval",
}
# what the GPU path imports lazily (inside functions): Liger on CUDA, TRL/PEFT for SFT, datasets for TRL
LIBRARIES = (
    "torch",
    "triton",
    "transformers",
    "accelerate",
    "peft",
    "trl",
    "datasets",
    "liger_kernel.transformers",
    "pydantic",
    "pydantic_settings",
    "dotenv",
    "safetensors",
    "tokenizers",
    "numpy",
    "yaml",
    "tqdm",
)


def production_modules() -> list[str]:
    names = []
    for package, root in PACKAGES.items():
        names.append(package)
        for info in pkgutil.walk_packages([str(root / package)], prefix=f"{package}."):
            if not info.name.endswith("__main__"):
                names.append(info.name)
    return names


def main() -> int:
    for root in PACKAGES.values():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    failed = []
    names = [*LIBRARIES, *production_modules()]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit status says it
            failed.append(name)
            print(f"gpu_imports: {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            if "-v" in sys.argv:
                traceback.print_exc()
    print(
        f"gpu_imports: {len(names) - len(failed)} of {len(names)} modules import (python {sys.version.split()[0]})",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
