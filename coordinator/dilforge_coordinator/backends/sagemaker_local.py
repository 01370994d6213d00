"""`--backend sagemaker-local`: the jobs `--backend sagemaker` submits, run by the SDK's local container mode
(every host a container of the local stage image on the `sagemaker-local` network). What differs from the cloud:
instance type `local`, no role or ECR; the store is the compose S3 (as `dilforge-s3`), local data the config
names is uploaded to it content-addressed first; channels are the store's verified copies (`fetch`); the
entrypoint syncs checkpoints (DILFORGE_CHECKPOINT_SYNC_URI), which local mode does not. Bad setup is one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

from dilforge_cpt.model_config import ModelConfig
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.identity import stamped_sha256
from dilforge_shared.store import fetch, open_backend

from ..cloud import SageMakerConfig
from ..config import PipelineConfig, map_strings
from ..pipeline import StageFailed, StageJob, image_of
from ..settings import coordinator_settings
from .compose import S3_ACCESS_KEY, S3_SECRET_KEY, ComposeBackend
from .local import WORK_MARKER, work_folder
from .sagemaker import (
    OFFLINE_SDK_CONFIG,
    PROCESSING_STAGES,
    JobSpec,
    ProcessingSpec,
    config_uri,
    hyperparameters_uri,
    job_spec,
    model_trainer,
    offline_boto_session,
    processing_root,
    processing_specs,
    require_sdk,
    run_processor,
    sdk_session,
    stage_hyperparameters,
    token_cache_spec,
    write_uri,
)

NETWORK = "sagemaker-local"  # the network the SDK's local mode puts every host on
S3_ALIAS = "dilforge-s3"  # the compose S3 as the job containers reach it on that network
CONTAINER_ENDPOINT = f"http://{S3_ALIAS}:8333"
LOCAL_ROLE = "arn:aws:iam::000000000000:role/dilforge-local"  # local mode assumes no role
CHECKPOINT_SYNC_ENV = "DILFORGE_CHECKPOINT_SYNC_URI"


def preflight(docker: str, run=subprocess.run) -> str:
    """The region, the SDK, a running Docker engine and Compose v2, each checked with a one-line error.
    Returns the region."""
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if not region:
        raise ConfigError(
            "AWS region unset: the SageMaker SDK needs one even in local mode; "
            "export AWS_DEFAULT_REGION=us-east-1 (no AWS account or credentials are used)"
        )
    require_sdk()
    if shutil.which(docker) is None:
        raise ConfigError(f"Docker is not installed ({docker} not found): bash ../shared/tools/container-env.sh")
    if run([docker, "info"], capture_output=True, text=True, check=False).returncode != 0:
        raise ConfigError(
            "Docker is not running (docker info failed): start the engine, e.g. bash ../shared/tools/container-env.sh"
        )
    # The SDK runs `docker compose` from PATH (v2), else `docker-compose`
    compose = run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
    if compose.returncode != 0 and shutil.which("docker-compose") is None:
        raise ConfigError(
            "Docker Compose v2 is missing (`docker compose version` failed): SageMaker local mode "
            "runs every job with it; install the plugin (bash ../shared/tools/container-env.sh)"
        )
    return region


def declared_inputs(pipeline: PipelineConfig) -> set[str]:
    """The local paths the stages declare as inputs: data sources, model/tokenizer folders, a model stage's source.
    Nothing else in a config is ever uploaded (an `environment` entry or a prompt that happens to name a path)."""
    declared: set[str] = set()
    for _, config in pipeline.stages():
        declared |= {s.uri for s in config.file_sources()} | set(config.model_uris())
        if isinstance(config, ModelConfig):
            declared.add(config.source)
    return {uri for uri in declared if "://" not in uri.removeprefix("file://") and "\n" not in uri}


def upload_local_data(raw: Any, store: str, endpoint_url: str, declared: set[str]) -> tuple[Any, dict[str, str]]:
    """Every string in the config that is a declared input (`declared_inputs`) naming an existing local file or
    folder → its content-addressed copy in the store's `data/` prefix (uploaded once). Returns the rewritten config
    and {local path: S3 URI}."""
    bucket_root = "s3://" + store.removeprefix("s3://").split("/", 1)[0]
    moved: dict[str, str] = {}

    def upload(text: str) -> str:
        path = Path(text.removeprefix("file://"))
        if text not in declared or len(text) > 4096 or not path.exists():  # a longer path cannot exist
            return text
        if "*" in text:
            raise ConfigError(f"{text}: local globs are not uploaded for sagemaker-local; name a folder instead")
        if text in moved:
            return moved[text]
        path = path.resolve()
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        sums = {file: stamped_sha256(file) for file in files}
        digest = hashlib.sha256("".join(f"{p.relative_to(path.parent)}\0{sums[p]}\n" for p in files).encode())
        # the copy sits under the path as written (identity reads it back: manifest.declared_uri), or, for a relative
        # one, under the absolute path
        location = text.removeprefix("file://") if text.removeprefix("file://").startswith("/") else str(path)
        copy_root = f"{bucket_root}/data/{digest.hexdigest()[:16]}"  # manifest.UPLOADED_COPY
        moved[text] = copy_root + location
        backend = open_backend(copy_root, endpoint_url)
        base = location.strip("/")
        for file in files:
            key = base if file == path else f"{base}/{file.relative_to(path).as_posix()}"
            if not backend.exists(key) or backend.size(key) != file.stat().st_size:
                backend.upload_file(key, file, sha256=sums[file])
        return moved[text]

    return map_strings(raw, upload), moved


def local_processing_session(region: str, s3_endpoint_url: str, access_key: str, secret_key: str):
    """The SDK's LocalSession for local-mode Processing jobs, its S3 the compose S3 (inputs are downloaded from it)."""
    import boto3
    from sagemaker.core.local.local_session import LocalSession

    boto_session = boto3.Session(
        aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name=region
    )  # the local-only identity of compose.yaml, never a user's credentials
    session = LocalSession(boto_session=boto_session, s3_endpoint_url=s3_endpoint_url, disable_local_code=True)
    session.sagemaker_config = OFFLINE_SDK_CONFIG
    return session


