"""SFT stage config (skeleton; owned by the SFT service work)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import DataSource, StageConfig


class SftConfig(StageConfig):
    stage: ClassVar[str] = "sft"
    artifact_kind: ClassVar[str] = "adapter"
    consumes: ClassVar[tuple[str, ...]] = ("cpt",)

    train: list[DataSource] = Field(default_factory=list, description="Chat or instruction JSONL files.")

    def data_sources(self) -> list[DataSource]:
        return list(self.train)
