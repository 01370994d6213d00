"""The pipeline config: where artifacts go, the run id, and each stage's config."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from dilforge_cpt.config import CptConfig
from dilforge_cpt.model_config import ModelConfig
from dilforge_curate.config import CurateConfig
from dilforge_eval.config import EvalConfig
from dilforge_sft.config import SftConfig
from dilforge_shared.configs import StageConfig, StrictModel, validate_model
from dilforge_shared.errors import ConfigError
from dilforge_shared.manifest import StageName
from dilforge_shared.settings import is_secret_name
from dilforge_tokenizer.config import TokenizerConfig
from pydantic import ConfigDict, Field, field_validator, model_validator

from .cloud import SageMakerConfig

STAGE_CONFIGS: dict[StageName, type[StageConfig]] = {
    config.stage: config for config in (ModelConfig, CurateConfig, TokenizerConfig, CptConfig, SftConfig, EvalConfig)
}

# Semver of the pipeline config schema (schemas/pipeline.schema.json, key "x-dilforge-config-version").
CONFIG_SCHEMA_VERSION = "1.3.0"

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class StoreConfig(StrictModel):
    uri: str = Field(description="Artifact store root: a path, file:// or s3://bucket/prefix.")
    s3_endpoint_url: str | None = Field(
        default=None, description="Endpoint of an S3-compatible server (SeaweedFS, MinIO); None for AWS."
    )

    @field_validator("uri", "s3_endpoint_url")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        """A URL with `user:password@` would travel into dry runs, manifests and job environments; keys belong in
        DILFORGE_S3_ACCESS_KEY_ID / DILFORGE_S3_SECRET_ACCESS_KEY (or the AWS chain), which are never written."""
        if value is not None and "://" in value and "@" in value.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "holds credentials (user:password@); give the keys in DILFORGE_S3_ACCESS_KEY_ID / "
                "DILFORGE_S3_SECRET_ACCESS_KEY instead"
            )
        return value


class PipelineConfig(StrictModel):
    model_config = ConfigDict(
        extra="forbid", validate_default=True, json_schema_extra={"x-dilforge-config-version": CONFIG_SCHEMA_VERSION}
    )

    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", description="Name of this pipeline run.")
    store: StoreConfig = Field(description="Artifact store every stage publishes to and reads from.")
    model: ModelConfig | None = Field(
        default=None,
        description="Base model import, run first; downstream stages "
        "get it as their input named 'model'. Omitted = not run.",
    )
    curate: CurateConfig | None = Field(
        default=None,
        description="Curate stage: raw text → a clean corpus artifact, named by later stages as `artifact:curate`; "
        "omitted = not run.",
    )
    tokenizer: TokenizerConfig | None = Field(default=None, description="Tokenizer stage; omitted = not run.")
    cpt: CptConfig | None = Field(default=None, description="CPT stage; omitted = not run.")
    sft: SftConfig | None = Field(default=None, description="SFT stage; omitted = not run.")
    eval: EvalConfig | None = Field(default=None, description="Eval stage; omitted = not run.")
    sagemaker: SageMakerConfig | None = Field(default=None, description="SageMaker jobs for --backend sagemaker.")

    @model_validator(mode="after")
    def _check_model_inputs(self) -> PipelineConfig:
        """Each base model comes from exactly one place: a field of the stage, or the pipeline's `model` stage."""
        explicit = {"cpt": ("base_model", "scratch_model"), "tokenizer": ("base_tokenizer",), "sft": ("base_model",)}
        for name, cfg in self.stages():
            if name == "model":
                continue
            given = [f for f in explicit.get(name, ()) if getattr(cfg, f, None) is not None]
            if self.model is None and "model" in cfg.needed_inputs():
                fields = " or ".join(f"{name}.{f}" for f in explicit.get(name, ()))
                raise ValueError(f"{name}: no base model: set {fields}, or add a pipeline-level `model:` block")
            upstream = [u for u in ("cpt", "model") if u in cfg.consumes and getattr(self, u) is not None]
            if upstream and given and getattr(cfg, "strategy", None) != "replace":
                block = (
                    "the pipeline's `model:` block" if upstream[0] == "model" else f"the pipeline's {upstream[0]} stage"
                )
                raise ValueError(
                    f"{name}.{given[0]} and {block} both give the base model; "
                    f"keep one (remove {name}.{given[0]} to use the {upstream[0]} artifact)"
                )
        if self.model is not None and self.eval is not None and "base" in [m.label for m in self.eval.models]:
            raise ValueError(
                "eval.models: label 'base' is the pipeline's `model` stage (compared automatically); "
                "rename it or drop it"
            )
        return self

    def stages(self) -> list[tuple[str, StageConfig]]:
        """The configured stages, in pipeline order."""
        return [(name, cfg) for name in STAGE_CONFIGS if (cfg := getattr(self, name)) is not None]


