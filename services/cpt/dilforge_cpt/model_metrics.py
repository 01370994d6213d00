"""The model stage's metrics: where the base model came from and what it is."""

from __future__ import annotations

from dilforge_shared.manifest import Metrics
from pydantic import Field


class ModelMetrics(Metrics):
    """The model stage's provenance (architecture.md "Base models are artifacts")."""

    source: str
    source_kind: str
    sha256: str
    package: str | None = None
    version: str | None = None
    file: str | None = None
    license: str | None = None
    description: str | None = None
    dequantized_from: str | None = None
    gguf_file: str | None = None
    gguf_sha256: str | None = None
    gguf_architecture: str | None = None
    gguf_tensors_skipped: list[str] = Field(default_factory=list)
    num_parameters: int
    dtype: str
    architecture: str | None = None
    vocab_size: int | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    tie_word_embeddings: bool | None = None
    family: str | None = None