def local_processing_spec(spec: ProcessingSpec, work: Path, env: dict[str, str]) -> ProcessingSpec:
    """A Processing job as local mode runs it: outputs to the local `work` folder, the local S3's
    environment, and, on several hosts, `--shared-write`: local mode mounts one output folder into every host and
    stops them all when the first exits, so each host waits for the others' tasks."""
    outputs = {name: (path, f"file://{work}") for name, (path, _) in spec.outputs.items()}
    entry = [*spec.entrypoint, "--shared-write"] if spec.outputs and spec.num_instances > 1 else spec.entrypoint
    return replace(
        spec, instance_type="local", environment={**spec.environment, **env}, outputs=outputs, entrypoint=entry
    )


class SageMakerLocalBackend:
    """`--backend sagemaker-local`: the SDK's local container mode, the compose S3 as the store."""

    name = "sagemaker-local"

    def __init__(
        self,
        workdir: Path | None = None,
        tag: str | None = None,
        docker: str | None = None,
        data_root: Path | None = None,
        run=subprocess.run,
    ):
        self.compose = ComposeBackend(workdir=workdir, tag=tag, docker=docker, data_root=data_root)
        self.workdir = Path(workdir or coordinator_settings().workdir).resolve() / "sagemaker-local"
        self.docker = self.compose.docker
        self.run_cmd = run
        self.config: SageMakerConfig | None = None
        self.region: str | None = None

    # ---- setup -----------------------------------------------------------------------------------
    def prepare(self, pipeline: PipelineConfig) -> PipelineConfig:
        self.region = preflight(self.docker, self.run_cmd)
        pipeline = self.compose.prepare(pipeline)  # store → the compose S3, up and healthy
        self.join_network()
        raw = pipeline.model_dump(mode="json", exclude_none=True)
        store = raw.pop("store")
        raw, moved = upload_local_data(raw, store["uri"], store["s3_endpoint_url"], declared_inputs(pipeline))
        for local, uri in moved.items():
            print(f"[sagemaker-local] data {local} → {uri}")
        pipeline = PipelineConfig.model_validate({**raw, "store": store})
        self.config = pipeline.sagemaker or SageMakerConfig(role_arn=LOCAL_ROLE, spot=False)
        return pipeline

    def join_network(self) -> None:
        """Put the compose S3 on the SDK's `sagemaker-local` network as `dilforge-s3`. The network is made with
        the compose label the SDK's generated compose file expects, so its `docker compose up` adopts it."""
        if self.docker_cmd("network", "inspect", NETWORK).returncode != 0:
            made = self.docker_cmd("network", "create", "--label", f"com.docker.compose.network={NETWORK}", NETWORK)
            if made.returncode != 0 and "already exists" not in made.stderr:
                raise DilforgeError(f"docker network create {NETWORK}: {made.stderr.strip()}")
        ps = self.docker_cmd(*self.compose.compose_cmd("ps", "-q", "s3")[1:], env=self.compose.compose_env())
        container = next(iter(ps.stdout.split()), "")
        if not container:
            raise DilforgeError("the compose S3 is not running (docker compose ps s3 shows no container)")
        joined = self.docker_cmd("network", "connect", "--alias", S3_ALIAS, NETWORK, container)
        if joined.returncode != 0 and "already exists" not in joined.stderr:
            raise DilforgeError(f"docker network connect {NETWORK} (compose S3): {joined.stderr.strip()}")

    # ---- one stage -------------------------------------------------------------------------------
    def image(self, stage: str) -> tuple[str, str]:
        """(the local image by tag, what the manifest cites); one line when it is not built."""
        return f"dilforge-{stage}:{self.compose.tag}", self.compose.image_ref(stage)

    def spec(self, job: StageJob) -> tuple[JobSpec, dict[str, str]]:
        ref, cited = self.image(image_of(job.stage))
        spec = job_spec(job, self.config, ref, CONTAINER_ENDPOINT)
        env = {**spec.environment, **self.container_env(cited), CHECKPOINT_SYNC_ENV: spec.checkpoint_uri}
        # each upstream artifact folder (manifest.json + data-*/), copied from the store and verified
        cache, endpoint = self.workdir / "channels", job.s3_endpoint_url
        channels = {name: str(fetch(uri, cache, endpoint).path.parent) for name, uri in spec.channels.items()}
        return replace(spec, environment=env), channels

    def container_env(self, cited: str) -> dict[str, str]:
        return {
            "DILFORGE_IMAGE": cited,
            "AWS_DEFAULT_REGION": self.region,
            "DILFORGE_S3_ACCESS_KEY_ID": S3_ACCESS_KEY,
            "DILFORGE_S3_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "HOME": "/tmp",
        }

    def run(self, job: StageJob) -> None:
        write_uri(config_uri(self.config, job), job.config.model_dump_json(indent=2), job.s3_endpoint_url)
        if job.stage in PROCESSING_STAGES:
            self.run_processing(job, processing_specs(job, self.config, self.image(image_of(job.stage))[0]))
            return
        spec, channels = self.spec(job)
        if cache := token_cache_spec(job, self.config, spec.image):
            self.run_processing(job, [cache])
        with work_folder(self.workdir, job.stage, job.artifact_id) as (root, _):
            for leftover in root.iterdir():  # the SDK's leftovers of a failed attempt (checkpoints live in S3)
                if leftover.name != WORK_MARKER:
                    shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
            session = sdk_session(offline_boto_session(self.region), offline=True)
            trainer = model_trainer(spec, session, local_root=str(root), local_channels=channels)
            print(f"[{job.stage}] SageMaker local mode: {spec.num_instances} x {spec.image} in {root}", flush=True)
            before = self.job_containers(spec.image)
            try:
                trainer.train(wait=True, logs=True)
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                raise StageFailed(
                    job.stage, self.failure_reason(root, spec.num_instances) or f"local job failed: {exc}"
                ) from None
            finally:
                self.remove_containers(self.job_containers(spec.image) - before)
            shutil.rmtree(root, ignore_errors=True)

    def run_processing(self, job: StageJob, specs: list[ProcessingSpec]) -> None:
        """Processing jobs as on SageMaker, in local mode; each job's outputs land in a local folder, uploaded to
        the job's output prefix before the next job starts (`local_processing_spec`)."""
        ref, cited = self.image(image_of(job.stage))
        hp = stage_hyperparameters(job, self.config, CONTAINER_ENDPOINT)
        write_uri(hyperparameters_uri(self.config, job), json.dumps(hp), job.s3_endpoint_url)
        with work_folder(self.workdir, job.stage, job.artifact_id) as (root, _):
            work = root / "work"
            work.mkdir(parents=True, exist_ok=True)
            session = local_processing_session(self.region, job.s3_endpoint_url, S3_ACCESS_KEY, S3_SECRET_KEY)
            for spec in specs:
                local = local_processing_spec(spec, work, self.container_env(cited))
                print(f"[{job.stage}] {spec.phase}: SageMaker local mode, {spec.num_instances} x {ref}", flush=True)
                before = self.job_containers(ref)
                try:
                    run_processor(local, session, wait=True)
                except (RuntimeError, subprocess.CalledProcessError) as exc:
                    raise StageFailed(job.stage, f"local processing job {spec.phase} failed: {exc}") from None
                finally:
                    self.remove_containers(self.job_containers(ref) - before)
                for _, prefix in spec.outputs.values():  # every host's outputs, one prefix
                    store = open_backend(prefix.rstrip("/"), job.s3_endpoint_url)
                    for path in sorted(p for p in work.rglob("*") if p.is_file()):
                        key = path.relative_to(work).as_posix()
                        if not store.exists(key) or store.size(key) != path.stat().st_size:
                            store.upload_file(key, path)
            shutil.rmtree(root, ignore_errors=True)
            open_backend(processing_root(self.config, job), job.s3_endpoint_url).delete_prefix("")

    def docker_cmd(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """`docker ARGS`, its output captured; the caller reads the exit code."""
        return self.run_cmd([self.docker, *args], capture_output=True, text=True, check=False, **kwargs)

    def job_containers(self, image: str) -> set[str]:
        """Stopped containers of `image` (the SDK's `docker compose up` leaves one per host and job)."""
        ps = self.docker_cmd(
            "ps", "-a", "--filter", f"ancestor={image}", "--filter", "status=exited", "--format", "{{.ID}}"
        )
        return set(ps.stdout.split()) if ps.returncode == 0 else set()

    def remove_containers(self, ids: set[str]) -> None:
        """Remove the containers this job left (only those that appeared while it ran); logs are already shown."""
        if ids:
            self.docker_cmd("rm", *sorted(ids))

    @staticmethod
    def failure_reason(root: Path, num_hosts: int) -> str | None:
        """The first host's /opt/ml/output/failure (what SageMaker shows as FailureReason), else any host's."""
        for host in [f"algo-{i}" for i in range(1, num_hosts + 1)]:
            failure = root / host / "output" / "failure"
            if failure.is_file() and (text := failure.read_text(errors="replace").strip()):
                return f"{host}: {text}" if num_hosts > 1 else text
        return None
