"""Typed metrics: each stage publishes one pydantic model (named by its config class's `metrics_model`) in its
manifest's `metrics`, and a downstream stage (eval) reads it back typed. The models eval reads live here
(`metrics/<stage>.py`); a model only its stage and the coordinator use lives in that stage's package.

Validated when published (`contract.publish_result` → `validate_metrics`) and parsed again when read
(`read_metrics`), so a metric renamed in a producer fails that stage's publish (unknown keys are refused,
`extra="forbid"`) and a field renamed without its consumer fails the consumer's tests (it reads attributes, not
key names). To add a metric: add a typed field (optional, with a default), then write it in the stage.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import DilforgeError, InputError


class Metrics(BaseModel):
    """Base: unknown keys are an error, so a renamed metric cannot slip through."""

    model_config = ConfigDict(extra="forbid")


M = TypeVar("M", bound=BaseModel)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"metrics.{where}: {err['msg']}{more}"


def validate_metrics(stage: str, model: type[M], metrics: dict[str, Any]) -> M:
    """What a run of `stage` is about to publish, as its metrics model (DilforgeError naming the field: a bug in
    the stage, caught before anything is published)."""
    try:
        return model.model_validate(metrics)
    except ValidationError as exc:
        raise DilforgeError(
            f"stage {stage} publishes metrics that do not match {model.__module__}.{model.__name__}: "
            f"{_first_error(exc)}"
        ) from None


def read_metrics(model: type[M], metrics: dict[str, Any], uri: str) -> M:
    """An upstream manifest's metrics, typed; InputError naming the artifact and field when they do not parse."""
    try:
        return model.model_validate(metrics)
    except ValidationError as exc:
        raise InputError(
            f"metrics do not match {model.__name__} (an artifact of another dilforge version?): {_first_error(exc)}",
            path=uri,
        ) from None
