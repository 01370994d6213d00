"""`--backend sagemaker`: run each stage as a SageMaker training job (curate as Processing jobs; CPT's token cache,
when `token_cache_instance_type` is set, as a Processing job before its training job).

The job definition is `sagemaker_jobs.job_spec` (SDK-free) and the SDK's `ModelTrainer` is built from it by
`sagemaker_sdk.model_trainer`; this module submits and follows it. A real run writes the stage config to S3
(hyperparameter values are limited to 2500 characters), attaches to a job of the same artifact that is still
running instead of submitting a second one, submits through `ModelTrainer.train(wait=False)` (the SDK also
checks the role's permissions), polls status (printing secondary status transitions), streams the job's
CloudWatch log, raises StageFailed with the job's FailureReason, and leaves the next stage the artifact the
job published (the coordinator checks its manifest before going on). `--dry-run` builds every request offline
(`dry_run_requests`, see sagemaker_sdk.offline).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dilforge_shared.configs import PipelineConfig
from dilforge_shared.configs.cloud import SageMakerConfig
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.store import open_backend

from ..pipeline import StageFailed, StageJob, image_of
from .sagemaker_jobs import (
    PROCESSING_STAGES,
    JobSpec,
    ProcessingSpec,
    config_uri,
    hyperparameters_uri,
    job_base_name,
    job_spec,
    offline_jobs,
    processing_root,
    processing_specs,
    stage_hyperparameters,
    token_cache_spec,
)
from .sagemaker_sdk import (
    model_trainer,
    offline,
    offline_boto_session,
    record_requests,
    require_sdk,
    run_processor,
    sdk_session,
)

log = logging.getLogger("dilforge.coordinator.sagemaker")

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TERMINAL = {"Completed", "Failed", "Stopped"}


@dataclass
class SageMakerBackend:
    """`--backend sagemaker`. clients: {'sagemaker', 'logs', 's3'} boto3 clients (default: from `boto_session`,
    made from the config's region); the SDK submits through `boto_session` too."""

    config: SageMakerConfig | None = None
    dry_run: bool = False
    images: dict[str, str] = field(default_factory=dict)
    clients: dict[str, Any] = field(default_factory=dict)
    boto_session: Any = None
    stream_logs: bool = True
    out: Callable[[str], None] = print
    sleep: Callable[[float], None] = time.sleep
    name: str = "sagemaker"
    requests: list[dict] = field(default_factory=list)

    # ---- configuration -----------------------------------------------------------------------
    def prepare(self, pipeline: PipelineConfig) -> PipelineConfig:
        if self.config is None:
            if pipeline.sagemaker is None:
                raise ConfigError(
                    "--backend sagemaker needs a `sagemaker:` section in the pipeline config "
                    "(role_arn, region, stages: instance types); see configs/sagemaker-published.yaml"
                )
            self.config = pipeline.sagemaker
        if not pipeline.store.uri.startswith("s3://"):
            raise ConfigError(
                f"store.uri: SageMaker jobs exchange artifacts through S3; got {pipeline.store.uri!r} "
                "(pass --store s3://bucket/prefix)"
            )
        require_sdk()
        return pipeline

    def session(self):
        if self.boto_session is None:
            import boto3

            self.boto_session = boto3.Session(region_name=self.config.region)
            record_requests(self.boto_session, self.requests)
        return self.boto_session

    def client(self, name: str):
        if name not in self.clients:
            self.clients[name] = self.session().client(name)
        return self.clients[name]

    def image(self, stage: str) -> str:
        """By digest: the config's `images`, else what `coordinator images push` recorded."""
        if image := self.config.images.get(stage) or self.images.get(stage):
            return image
        from ..images import default_tag, pushed_image

        if image := pushed_image(stage):
            return image
        if self.dry_run:
            return f"{self.config.registry}/{self.config.repository_prefix}-{stage}:{default_tag(gpu=True)}"
        raise ConfigError(f"no image for stage {stage}: run `coordinator images push` or set sagemaker.images.{stage}")

    def spec(self, job: StageJob) -> JobSpec:
        return job_spec(job, self.config, self.image(image_of(job.stage)), job.s3_endpoint_url)

    # ---- the request -------------------------------------------------------------------------
    def dry_run_requests(self, pipeline: PipelineConfig, stage: str | None = None) -> list[dict]:
        """Every stage's CreateTrainingJob request, built by the SDK's own train() and captured at botocore."""
        self.prepare(pipeline)
        jobs = [job for job in offline_jobs(pipeline) if stage is None or job.stage == stage]
        specs = []
        for job in jobs:
            if job.stage in PROCESSING_STAGES:
                specs.append(self.processing(job))
                continue
            if cache := self.token_cache(job):
                specs.append([cache])
            specs.append(self.spec(job))
        boto_session = offline_boto_session(self.config.region)
        with offline(boto_session) as requests:
            session = sdk_session(boto_session, offline=True)
            for spec in specs:
                if isinstance(spec, list):
                    for phase in spec:
                        run_processor(phase, session)
                else:
                    model_trainer(spec, session).train(wait=False, logs=False)
        return requests

    def processing(self, job: StageJob) -> list[ProcessingSpec]:
        return processing_specs(job, self.config, self.image(image_of(job.stage)))

    def token_cache(self, job: StageJob) -> ProcessingSpec | None:
        return token_cache_spec(job, self.config, self.image(image_of(job.stage)))

    # ---- a real run --------------------------------------------------------------------------
    def running_job(self, job: StageJob) -> str | None:
        """A job of this artifact still running (attach to it instead of submitting a second one), or None."""
        base = job_base_name(self.config.job_name_prefix, job.stage, job.artifact_id)
        pattern = re.compile(re.escape(base) + r"-[0-9]+")
        for page in self.client("sagemaker").get_paginator("list_training_jobs").paginate(NameContains=base):
            for summary in page["TrainingJobSummaries"]:
                if pattern.fullmatch(summary["TrainingJobName"]) and summary["TrainingJobStatus"] in (
                    "InProgress",
                    "Stopping",
                ):
                    return summary["TrainingJobName"]
        return None

    def run(self, job: StageJob) -> None:
        if self.config is None:
            raise ConfigError("SageMakerBackend.prepare(pipeline) must run first (it reads the sagemaker section)")
        if self.dry_run:
            raise DilforgeError("a dry run builds requests offline: use dry_run_requests(pipeline)")
        self.upload_config(job)
        if job.stage in PROCESSING_STAGES:
            self.run_processing(job, self.processing(job))
            return
        if name := self.running_job(job):
            self.out(f"[{job.stage}] attaching to running job {name}")
        else:
            spec = self.spec(job)  # a bad request fails before the token cache is built
            if cache := self.token_cache(job):
                self.run_processing(job, [cache])
            submitted = len(self.requests)
            model_trainer(spec, sdk_session(self.session())).train(wait=False, logs=False)
            request = self.requests[submitted]
            name = request["TrainingJobName"]
            self.out(
                f"[{job.stage}] submitted training job {name} "
                f"({request['ResourceConfig']['InstanceCount']} x {request['ResourceConfig']['InstanceType']})"
            )
        self.wait(job.stage, name)

    def upload_config(self, job: StageJob) -> None:
        where = config_uri(self.config, job)
        backend = open_backend(where.rsplit("/", 1)[0], job.s3_endpoint_url)
        backend.write_bytes(where.rsplit("/", 1)[1], job.config.model_dump_json(indent=2).encode())

    def run_processing(self, job: StageJob, specs: list[ProcessingSpec]) -> None:
        """Processing jobs in order (curate's phases, `sagemaker_jobs.processing_specs`, or CPT's token cache),
        each waited for; a failed one fails the stage, and a rerun's curate jobs skip the datatrove tasks the
        earlier attempt finished."""
        hp = stage_hyperparameters(job, self.config, job.s3_endpoint_url)
        where = hyperparameters_uri(self.config, job)
        open_backend(where.rsplit("/", 1)[0], job.s3_endpoint_url).write_bytes(
            "hyperparameters.json", json.dumps(hp).encode()
        )
        session = sdk_session(self.session())
        for spec in specs:
            submitted = len(self.requests)
            run_processor(spec, session)
            name = self.requests[submitted]["ProcessingJobName"]
            self.out(f"[{job.stage}] {spec.phase}: submitted processing job {name} ({spec.num_instances} x "
                     f"{spec.instance_type})")  # fmt: skip
            self.wait_processing(job.stage, name)
        open_backend(processing_root(self.config, job), job.s3_endpoint_url).delete_prefix("")  # intermediates

    def wait_processing(self, stage: str, name: str) -> dict:
        sm = self.client("sagemaker")
        while (desc := sm.describe_processing_job(ProcessingJobName=name))["ProcessingJobStatus"] not in TERMINAL:
            self.sleep(self.config.poll_interval_s)
        status = desc["ProcessingJobStatus"]
        if status != "Completed":
            reason = desc.get("FailureReason") or desc.get("ExitMessage") or f"job {name} ended {status}"
            raise StageFailed(stage, f"SageMaker processing job {name} {status}: {reason}")
        self.out(f"[{stage}] {name}: Completed")
        return desc

    def wait(self, stage: str, name: str) -> dict:
        """Poll until the job ends; print status transitions and its log; raise StageFailed unless Completed."""
        sm = self.client("sagemaker")
        seen_transitions = 0
        logs = LogTail(self.client("logs"), name, self.out) if self.stream_logs else None
        while True:
            desc = sm.describe_training_job(TrainingJobName=name)
            transitions = desc.get("SecondaryStatusTransitions", [])
            for t in transitions[seen_transitions:]:
                self.out(f"[{stage}] {name}: {t['Status']}: {t.get('StatusMessage', '')}".rstrip(": "))
            seen_transitions = len(transitions)
            if logs is not None:
                logs.poll()
            status = desc["TrainingJobStatus"]
            if status in TERMINAL:
                if logs is not None:
                    logs.poll()
                break
            self.sleep(self.config.poll_interval_s)
        if status != "Completed":
            reason = desc.get("FailureReason") or f"job {name} ended {status} ({desc.get('SecondaryStatus', '')})"
            raise StageFailed(stage, f"SageMaker job {name} {status}: {reason}")
        billable = desc.get("BillableTimeInSeconds")
        self.out(f"[{stage}] {name}: Completed" + (f" ({billable} billable seconds)" if billable else ""))
        return desc


class LogTail:
    """Follow the job's CloudWatch log streams (one per host: <job>/algo-N-<epoch>) from the start."""

    def __init__(self, logs, job_name: str, out: Callable[[str], None]):
        self.logs, self.job_name, self.out = logs, job_name, out
        self.tokens: dict[str, str | None] = {}

    def poll(self) -> None:
        try:
            streams = self.logs.describe_log_streams(
                logGroupName=LOG_GROUP, logStreamNamePrefix=self.job_name + "/", orderBy="LogStreamName"
            )["logStreams"]
        except self.logs.exceptions.ResourceNotFoundException:
            return
        for stream in streams:
            sname = stream["logStreamName"]
            host = sname.split("/", 1)[1].rsplit("-", 1)[0] if "/" in sname else sname
            while True:
                kwargs = {"logGroupName": LOG_GROUP, "logStreamName": sname, "startFromHead": True}
                if self.tokens.get(sname):
                    kwargs["nextToken"] = self.tokens[sname]
                page = self.logs.get_log_events(**kwargs)
                for event in page["events"]:
                    self.out(f"  {host}| {event['message'].rstrip()}")
                token = page.get("nextForwardToken")
                if token == self.tokens.get(sname) or not page["events"]:
                    self.tokens[sname] = token
                    break
                self.tokens[sname] = token
