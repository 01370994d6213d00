"""Run each stage as a SageMaker training job (boto3 CreateTrainingJob), exchanging manifests in S3.

One request per stage: the stage image by digest, the execution role, instance type and count, one
S3Prefix input channel per upstream artifact (the artifact folder: manifest.json + data-*/, mounted at
/opt/ml/input/data/<name>/ where the contract's ctx.input() finds it), output, checkpoint and
TensorBoard S3 URIs, metric definitions that match the stages' log lines, managed spot with a max
wait, an explicit max runtime, environment and tags. The stage config goes to S3 and the job gets its
URI (hyperparameter values are limited to 2500 characters).

`--dry-run` builds every request offline (no credentials, no S3 reads: artifact ids are computed from
the configs and the input URIs, not from their digests) and prints them. A real run uploads the
config, submits, polls status (printing secondary status transitions), streams the job's CloudWatch
log, raises StageFailed with the job's FailureReason, and leaves the next stage the artifact the job
published (the coordinator checks its manifest before going on).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dilforge_shared.configs import ModelConfig, PipelineConfig
from dilforge_shared.configs.cloud import SageMakerConfig
from dilforge_shared.contract import build_hyperparameters
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.manifest import InputRef
from dilforge_shared.models import artifact_id as planned_artifact_id
from dilforge_shared.recipes import source_kind
from dilforge_shared.store import open_backend

from ..pipeline import StageFailed, StageJob, image_of, module_env

log = logging.getLogger("dilforge.coordinator.sagemaker")

HYPERPARAMETER_LIMIT = 2500
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TERMINAL = {"Completed", "Failed", "Stopped"}
MULTI_HOST_STAGES = {"cpt"}
NUM = r"([-+]?(?:[0-9]*\.)?[0-9]+(?:[eE][-+]?[0-9]+)?)"

# SageMaker reads the job's stdout/stderr with these (first capture group = the value).
# cpt: its Metrics.record lines `step=10 phase=2 loss=2.31 lr=0.0003 grad_norm=0.9 tokens_per_s=...`
#      and validation lines `step=10 val_loss=2.4 val_bpb=1.1`;
# sft: transformers' PrinterCallback dicts `{'loss': '2.31', 'grad_norm': '0.9', 'learning_rate': ...}`
#      and `validation loss after: 1.2345`;
# eval: `bpb <model> / <set>: 1.2345 (...)`; tokenizer: `sweep (selected 32000)`.
METRIC_DEFINITIONS: dict[str, list[dict[str, str]]] = {
    "tokenizer": [
        {"Name": "tokenizer:selected_vocab_size", "Regex": r"sweep \(selected ([0-9]+)\)"},
    ],
    "cpt": [
        {"Name": "train:loss", "Regex": rf"\bphase=[0-9]+ loss={NUM}"},
        {"Name": "train:lr", "Regex": rf"\blr={NUM}"},
        {"Name": "train:grad_norm", "Regex": rf"\bgrad_norm={NUM}"},
        {"Name": "train:tokens_per_s", "Regex": rf"\btokens_per_s={NUM}"},
        {"Name": "train:mfu", "Regex": rf"\bmfu={NUM}"},
        {"Name": "validation:loss", "Regex": rf"\bval_loss={NUM}"},
        {"Name": "validation:bpb", "Regex": rf"\bval_bpb={NUM}"},
    ],
    "sft": [
        {"Name": "train:loss", "Regex": rf"'loss': '?{NUM}"},
        {"Name": "train:lr", "Regex": rf"'learning_rate': '?{NUM}"},
        {"Name": "train:grad_norm", "Regex": rf"'grad_norm': '?{NUM}"},
        {"Name": "validation:loss", "Regex": rf"validation loss after: {NUM}"},
    ],
    "eval": [
        {"Name": "eval:bpb", "Regex": rf"\bbpb [^:]+: {NUM} \("},
    ],
}


def job_base_name(prefix: str, stage: str, artifact_id: str) -> str:
    return f"{prefix}-{stage}-{artifact_id}"[:56]


def offline_jobs(pipeline: PipelineConfig) -> list[StageJob]:
    """Plan every stage without reading S3: ids from config + input URIs (a real run's ids also hash digests)."""
    store = pipeline.store.uri.rstrip("/")
    planned: dict[str, str] = {}
    jobs = []
    for stage, config in pipeline.stages():
        inputs = {name: planned[name] for name in config.consumes if name in planned}
        missing = [n for n in config.needed_inputs() if n not in inputs]
        if missing:
            raise DilforgeError(f"stage {stage} needs upstream artifacts {missing} in the same pipeline for a dry run")
        refs = [InputRef(name=n, kind="manifest", uri=u, sha256=f"offline:{u}") for n, u in sorted(inputs.items())]
        refs += [InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=f"offline:{s.uri}")
                 for s in config.data_sources()]
        refs += [InputRef(name=f"model:{u}", kind="data", uri=u, sha256=f"offline:{u}") for u in config.model_uris()]
        if isinstance(config, ModelConfig):
            refs.append(InputRef(name="source", kind="data", uri=config.source, sha256=f"offline:{config.source}"))
        artifact_id = planned_artifact_id(config, refs)
        uri = f"{store}/artifacts/{stage}/{artifact_id}"
        planned[stage] = uri
        jobs.append(StageJob(stage=stage, config=config, run_id=pipeline.run_id, artifact_uri=uri, inputs=inputs,
                             store_uri=store, s3_endpoint_url=pipeline.store.s3_endpoint_url))
    return jobs


