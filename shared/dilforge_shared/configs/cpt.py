"""CPT stage config (skeleton; owned by the CPT service work)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import DataSource, StageConfig


class CptConfig(StageConfig):
    stage: ClassVar[str] = "cpt"
    artifact_kind: ClassVar[str] = "model"
    consumes: ClassVar[tuple[str, ...]] = ("tokenizer",)

    corpora: list[DataSource] = Field(default_factory=list, description="Training corpora with mixture weights.")

    def data_sources(self) -> list[DataSource]:
        return list(self.corpora)
