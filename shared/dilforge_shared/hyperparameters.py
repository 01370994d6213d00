"""A stage's hyperparameters (all strings, SageMaker's rule): parsed strictly into a `StageRequest`, built by
the backends with `build_hyperparameters`. Keys: stage_config or stage_config_uri, artifact_uri, run_id,
inputs (JSON {name: manifest URI}), optional s3_endpoint_url; any other key is an error (`sagemaker_*` aside)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .configs.base import StageConfig, validate_model
from .errors import ConfigError, UnsafePathError
from .paths import check_name
from .store.backends import read_uri_bytes

HYPERPARAMETER_KEYS = {"stage_config", "stage_config_uri", "artifact_uri", "run_id", "inputs", "s3_endpoint_url"}


@dataclass
class StageRequest:
    """A validated request to run one stage: what the hyperparameters said, parsed once."""

    config: StageConfig
    artifact_uri: str
    run_id: str
    inputs: dict[str, str]
    s3_endpoint_url: str | None = None


def parse_hyperparameters(hp: dict[str, Any], config_cls: type[StageConfig], source: str) -> StageRequest:
    """Strictly parse SageMaker-style string hyperparameters into a StageRequest."""
    bad = [k for k in hp if k not in HYPERPARAMETER_KEYS and not k.startswith("sagemaker_")]
    if bad:
        raise ConfigError(f"{source}: unknown hyperparameters {sorted(bad)}; expected {sorted(HYPERPARAMETER_KEYS)}")
    for key, value in hp.items():
        if not isinstance(value, str):
            raise ConfigError(f"{source}: hyperparameter {key!r} must be a string (SageMaker passes strings)")
    for key in ("artifact_uri", "run_id"):
        if not hp.get(key):
            raise ConfigError(f"{source}: hyperparameter {key!r} is required")
    endpoint = hp.get("s3_endpoint_url") or None
    if "stage_config" in hp and "stage_config_uri" in hp:
        raise ConfigError(f"{source}: give stage_config or stage_config_uri, not both")
    if "stage_config" in hp:
        doc, doc_source = hp["stage_config"], f"{source}: stage_config"
    elif "stage_config_uri" in hp:
        doc_source = hp["stage_config_uri"]
        doc = read_uri_bytes(doc_source, endpoint).decode()
    else:
        raise ConfigError(f"{source}: hyperparameter 'stage_config' or 'stage_config_uri' is required")
    try:
        raw = json.loads(doc)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{doc_source}: not valid JSON: {exc}") from None
    config = validate_model(config_cls, raw, doc_source)
    try:
        inputs = json.loads(hp.get("inputs", "{}"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: hyperparameter 'inputs' is not valid JSON: {exc}") from None
    if not isinstance(inputs, dict) or not all(isinstance(v, str) for v in inputs.values()):
        raise ConfigError(f"{source}: hyperparameter 'inputs' must be a JSON object of name -> manifest URI")
    for name in inputs:  # input names become channel folders (/opt/ml/input/data/<name>)
        try:
            check_name(name, "input name")
        except UnsafePathError as exc:
            raise ConfigError(f"{source}: hyperparameter 'inputs': {exc}") from None
    missing = [name for name in config.needed_inputs() if name not in inputs]
    if missing:
        raise ConfigError(f"{source}: {config.missing_inputs_message(missing)}")
    return StageRequest(
        config=config,
        artifact_uri=hp["artifact_uri"].rstrip("/"),
        run_id=hp["run_id"],
        inputs=inputs,
        s3_endpoint_url=endpoint,
    )


def build_hyperparameters(
    config: StageConfig,
    artifact_uri: str,
    run_id: str,
    inputs: dict[str, str],
    s3_endpoint_url: str | None = None,
    config_uri: str | None = None,
) -> dict[str, str]:
    """The inverse of parse_hyperparameters, for backends."""
    hp = {"artifact_uri": artifact_uri, "run_id": run_id, "inputs": json.dumps(inputs, sort_keys=True)}
    if config_uri:
        hp["stage_config_uri"] = config_uri
    else:
        hp["stage_config"] = config.model_dump_json()
    if s3_endpoint_url:
        hp["s3_endpoint_url"] = s3_endpoint_url
    return hp
