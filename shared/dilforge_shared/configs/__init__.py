"""What every stage config shares: strict validation, data sources, and the stage's wiring. CPT and SFT's knobs
are `dilforge_shared.training`, the language codes `configs.language`; each stage's section is its own package's
`config.py`."""

from __future__ import annotations

import posixpath
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from ..errors import ConfigError, field_errors
from ..manifest import InputRef, declared_uri
from ..settings import redact, secret_values

# the corpus readers' formats and their bound on one line/document (a 200 MB line never reaches memory whole)
TextFormat = Literal["auto", "txt", "jsonl", "tsv", "parquet"]
Oversize = Literal["error", "split", "truncate", "skip"]
MAX_DOCUMENT_BYTES = 32 << 20

# Upper bounds of the fields that scale memory or time, far above any real run: a typo such as 1e9 is refused.
MAX_SEED = 2**32 - 1  # numpy's and the lm-eval seeds' range; torch takes up to 2**64
MAX_STEPS = 100_000_000
MAX_BATCH = 65_536  # sequences per step or per forward pass
MAX_TOKENS = 1_048_576  # a sequence, window or context, in tokens


# A config field is part of the artifact id unless it carries RUN_ONLY (how, where or how fast a stage runs, not
# what it makes): changing one keeps the id, so a rerun with another checkpoint cadence resumes its checkpoint.
IDENTITY_KEY = "x-dilforge-identity"
RUN_ONLY = {IDENTITY_KEY: "run-only"}


def is_run_only(info: FieldInfo) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and extra.get(IDENTITY_KEY) == "run-only"


def identity_view(value):
    """`value` (a config model, or lists/dicts of them) as JSON types without its run-only fields, at any depth."""
    if isinstance(value, BaseModel):
        return {
            name: identity_view(getattr(value, name))
            for name, info in type(value).model_fields.items()
            if not is_run_only(info)
        }
    if isinstance(value, (list, tuple)):
        return [identity_view(v) for v in value]
    if isinstance(value, dict):
        return {str(k): identity_view(v) for k, v in value.items()}
    if isinstance(value, str):
        return declared_uri(value)  # an uploaded copy of a local input is identified as that input
    return to_jsonable_python(value)


def _kinds(t) -> set:
    """The basic types a field's type admits (through Annotated, Optional, unions and Literal); Any for others."""
    origin = get_origin(t)
    if origin is Annotated:
        return _kinds(get_args(t)[0])
    if origin in (Union, UnionType, Literal):
        return set().union(*({type(a)} if origin is Literal else _kinds(a) for a in get_args(t)))
    return {t if t in (int, float, bool, type(None)) else Any}


