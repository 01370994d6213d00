"""Where a stage runs. Each backend turns a StageJob into a finished, published artifact."""

from __future__ import annotations

from dilforge_shared.errors import ConfigError

from ..pipeline import Backend

BACKENDS = ("local", "compose", "sagemaker", "sagemaker-local")


def get_backend(name: str, **options) -> Backend:
    if name == "local":
        from .local import LocalBackend

        return LocalBackend(**options)
    if name == "compose":
        from .compose import ComposeBackend

        return ComposeBackend(**options)
    if name == "sagemaker":
        from .sagemaker import SageMakerBackend

        return SageMakerBackend(**options)
    if name == "sagemaker-local":
        from .sagemaker_local import SageMakerLocalBackend

        return SageMakerLocalBackend(**options)
    raise ConfigError(f"unknown backend {name!r}; choose one of {BACKENDS}")