USER_VAR_PREFIX = "DILFORGE_VAR_"
# The only variables `${...}` in a config may name, besides DILFORGE_VAR_*. Secrets are never on this list.
INTERPOLATION_ALLOWED = (
    "DILFORGE_DATA",
    "DILFORGE_STORE",
    "DILFORGE_CACHE",
    "DILFORGE_WORKDIR",
    "DILFORGE_S3_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)


def may_interpolate(name: str) -> bool:
    """The allow-list and DILFORGE_VAR_*, never a secret."""
    allowed = name in INTERPOLATION_ALLOWED or name.startswith(USER_VAR_PREFIX)
    return allowed and not is_secret_name(name.removeprefix(USER_VAR_PREFIX))


def interpolation_variables(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What `${VAR}` in a config may see; `extra` wins."""
    return {**{n: v for n, v in os.environ.items() if may_interpolate(n)}, **(extra or {})}


def map_strings(value: Any, fn: Callable[[str], Any]) -> Any:
    """`fn` applied to every string value in a JSON-like structure (mapping keys kept)."""
    if isinstance(value, dict):
        return {k: map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, fn) for v in value]
    return fn(value) if isinstance(value, str) else value


def expand_env(value: Any, source: str, variables: dict[str, str] | None = None) -> Any:
    """Replace ${VAR} / ${VAR:-default} in every string from `variables` (default `interpolation_variables()`);
    a name off the allow-list, a credential (it would end up in manifests and logs) or an unset one is an error."""
    if variables is None:
        variables = interpolation_variables()

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if not may_interpolate(name):
            raise ConfigError(
                f"{source}: ${{{name}}} may not be interpolated: a config may name only "
                f"{', '.join(INTERPOLATION_ALLOWED)} and {USER_VAR_PREFIX}<NAME> variables, never a credential "
                "(see docs/reliability.md)"
            )
        if name in variables:
            return variables[name]
        if default is not None:
            return default
        raise ConfigError(f"{source}: ${{{name}}} is used but not set (export it, or pass the matching option)")

    return map_strings(value, lambda text: _ENV_REF.sub(sub, text))


# A config is a few hundred nodes; aliases may repeat a block, but a document that expands past this many nodes
# (a "billion laughs" of nested aliases) is refused before anything walks it.
MAX_YAML_NODES = 100_000


def _expanded_nodes(node: yaml.Node, path: Path, memo: dict[int, int], active: set[int]) -> int:
    """How many nodes the document has with every alias expanded (linear: shared nodes are counted once each).
    A mapping that repeats a key is refused here too: PyYAML would keep the last silently (`num_shards: 8` then
    `num_shards: 1`); keys merged in by `<<: *anchor` may be overridden."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise ConfigError(
            f"{path}: line {node.start_mark.line + 1}: a YAML alias refers to the node that contains it "
            "(a recursive structure); a config cannot be recursive"
        )
    active.add(key)
    children = node.value if isinstance(node, yaml.SequenceNode) else []
    if isinstance(node, yaml.MappingNode):
        children, seen = [n for pair in node.value for n in pair], {}
        for name, _ in node.value:
            if not isinstance(name, yaml.ScalarNode) or name.tag == "tag:yaml.org,2002:merge":
                continue
            if (name.tag, name.value) in seen:
                raise ConfigError(
                    f"{path}: line {name.start_mark.line + 1}: key {name.value!r} appears twice in one mapping "
                    f"(first on line {seen[name.tag, name.value]}); keep one"
                )
            seen[name.tag, name.value] = name.start_mark.line + 1
    total = 1
    for child in children:
        total += _expanded_nodes(child, path, memo, active)
        if total > MAX_YAML_NODES:
            break
    active.discard(key)
    memo[key] = total
    return total


def safe_load_bounded(text: str, path: Path) -> Any:
    """yaml.safe_load, refusing documents whose aliases expand past MAX_YAML_NODES nodes or that recurse, and
    mappings that repeat a key (`_expanded_nodes`)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return None
    size = _expanded_nodes(node, path, {}, set())
    if size > MAX_YAML_NODES:
        raise ConfigError(
            f"{path}: YAML aliases expand to more than {MAX_YAML_NODES:,} nodes (nested anchors "
            "repeating each other, a 'billion laughs' document); write the config out without them"
        )
    return yaml.safe_load(text)


def load_yaml(path: Path, variables: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start : exc.start + 4]!r}); "
            "save the config as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        raw = safe_load_bounded(text, path)
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return expand_env(raw, str(path), interpolation_variables(variables))


def load_pipeline(
    path: Path, overrides: dict[str, Any] | None = None, variables: dict[str, str] | None = None
) -> PipelineConfig:
    """`variables` (e.g. DILFORGE_DATA from `--data`) take precedence over the environment's."""
    raw = load_yaml(path, variables)
    for key, value in (overrides or {}).items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return validate_model(PipelineConfig, raw, str(path))
