"""Plan and run a pipeline: fingerprint each stage, reuse what exists, submit the rest to a backend."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from dilforge_shared.configs import PipelineConfig, StageConfig
from dilforge_shared.errors import DilforgeError
from dilforge_shared.manifest import MANIFEST_NAME, fingerprint
from dilforge_shared.models import stage_refs
from dilforge_shared.store import ArtifactStore, NotFound, artifact_exists

log = logging.getLogger("dilforge.coordinator")

# The model stage (importer) runs in the cpt image: it needs torch, transformers and gguf, which the
# torch-free coordinator does not have.
STAGE_MODULES = {"model": "dilforge_cpt.import_model", "tokenizer": "dilforge_tokenizer", "cpt": "dilforge_cpt", "sft": "dilforge_sft", "eval": "dilforge_eval"}
STAGE_IMAGES = {"model": "cpt"}


def image_of(stage: str) -> str:
    """The stage image a stage runs in (its own, except the model stage: the cpt image)."""
    return STAGE_IMAGES.get(stage, stage)


def module_env(stage: str) -> dict[str, str]:
    """Environment that makes a shared image's entrypoint run this stage's module (see docker/entrypoint.py)."""
    return {"DILFORGE_STAGE_MODULE": STAGE_MODULES[stage]} if image_of(stage) != stage else {}


class StageFailed(DilforgeError):
    def __init__(self, stage: str, reason: str):
        super().__init__(f"stage {stage} failed: {reason.strip()}")
        self.stage = stage
        self.reason = reason


@dataclass
class StageJob:
    """One stage, fully resolved: what a backend needs to run it anywhere."""
    stage: str
    config: StageConfig
    run_id: str
    artifact_uri: str
    inputs: dict[str, str]
    store_uri: str
    s3_endpoint_url: str | None = None

    @property
    def artifact_id(self) -> str:
        return self.artifact_uri.rsplit("/", 1)[-1]

    @property
    def manifest_uri(self) -> str:
        return f"{self.artifact_uri}/{MANIFEST_NAME}"


class Backend(Protocol):
    name: str

    def run(self, job: StageJob) -> None:
        """Run the stage to completion; raise StageFailed with the stage's failure reason."""


@dataclass
class RunRecord:
    run_id: str
    stages: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "updated_at": datetime.now(timezone.utc).isoformat(),
                           "stages": self.stages}, indent=2).encode()

    @classmethod
    def load(cls, store: ArtifactStore, run_id: str) -> "RunRecord":
        try:
            raw = json.loads(store.read_run_record(run_id))
        except NotFound:
            return cls(run_id=run_id)
        return cls(run_id=run_id, stages=raw.get("stages", {}))


def plan_stage(pipeline: PipelineConfig, stage: str, upstream: dict[str, str]) -> StageJob:
    """Resolve inputs and fingerprint: same config + same upstream manifests + same data → same artifact."""
    config: StageConfig = getattr(pipeline, stage)
    inputs = {name: upstream[name] for name in config.consumes if name in upstream}
    missing = [name for name in config.needed_inputs() if name not in inputs]
    if missing:
        raise DilforgeError(f"stage {stage} needs upstream artifacts {missing}: add those stages to the pipeline, "
                            f"run them first, or pass --input NAME=URI")
    endpoint = pipeline.store.s3_endpoint_url
    artifact_id = fingerprint(stage, config.model_dump(mode="json"), stage_refs(config, inputs, endpoint))
    store = ArtifactStore(pipeline.store.uri, endpoint)
    return StageJob(stage=stage, config=config, run_id=pipeline.run_id, artifact_uri=store.artifact_uri(stage, artifact_id),
                    inputs=inputs, store_uri=store.backend.uri, s3_endpoint_url=endpoint)


def run_stage(pipeline: PipelineConfig, stage: str, backend: Backend, upstream: dict[str, str],
              record: RunRecord | None = None) -> str:
    """Run (or reuse) one stage; returns its artifact URI."""
    store = ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url)
    record = record or RunRecord.load(store, pipeline.run_id)
    job = plan_stage(pipeline, stage, upstream)
    if artifact_exists(job.artifact_uri, job.s3_endpoint_url):
        log.info("stage %s: reusing existing artifact %s (same config and inputs)", stage, job.artifact_uri)
        print(f"[{stage}] reusing {job.artifact_uri} (same config and inputs)")
        status = "reused"
    else:
        print(f"[{stage}] running on {backend.name} → {job.artifact_uri}")
        record.stages[stage] = {"artifact_uri": job.artifact_uri, "status": "running", "backend": backend.name}
        store.write_run_record(pipeline.run_id, record.to_json())
        try:
            backend.run(job)
        except StageFailed as exc:
            record.stages[stage] = {"artifact_uri": job.artifact_uri, "status": "failed", "error": exc.reason[:2000],
                                    "backend": backend.name}
            store.write_run_record(pipeline.run_id, record.to_json())
            raise
        if not artifact_exists(job.artifact_uri, job.s3_endpoint_url):
            raise StageFailed(stage, f"the stage exited cleanly but published no manifest at {job.manifest_uri}")
        status = "produced"
    record.stages[stage] = {"artifact_uri": job.artifact_uri, "status": status, "backend": backend.name}
    store.write_run_record(pipeline.run_id, record.to_json())
    return job.artifact_uri


def upstream_from_record(pipeline: PipelineConfig) -> dict[str, str]:
    store = ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url)
    record = RunRecord.load(store, pipeline.run_id)
    return {name: s["artifact_uri"] for name, s in record.stages.items() if s.get("status") in ("produced", "reused")}


def run_all(pipeline: PipelineConfig, backend: Backend) -> dict[str, str]:
    """Every configured stage in order, each fed the artifacts of the ones before."""
    store = ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url)
    record = RunRecord.load(store, pipeline.run_id)
    produced: dict[str, str] = {}
    for stage, _ in pipeline.stages():
        produced[stage] = run_stage(pipeline, stage, backend, produced, record)
    return produced
