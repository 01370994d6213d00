"""Plan and run a pipeline: fingerprint each stage, reuse what exists, submit the rest to a backend."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from dilforge_cpt.model_config import ModelConfig
from dilforge_shared.configs import StageConfig
from dilforge_shared.errors import DilforgeError, ManifestNotFound
from dilforge_shared.identity import STAGE_MODULES, artifact_id, config_refs
from dilforge_shared.locks import FileLock
from dilforge_shared.manifest import MANIFEST_NAME, STAGES, InputRef, artifact_ref
from dilforge_shared.store import artifact_exists, read_manifest

from .config import PipelineConfig
from .integrity import check_artifact, move_aside
from .leases import S3Lease
from .records import ArtifactStore, RunRecord, good_artifacts, running_owner, store_lock
from .stage_images import image_of

log = logging.getLogger("dilforge.coordinator")


def module_env(stage: str) -> dict[str, str]:
    """Environment that makes a shared image's entrypoint run this stage's module (see docker/entrypoint.py)."""
    return {"DILFORGE_STAGE_MODULE": STAGE_MODULES[stage]} if image_of(stage) != stage else {}


class StageFailed(DilforgeError):
    def __init__(self, stage: str, reason: str):
        super().__init__(f"stage {stage} failed: {reason.strip()}")
        self.stage = stage
        self.reason = reason


class StageCancelled(StageFailed):
    """The stage stopped because the coordinator was asked to stop (SIGTERM, SIGINT)."""


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


class Backend(Protocol):
    name: str

    def run(self, job: StageJob) -> None:
        """Run the stage to completion; raise StageFailed with the stage's failure reason."""


def build_hyperparameters(
    config: StageConfig,
    artifact_uri: str,
    run_id: str,
    inputs: dict[str, str],
    s3_endpoint_url: str | None = None,
    config_uri: str | None = None,
) -> dict[str, str]:
    """A stage's request as SageMaker passes it to the container: the inverse of contract.parse_hyperparameters."""
    hp = {"artifact_uri": artifact_uri, "run_id": run_id, "inputs": json.dumps(inputs, sort_keys=True)}
    hp |= {"stage_config_uri": config_uri} if config_uri else {"stage_config": config.model_dump_json()}
    return hp | ({"s3_endpoint_url": s3_endpoint_url} if s3_endpoint_url else {})


def track_run(store: ArtifactStore, record: RunRecord, body):
    """Run `body()` with the record saying `running`, then `succeeded`, `failed` or `cancelled` whatever happens."""
    record.status, record.error = "running", None
    record.owner = {**running_owner(), "started_at": datetime.now(UTC).isoformat()}
    record.save(store)
    try:
        result = body()
        record.status = "succeeded"
        return result
    except (StageCancelled, KeyboardInterrupt, SystemExit) as exc:
        record.status, record.error = "cancelled", str(exc) or type(exc).__name__
        raise
    except BaseException as exc:
        record.status, record.error = "failed", str(exc)[:2000] or type(exc).__name__
        raise
    finally:
        record.save(store, close=record.status if record.status != "succeeded" else "failed")


def artifact_lock(store: ArtifactStore, stage: str, artifact_id: str) -> FileLock | S3Lease:
    """One producer per artifact."""
    return store_lock(store, f"locks/{stage}-{artifact_id}.lock")


def reusable(job: StageJob, stage: str) -> bool:
    """True if the artifact exists, is whole and proves to be this job's (its manifest's id is the folder's and
    recomputes from its recorded config, code version and data digests); otherwise it is reported and moved aside
    to be rebuilt."""
    try:
        problem = check_artifact(job.artifact_uri, job.s3_endpoint_url, identity=True)
    except ManifestNotFound:
        return False
    if problem is None:
        return True
    aside = move_aside(job.artifact_uri, job.s3_endpoint_url)
    log.warning("stage %s: damaged artifact %s: %s; moved to %s", stage, job.artifact_uri, problem, aside)
    print(
        f"[{stage}] damaged artifact: {problem}\n[{stage}] moved it to {aside}; rebuilding under the same id",
        flush=True,
    )
    return False


def check_input_names(stage: str, config: StageConfig, names: list[str]) -> None:
    """`--input NAME=URI`: NAME must be one of the stage's inputs (a misspelled name is never silently ignored)."""
    unknown = [n for n in names if n not in config.input_names()]
    if unknown:
        accepted = ", ".join(config.input_names()) if config.input_names() else "none (it reads no upstream artifact)"
        raise DilforgeError(
            f"--input {unknown[0]}: stage {stage} has no input named {unknown[0]!r}; its inputs: {accepted}"
        )


def check_input_kinds(stage: str, inputs: dict[str, str], endpoint_url: str | None) -> None:
    """Each upstream artifact is of the kind its input needs: an SFT adapter is not a tokenizer."""
    from dilforge_shared.store import read_manifest

    from .config import STAGE_CONFIGS

    for name, uri in sorted(inputs.items()):
        expected = STAGE_CONFIGS[name].artifact_kind
        manifest = read_manifest(uri, endpoint_url)[0]
        if manifest.kind != expected:
            raise DilforgeError(
                f"stage {stage}: input {name}={uri} is a {manifest.kind!r} artifact (made by stage "
                f"{manifest.stage}); input {name!r} needs a {expected!r} artifact"
            )


def stage_refs(config: StageConfig, inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """What a stage's artifact id covers: upstream artifacts by their ids, then `identity.config_refs` (the refs
    the stage records, `contract.lineage`)."""
    upstream = [artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0]) for name, uri in sorted(inputs.items())]
    return [*upstream, *config_refs(config, endpoint_url)]


