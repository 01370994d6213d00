"""Model stage config: import a base model into the store as a `model` artifact.

No torch import here: the coordinator fingerprints this stage from the source's identity alone
(a recipe's pinned sha256, a folder's or prefix's content digest) without running the importer.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from ..metrics.model import ModelMetrics
from ..recipes import GGUF_CONVERTER_VERSION, RECIPES
from .base import StageConfig


class ModelConfig(StageConfig):
    """Where the base model comes from. Downstream stages get the artifact as their input named `model`."""

    stage: ClassVar[str] = "model"
    metrics_model: ClassVar[type[ModelMetrics]] = ModelMetrics
    artifact_kind: ClassVar[str] = "model"

    source: str = Field(
        description="A built-in recipe name (" + ", ".join(sorted(RECIPES)) + "), a local .gguf file (Llama "
        "architecture), a local HF model folder (config.json, safetensors weights, tokenizer.json), or an "
        "s3:// prefix of one. A relative folder is written with a slash (./my-model). Never a model-hub id.",
    )
    gguf_converter: Literal[GGUF_CONVERTER_VERSION] = Field(
        GGUF_CONVERTER_VERSION,
        description="Version of dilforge's GGUF → safetensors converter (not a choice: it is part of the resolved "
        "config so that a changed converter gives new artifact ids instead of reusing an older conversion).",
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, source: str) -> str:
        source = source.strip()
        if not source:
            raise ValueError("source is empty")
        if "/" not in source and not source.endswith(".gguf") and source not in RECIPES:
            raise ValueError(
                f"{source!r} is not a built-in recipe ({', '.join(sorted(RECIPES))}); "
                "write a local folder with a slash (./my-model) or give an s3:// prefix"
            )
        return source
