"""What identifies a stage's inputs, and so its artifact: lineage refs and artifact ids.

Planning and the container contract compute the same refs, so `recompute_artifact_id(manifest) ==
manifest.artifact_id`. A model or tokenizer URI's lineage is `model_refs`'."""

from __future__ import annotations

from . import stages
from .configs.base import StageConfig
from .corpus_files import data_digest
from .manifest import InputRef, artifact_ref, fingerprint
from .model_refs import model_ref_name, source_ref
from .store.artifacts import read_manifest


def config_refs(config: StageConfig, endpoint_url: str | None = None) -> list[InputRef]:
    """Everything a stage reads besides upstream artifacts: data sources, models/tokenizers by URI, a model source."""
    refs = [
        InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=data_digest(s.uri, endpoint_url))
        for s in config.file_sources()
    ]
    refs += [source_ref(uri, model_ref_name(uri), endpoint_url) for uri in config.model_uris()]
    return refs + config.source_refs(endpoint_url)


def upstream_refs(inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """Upstream artifacts by their artifact ids (`manifest.artifact_ref`)."""
    return [artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0]) for name, uri in sorted(inputs.items())]


def stage_refs(config: StageConfig, inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """What a stage's artifact id covers, in the form its manifest records them."""
    return [*upstream_refs(inputs, endpoint_url), *config_refs(config, endpoint_url)]


def artifact_id(config: StageConfig, refs: list[InputRef], code_version: str | None = None) -> str:
    """The id of the artifact `config` produces from inputs `refs` with this code (or the given code version)."""
    version = stages.code_version(config.stage) if code_version is None else code_version
    return fingerprint(config.stage, config.identity(), refs, version)
