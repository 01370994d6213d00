"""Model stage config: import a base model as a `model` artifact. No torch: the coordinator fingerprints the
stage from the source's identity alone."""

from __future__ import annotations

from typing import ClassVar, Literal

from dilforge_shared.configs import StageConfig
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.identity import source_ref
from dilforge_shared.manifest import MANIFEST_NAME, InputRef
from dilforge_shared.models import find_dir
from dilforge_shared.store import local_path
from pydantic import Field, field_validator

from .model_metrics import ModelMetrics
from .recipes import GGUF_CONVERTER_VERSION, RECIPES, source_kind


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

    def source_ref(self, endpoint_url: str | None = None) -> InputRef:
        """Identity of the source: a recipe's pinned sha256 (nothing downloaded), else its content."""
        kind = source_kind(self.source)
        if kind == "recipe":
            recipe = RECIPES[self.source]
            return InputRef(name="source", kind="data", uri=recipe.uri, sha256=recipe.sha256)
        if kind == "gguf" and not local_path(self.source).is_file():
            raise InputError("model.source: no such GGUF file", path=self.source)
        folder = local_path(self.source) if kind == "folder" else None
        if folder is not None and folder.is_dir() and not (folder / MANIFEST_NAME).is_file():
            try:  # before its digest reads every file: a folder that is no model is named at once
                find_dir(folder, "model", self.source)
            except ConfigError as exc:
                raise InputError(f"model.source: {exc}") from None
        return source_ref(self.source, "source", endpoint_url)

    def source_refs(self, endpoint_url: str | None = None) -> list[InputRef]:
        return [self.source_ref(endpoint_url)]
