"""The curate stage's metrics: documents and bytes kept per step and source, redactions."""

from __future__ import annotations

from dilforge_shared.manifest import Metrics
from pydantic import Field


class CurateStep(Metrics):
    step: str
    removed: int
    reasons: dict[str, int] = Field(default_factory=dict)
    examples: list[str] = Field(default_factory=list)


class SourceCount(Metrics):
    read: int
    kept: int


class Redacted(Metrics):
    documents: int
    replaced: int


class CurateMetrics(Metrics):
    """The curate stage's counts (services/curate report.py); report.md and README.md carry the same."""

    language: str
    documents_read: int
    documents_kept: int
    chars_read: int
    chars_kept: int
    words_kept: int
    tokens_kept: int | None = None
    per_source: dict[str, SourceCount]
    empty_sources: list[str] = Field(default_factory=list)
    steps: list[CurateStep]
    repairs: dict[str, int]
    redacted: dict[str, Redacted]
    num_shards: int
    seconds: dict[str, float]
    bytes_read: int | None = None  # UTF-8 bytes of the documents read
    cpu_seconds: dict[str, float] = Field(default_factory=dict)  # per phase, summed over its tasks, and total
    mb_per_cpu_second: float | None = None  # throughput per core: MB read per CPU-second of every task
    documents_per_cpu_second: float | None = None