def local_paths(job: StageJob) -> list[str]:
    """Data and model/tokenizer URIs a SageMaker job could not read: anything not on S3."""
    uris = [s.uri for s in job.config.data_sources()] + job.config.model_uris()
    if isinstance(job.config, ModelConfig) and source_kind(job.config.source) in ("folder", "gguf"):
        uris.append(job.config.source)  # a recipe is fetched by the job itself; a local folder is not reachable
    return [u for u in uris if not u.startswith("s3://")]


@dataclass
class SageMakerBackend:
    """`--backend sagemaker`. clients: {'sagemaker', 'logs', 's3'} boto3 clients (made from the config's region)."""
    config: SageMakerConfig | None = None
    dry_run: bool = False
    images: dict[str, str] = field(default_factory=dict)
    clients: dict[str, Any] = field(default_factory=dict)
    stream_logs: bool = True
    out: Callable[[str], None] = print
    sleep: Callable[[float], None] = time.sleep
    name: str = "sagemaker"
    requests: list[dict] = field(default_factory=list)

    # ---- configuration -----------------------------------------------------------------------
    def prepare(self, pipeline: PipelineConfig) -> PipelineConfig:
        if self.config is None:
            if pipeline.sagemaker is None:
                raise ConfigError("--backend sagemaker needs a `sagemaker:` section in the pipeline config "
                                  "(role_arn, region, stages: instance types); see configs/sagemaker-published.yaml")
            self.config = pipeline.sagemaker
        if not pipeline.store.uri.startswith("s3://"):
            raise ConfigError(f"store.uri: SageMaker jobs exchange artifacts through S3; got {pipeline.store.uri!r} "
                              "(pass --store s3://bucket/prefix)")
        return pipeline

    def client(self, name: str):
        if name not in self.clients:
            import boto3
            self.clients[name] = boto3.client(name, region_name=self.config.region)
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

    # ---- the request -------------------------------------------------------------------------
    def output_root(self, job: StageJob) -> str:
        return (self.config.output_uri or f"{job.store_uri}/sagemaker").rstrip("/")

    def config_uri(self, job: StageJob) -> str:
        return f"{self.output_root(job)}/configs/{job.stage}/{job.artifact_id}.json"

    def build_request(self, job: StageJob, job_name: str | None = None) -> dict:
        if bad := local_paths(job):
            raise ConfigError(f"{job.stage}: {bad} are local paths; SageMaker jobs read data and models from S3: "
                              "upload them and use s3:// URIs in the config")
        cfg = self.config
        res = cfg.resources(job.stage)
        if res.num_instances > 1 and job.stage not in MULTI_HOST_STAGES:
            raise ConfigError(f"sagemaker.stages.{job.stage}.num_instances: {job.stage} runs on one host "
                              f"(multi-host stages: {sorted(MULTI_HOST_STAGES)})")
        hp = build_hyperparameters(job.config, job.artifact_uri, job.run_id, job.inputs, job.s3_endpoint_url,
                                   config_uri=self.config_uri(job))
        for key, value in hp.items():
            if len(value) > HYPERPARAMETER_LIMIT:
                raise ConfigError(f"hyperparameter {key!r} of stage {job.stage} is {len(value)} characters; "
                                  f"SageMaker allows {HYPERPARAMETER_LIMIT}")
        image = self.image(image_of(job.stage))
        spot = cfg.spot if res.spot is None else res.spot
        root = self.output_root(job)
        stopping = {"MaxRuntimeInSeconds": res.max_runtime_s}
        if spot:
            stopping["MaxWaitTimeInSeconds"] = res.max_wait_s or min(2 * res.max_runtime_s, 28 * 24 * 3600)
        env = {"DILFORGE_IMAGE": image, "DILFORGE_RUN_ID": job.run_id, "DILFORGE_LOG_LEVEL": "INFO",
               **module_env(job.stage)}
        env.update(res.environment)
        tags = {"dilforge:run-id": job.run_id, "dilforge:stage": job.stage, "dilforge:artifact-id": job.artifact_id,
                **cfg.tags}
        request = {
            "TrainingJobName": job_name or job_base_name(cfg.job_name_prefix, job.stage, job.artifact_id) + "-1",
            "HyperParameters": hp,
            "AlgorithmSpecification": {
                "TrainingImage": image,
                "TrainingInputMode": res.input_mode,
                "MetricDefinitions": METRIC_DEFINITIONS.get(job.stage, []),
                "EnableSageMakerMetricsTimeSeries": True,
            },
            "RoleArn": cfg.role_arn,
            "InputDataConfig": [
                {"ChannelName": name,
                 "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": uri.rstrip("/") + "/",
                                                 "S3DataDistributionType": "FullyReplicated"}},
                 "InputMode": res.input_mode}
                for name, uri in sorted(job.inputs.items())
            ],
            "OutputDataConfig": {"S3OutputPath": f"{root}/output/"},
            "ResourceConfig": {"InstanceType": res.instance_type, "InstanceCount": res.num_instances,
                               "VolumeSizeInGB": res.volume_size_gb},
            "StoppingCondition": stopping,
            "EnableManagedSpotTraining": spot,
            "CheckpointConfig": {"S3Uri": f"{root}/checkpoints/{job.stage}/{job.artifact_id}/",
                                 "LocalPath": "/opt/ml/checkpoints"},
            "TensorBoardOutputConfig": {"S3OutputPath": f"{root}/tensorboard/{job.stage}/{job.artifact_id}/",
                                        "LocalPath": "/opt/ml/output/tensorboard"},
            "EnableNetworkIsolation": False,
            "Environment": env,
            "Tags": [{"Key": k, "Value": v} for k, v in sorted(tags.items())],
        }
        if not request["InputDataConfig"]:
            del request["InputDataConfig"]
        if cfg.max_retry_attempts:
            request["RetryStrategy"] = {"MaximumRetryAttempts": cfg.max_retry_attempts}
        if cfg.subnets:
            request["VpcConfig"] = {"Subnets": cfg.subnets, "SecurityGroupIds": cfg.security_group_ids}
        return request

    def dry_run_requests(self, pipeline: PipelineConfig) -> list[dict]:
        self.prepare(pipeline)
        return [self.build_request(job) for job in offline_jobs(pipeline)]

    # ---- a real run --------------------------------------------------------------------------
    def job_name(self, job: StageJob) -> tuple[str, bool]:
        """(name, attach): attach to a job of this artifact still running, else the next free name."""
        base = job_base_name(self.config.job_name_prefix, job.stage, job.artifact_id)
        sm = self.client("sagemaker")
        existing = []
        for page in sm.get_paginator("list_training_jobs").paginate(NameContains=base):
            existing += [j for j in page["TrainingJobSummaries"] if re.fullmatch(re.escape(base) + r"-[0-9]+",
                                                                                 j["TrainingJobName"])]
        for summary in existing:
            if summary["TrainingJobStatus"] in ("InProgress", "Stopping"):
                return summary["TrainingJobName"], True
        attempt = max((int(j["TrainingJobName"].rsplit("-", 1)[1]) for j in existing), default=0) + 1
        return f"{base}-{attempt}", False

    def run(self, job: StageJob) -> None:
        if self.config is None:
            raise ConfigError("SageMakerBackend.prepare(pipeline) must run first (it reads the sagemaker section)")
        if self.dry_run:
            raise DilforgeError("a dry run builds requests offline: use dry_run_requests(pipeline)")
        name, attach = self.job_name(job)
        if attach:
            self.out(f"[{job.stage}] attaching to running job {name}")
        else:
            request = self.build_request(job, name)
            backend = open_backend(self.config_uri(job).rsplit("/", 1)[0], job.s3_endpoint_url)
            backend.write_bytes(self.config_uri(job).rsplit("/", 1)[1], job.config.model_dump_json(indent=2).encode())
            self.client("sagemaker").create_training_job(**request)
            self.requests.append(request)
            self.out(f"[{job.stage}] submitted training job {name} "
                     f"({request['ResourceConfig']['InstanceCount']} x {request['ResourceConfig']['InstanceType']})")
        self.wait(job.stage, name)

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
            streams = self.logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=self.job_name + "/",
                                                     orderBy="LogStreamName")["logStreams"]
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