class StrictModel(BaseModel):
    """Unknown fields are errors, so a typo in a config never silently falls back to a default."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value, info):
        """pydantic's lax mode reads `true` as 1 for a number (`num_shards: true` would run one shard): a field
        that takes a number and not a boolean refuses one, naming the field."""
        kinds = _kinds(cls.model_fields[info.field_name].annotation) if isinstance(value, bool) else set()
        if kinds & {int, float} and not kinds & {bool, Any}:
            raise ValueError(f"{str(value).lower()} is a boolean; this field takes a number")
        return value


Switch = Literal["auto", "on", "off"]


# A source may name an upstream stage's corpus artifact instead of files: `uri: artifact:curate`. Its identity is
# then that artifact's id (an upstream ref), and the stage reads the artifact's shards (contract.resolve_sources).
ARTIFACT_PREFIX = "artifact:"
CORPUS_STAGES = ("curate",)


class DataSource(StrictModel):
    """A corpus or text set: a file, folder, glob, or S3 object/prefix."""

    uri: str = Field(description="Local path, file://, glob, or s3:// URI of the data.")
    format: TextFormat = Field(default="auto", description="File format; 'auto' decides by extension.")
    text_field: str = Field(default="text", description="JSONL field, TSV column or parquet column with the text.")
    name: str | None = Field(
        default=None, json_schema_extra=RUN_ONLY, description="Short name for reports (defaults to the file name)."
    )
    weight: float = Field(default=1.0, gt=0, description="Mixture weight where a stage mixes several sources.")
    max_document_bytes: int = Field(
        default=MAX_DOCUMENT_BYTES,
        ge=64,
        le=1 << 30,
        description="Largest line/document read at once, in UTF-8 bytes; memory stays bounded for any input.",
    )
    on_oversize: Oversize = Field(
        default="error",
        description="A longer line: error (names file:line), split into documents of at most "
        "max_document_bytes (txt, parquet), truncate, or skip with a warning. JSONL/TSV records: error or skip.",
    )

    @field_validator("uri")
    @classmethod
    def _normal_uri(cls, uri: str) -> str:
        """A local path in one spelling, so one file has one identity: `file://` dropped, `./`, `a/../`, doubled
        and trailing slashes collapsed (`./x`, `x/`, `file://x` → `x`; `//data/x` → `/data/x`). Other URIs kept."""
        if uri.startswith(ARTIFACT_PREFIX) and uri[len(ARTIFACT_PREFIX) :] not in CORPUS_STAGES:
            raise ValueError(
                f"{uri!r}: an upstream artifact is named {', '.join(ARTIFACT_PREFIX + s for s in CORPUS_STAGES)}"
            )
        if uri.startswith("file://"):
            uri = uri[len("file://") :]
        elif "://" in uri or uri.startswith(ARTIFACT_PREFIX) or not uri:
            return uri
        path = posixpath.normpath(uri)
        return "/" + path.lstrip("/") if path.startswith("//") else path

    @property
    def artifact(self) -> str | None:
        """The upstream stage whose corpus artifact this source is (`uri: artifact:curate`), else None."""
        return self.uri[len(ARTIFACT_PREFIX) :] if self.uri.startswith(ARTIFACT_PREFIX) else None

    @property
    def bounds(self) -> dict:
        """Keyword arguments for the corpus readers (iter_texts, iter_located_texts, iter_records)."""
        return {"max_document_bytes": self.max_document_bytes, "on_oversize": self.on_oversize}

    @property
    def label(self) -> str:
        return self.name or self.uri.rstrip("/").rsplit("/", 1)[-1]


def check_unique_labels(sources: list[DataSource], field: str) -> None:
    """Refuse two sources with one label (per-source metrics and lineage are keyed by it), naming `field`."""
    labels = [s.label for s in sources]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise ValueError(
            f"{field}: two sources are named {dupes[0]!r} (set a distinct `name` on each; the name "
            "defaults to the file name)"
        )


class StageConfig(StrictModel):
    """Base of the stage configs: the metrics model and artifact kind it publishes, the stages it consumes."""

    stage: ClassVar[str]
    metrics_model: ClassVar[type[BaseModel]]
    artifact_kind: ClassVar[str]
    consumes: ClassVar[tuple[str, ...]] = ()
    required_inputs: ClassVar[tuple[str, ...]] = ()

    seed: int = Field(le=MAX_SEED, default=0, description="Seed for every random choice the stage makes.")

    def identity(self) -> dict:
        """The config as the artifact id hashes it: every field but the run-only ones (see RUN_ONLY)."""
        return identity_view(self)

    def data_sources(self) -> list[DataSource]:
        """Every data source the stage reads (files, and upstream corpora named `artifact:<stage>`)."""
        return []

    def file_sources(self) -> list[DataSource]:
        """The sources that are files: their digests are part of the artifact fingerprint."""
        return [s for s in self.data_sources() if s.artifact is None]

    def input_names(self) -> tuple[str, ...]:
        """Every upstream input this config reads when present: `consumes`, and the corpora its sources name."""
        return (*self.consumes, *self.source_inputs())

    def source_inputs(self) -> tuple[str, ...]:
        """Upstream stages whose corpus artifacts the sources name (`uri: artifact:curate`)."""
        return tuple(sorted({s.artifact for s in self.data_sources() if s.artifact}))

    def model_uris(self) -> list[str]:
        """Model or tokenizer folders read besides upstream artifacts; their content is fingerprinted too."""
        return []

    def source_refs(self, endpoint_url: str | None = None) -> list[InputRef]:
        """Lineage of what a field names besides data sources and model URIs (the model stage's `source`)."""
        return []

    def needed_inputs(self) -> tuple[str, ...]:
        """Upstream inputs this config cannot run without: `required_inputs`, those its fields leave open (no
        `base_model` → the `model` stage's), and the corpora its sources name."""
        return (*self.required_inputs, *self.source_inputs())

    def missing_inputs_message(self, missing: list[str]) -> str:
        """The error for absent inputs; configs override it to name the field that would avoid them."""
        return f"stage {self.stage} needs inputs {missing}"


Precision = Literal["auto", "bf16", "fp32"]


def secret_fields(raw: Any, where: str = "", values: list[str] | None = None) -> list[str]:
    """Dotted paths of the config strings holding a secret (`redact`): configs go into manifests."""
    values = secret_values() if values is None else values
    if isinstance(raw, dict):
        return [p for k, v in raw.items() for p in secret_fields(v, f"{where}.{k}" if where else str(k), values)]
    if isinstance(raw, list):
        return [p for i, v in enumerate(raw) for p in secret_fields(v, f"{where}[{i}]", values)]
    return [where or "<root>"] if isinstance(raw, str) and redact(raw, values) != raw else []


def validate_model(model: type[StrictModel], raw: Any, source: str):
    if found := secret_fields(raw):
        raise ConfigError(
            f"{source}: {found[0]}: holds a credential (a URL's user:password@, an access key, a token or a "
            "secret's value); give credentials through the environment (DILFORGE_S3_ACCESS_KEY_ID / "
            "DILFORGE_S3_SECRET_ACCESS_KEY or the AWS chain), never in a config"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:  # every bad field, one a line, naming the document
        raise ConfigError(f"invalid config in {source}:\n  " + field_errors(exc, sep="\n  ")) from None
