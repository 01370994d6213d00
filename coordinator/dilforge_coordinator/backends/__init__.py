"""Where a stage runs. Each backend turns a StageJob into a finished, published artifact."""

from __future__ import annotations

import importlib

from dilforge_shared.errors import ConfigError

from ..pipeline import Backend

# name -> module.class, imported only when chosen (the SageMaker SDK and docker stay out of a local run)
BACKENDS = {
    "local": "local.LocalBackend",
    "compose": "compose.ComposeBackend",
    "sagemaker": "sagemaker.SageMakerBackend",
    "sagemaker-local": "sagemaker_local.SageMakerLocalBackend",
}


def get_backend(name: str, **options) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {tuple(BACKENDS)}")
    module, cls = BACKENDS[name].split(".")
    return getattr(importlib.import_module(f".{module}", __name__), cls)(**options)
