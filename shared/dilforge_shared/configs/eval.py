"""Eval stage config (skeleton; owned by the eval service work)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import DataSource, StageConfig


class EvalConfig(StageConfig):
    stage: ClassVar[str] = "eval"
    artifact_kind: ClassVar[str] = "eval_report"
    consumes: ClassVar[tuple[str, ...]] = ("tokenizer", "cpt", "sft")

    text_sets: list[DataSource] = Field(default_factory=list, description="Text sets for BPB, one per domain.")

    def data_sources(self) -> list[DataSource]:
        return list(self.text_sets)