def plan_stage(pipeline: PipelineConfig, stage: str, upstream: dict[str, str], offline: bool = False) -> StageJob:
    """Resolve inputs and fingerprint: same config + same upstream manifests + same data → same artifact.
    `offline` (a dry run): nothing is read, so inputs count by their URIs (a real run's ids hash digests)."""
    config: StageConfig = getattr(pipeline, stage)
    inputs = {name: upstream[name] for name in config.input_names() if name in upstream}
    missing = [name for name in config.needed_inputs() if name not in inputs]
    if missing:
        how = (
            "to the same pipeline for a dry run"
            if offline
            else "to the pipeline, run them first, or pass --input NAME=URI"
        )
        raise DilforgeError(f"stage {stage} needs upstream artifacts {missing}: add those stages {how}")
    endpoint = pipeline.store.s3_endpoint_url
    if offline:
        refs = [InputRef(name=n, kind="manifest", uri=u, sha256=f"offline:{u}") for n, u in sorted(inputs.items())]
        data = [(f"data:{s.label}", s.uri) for s in config.file_sources()]
        data += [(f"model:{u}", u) for u in config.model_uris()]
        data += [("source", config.source)] if isinstance(config, ModelConfig) else []
        refs += [InputRef(name=n, kind="data", uri=u, sha256=f"offline:{u}") for n, u in data]
    else:
        check_input_kinds(stage, inputs, endpoint)
        refs = stage_refs(config, inputs, endpoint)
    planned_id = artifact_id(config, refs)
    store = ArtifactStore(pipeline.store.uri, endpoint)
    uri = store.artifact_uri(stage, planned_id)
    return StageJob(stage, config, pipeline.run_id, uri, inputs, store.backend.uri, endpoint)


def run_stage(
    pipeline: PipelineConfig, stage: str, backend: Backend, upstream: dict[str, str], record: RunRecord | None = None
) -> str:
    """Run (or reuse) one stage under the artifact's lock (a second run of it waits, then reuses it); returns its
    artifact URI."""
    store = ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url)
    record = record or RunRecord.load(store, pipeline.run_id)
    job = plan_stage(pipeline, stage, upstream)
    lock = artifact_lock(store, stage, job.artifact_id)
    lock.acquire(
        on_wait=lambda holder: print(
            f"[{stage}] waiting: process {holder.get('pid')} on {holder.get('host')} is producing {job.artifact_uri}",
            flush=True,
        )
    )
    try:
        status = _reuse_or_run(job, stage, backend, store, record)
        record.set_stage(store, stage, job.artifact_uri, status, backend=backend.name)
        record.witness(store, job.artifact_uri, **manifest_witness(job))
        record.save(store)  # before the lock goes: a waiting run checks the artifact against this witness
    finally:
        lock.release()
    return job.artifact_uri


def manifest_witness(job: StageJob) -> dict[str, str]:
    """What the run record keeps of the artifact's manifest: its sha256 and data folder, against which every later
    reuse and `manifest validate` check it (store.recorded_digest_problem)."""
    from dilforge_shared.store import read_manifest

    manifest, digest = read_manifest(job.artifact_uri, job.s3_endpoint_url)
    return {"manifest_sha256": digest, "data_dir": manifest.data_dir}


def _reuse_or_run(job: StageJob, stage: str, backend: Backend, store: ArtifactStore, record: RunRecord) -> str:
    if reusable(job, stage):
        log.info(
            "stage %s: reusing existing artifact %s (same config and inputs, files verified)", stage, job.artifact_uri
        )
        print(f"[{stage}] reusing {job.artifact_uri} (same config and inputs)", flush=True)
        return "reused"
    print(f"[{stage}] running on {backend.name} → {job.artifact_uri}", flush=True)
    record.set_stage(store, stage, job.artifact_uri, "running", backend=backend.name, owner=running_owner())
    record.save(store)
    try:
        backend.run(job)
    except BaseException as exc:
        status = "cancelled" if isinstance(exc, (StageCancelled, KeyboardInterrupt)) else "failed"
        reason = exc.reason if isinstance(exc, StageFailed) else (str(exc) or type(exc).__name__)
        record.set_stage(store, stage, job.artifact_uri, status, error=reason[:2000], backend=backend.name)
        record.save(store)
        raise
    if not artifact_exists(job.artifact_uri, job.s3_endpoint_url):
        raise StageFailed(
            stage, f"the stage exited cleanly but published no manifest at {job.artifact_uri}/{MANIFEST_NAME}"
        )
    return "produced"


def upstream_from_record(pipeline: PipelineConfig) -> dict[str, str]:
    return good_artifacts(ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url), pipeline.run_id)


def run_all(pipeline: PipelineConfig, backend: Backend) -> dict[str, str]:
    """Every configured stage in order, each fed the artifacts of the ones before."""
    if not pipeline.stages():
        raise DilforgeError(f"the config has no stage section ({', '.join(STAGES)}): nothing to run")
    store = ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url)
    record = RunRecord.load(store, pipeline.run_id)
    produced: dict[str, str] = {}

    def body() -> dict[str, str]:
        for stage, _ in pipeline.stages():
            produced[stage] = run_stage(pipeline, stage, backend, produced, record)
        return produced

    return track_run(store, record, body)


def run_one(
    pipeline: PipelineConfig, stage: str, backend: Backend, upstream: dict[str, str], accumulate: bool = False
) -> str:
    """One stage, with the run record tracked like run_all's. `accumulate` (a record that is a registry, as
    `models import`'s): the stage's earlier good artifacts stay referenced in `also` instead of being replaced."""
    store = ArtifactStore(pipeline.store.uri, pipeline.store.s3_endpoint_url)
    record = RunRecord.load(store, pipeline.run_id)
    record.accumulate = accumulate
    return track_run(store, record, lambda: run_stage(pipeline, stage, backend, upstream, record))
