"""What every stage config shares: strict validation, data sources, and the stage's wiring."""

from __future__ import annotations

import logging
import warnings
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..corpus import MAX_DOCUMENT_BYTES, Oversize, TextFormat

log = logging.getLogger("dilforge.config")


def deprecated(message: str) -> None:
    """A DeprecationWarning for code that loads configs, and a log line for people running the CLI (Python hides
    DeprecationWarnings raised outside __main__ by default)."""
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning(message)


class StrictModel(BaseModel):
    """Unknown fields are errors, so a typo in a config never silently falls back to a default."""
    model_config = ConfigDict(extra="forbid", validate_default=True)


def rename_fields(data, renamed: dict[str, str], where: str):
    """Map deprecated field names to their new ones (a `model_validator(mode="before")` helper).

    Old names keep working for one minor version of the config schema, with a DeprecationWarning that names the
    new field; giving both the old and the new name is an error, so a config never means two things.
    """
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{where}{old} and {where}{new} are the same setting; keep only {new}")
        data[new] = data.pop(old)
        deprecated(f"config field {where}{old} is deprecated; use {where}{new} (the old name goes away in the next "
                   f"minor version of the config schema)")
    return data


def kernels_switch(value, where: str):
    """`liger` used to be a bool in the cpt config (true = on CUDA, never on CPU, i.e. today's `auto`)."""
    if isinstance(value, bool):
        new = "auto" if value else "off"
        deprecated(f"config field {where}liger: {str(value).lower()} is deprecated; write {where}liger: {new} "
                   f"(auto|'on'|off; YAML reads unquoted on/off as booleans)")
        return new
    return value


Switch = Literal["auto", "on", "off"]


class DataSource(StrictModel):
    """A corpus or text set: a file, folder, glob, or S3 object/prefix."""
    uri: str = Field(description="Local path, file://, glob, or s3:// URI of the data.")
    format: TextFormat = Field(default="auto", description="File format; 'auto' decides by extension.")
    text_field: str = Field(default="text", description="JSONL field, TSV column or parquet column with the text.")
    name: str | None = Field(default=None, description="Short name for reports (defaults to the file name).")
    weight: float = Field(default=1.0, gt=0, description="Mixture weight where a stage mixes several sources.")
    max_document_bytes: int = Field(
        default=MAX_DOCUMENT_BYTES, ge=64, le=1 << 30,
        description="Largest line/document read at once, in UTF-8 bytes; memory stays bounded for any input.")
    on_oversize: Oversize = Field(
        default="error", description="A longer line: error (names file:line), split into documents of at most "
        "max_document_bytes (txt, parquet), truncate, or skip with a warning. JSONL/TSV records: error or skip.")

    @property
    def bounds(self) -> dict:
        """Keyword arguments for the corpus readers (iter_texts, iter_located_texts, iter_records)."""
        return {"max_document_bytes": self.max_document_bytes, "on_oversize": self.on_oversize}

    @property
    def label(self) -> str:
        return self.name or self.uri.rstrip("/").rsplit("/", 1)[-1]


class StageConfig(StrictModel):
    """Base of the four stage configs.

    `stage`: the stage's name; `artifact_kind`: what it publishes; `consumes`: upstream stages
    whose manifests the coordinator feeds it when they are in the same pipeline (as inputs named
    after those stages).
    """
    stage: ClassVar[str]
    artifact_kind: ClassVar[str]
    consumes: ClassVar[tuple[str, ...]] = ()
    required_inputs: ClassVar[tuple[str, ...]] = ()

    seed: int = Field(default=0, description="Seed for every random choice the stage makes.")

    def data_sources(self) -> list[DataSource]:
        """Raw data the stage reads; their digests are part of the artifact fingerprint."""
        return []

    def model_uris(self) -> list[str]:
        """Model or tokenizer folders read besides upstream artifacts; their content is fingerprinted too."""
        return []

    def needed_inputs(self) -> tuple[str, ...]:
        """Upstream inputs this config cannot run without: `required_inputs`, plus those its fields leave open
        (e.g. no `base_model` given → the base model must come from the pipeline's `model` stage)."""
        return self.required_inputs

    def missing_inputs_message(self, missing: list[str]) -> str:
        """The one-line error when `missing` upstream inputs are absent; configs override it to name the field
        that would have made the input unnecessary."""
        return f"stage {self.stage} needs inputs {missing}"


Precision = Literal["auto", "bf16", "fp32"]
