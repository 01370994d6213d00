"""`--backend sagemaker`: each stage as a SageMaker training job (curate, and CPT's token cache, as Processing
jobs) through the SDK's ModelTrainer / Processor, which wait and log. `job_spec` / `processing_specs` are SDK-free,
so sagemaker-local runs the same jobs; `--dry-run` runs the SDK `offline`, printing what botocore would send."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dilforge_cpt.model_config import ModelConfig
from dilforge_cpt.recipes import source_kind
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.store import open_backend

from ..cloud import SageMakerConfig, StageResources
from ..config import PipelineConfig
from ..pipeline import StageFailed, StageJob, build_hyperparameters, image_of, module_env, plan_stage

HYPERPARAMETER_LIMIT = 2500
MULTI_HOST_STAGES = {"cpt"}
BASE_NAME_LIMIT = 48  # the SDK appends -YYYYMMDDHHMMSS; SageMaker names are at most 63 characters
CHECKPOINT_PATH = "/opt/ml/checkpoints"
TENSORBOARD_PATH = "/opt/ml/output/tensorboard"
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
    """`<prefix>-<stage>-<artifact id>`, cut so the SDK's timestamp suffix keeps the name within 63 characters."""
    return f"{prefix}-{stage}-{artifact_id}"[:BASE_NAME_LIMIT].rstrip("-")


def offline_jobs(pipeline: PipelineConfig) -> list[StageJob]:
    """Plan every stage without reading S3 (`plan_stage` offline), each fed the ones before."""
    planned: dict[str, StageJob] = {}
    for stage, _ in pipeline.stages():
        upstream = {name: job.artifact_uri for name, job in planned.items()}
        planned[stage] = plan_stage(pipeline, stage, upstream, offline=True)
    return list(planned.values())


@dataclass(frozen=True)
class Machines:
    """What every SageMaker job of a stage names: who runs it, on what, for how long (training and processing)."""

    stage: str
    base_job_name: str
    image: str
    role_arn: str
    instance_type: str
    num_instances: int
    volume_size_gb: int
    max_runtime_s: int
    environment: dict[str, str]
    tags: dict[str, str]


@dataclass(frozen=True)
class JobSpec(Machines):
    """One stage's training job, SDK-free: everything `model_trainer` hands to ModelTrainer, cloud and local alike."""

    spot: bool
    max_wait_s: int | None
    input_mode: str
    channels: dict[str, str]  # channel name -> S3 prefix of the upstream artifact folder (with a trailing /)
    output_path: str
    checkpoint_uri: str
    tensorboard_uri: str
    hyperparameters: dict[str, str]
    metric_definitions: list[dict[str, str]]
    subnets: list[str] = field(default_factory=list)
    security_group_ids: list[str] = field(default_factory=list)
    max_retry_attempts: int = 0


def output_root(cfg: SageMakerConfig, job: StageJob) -> str:
    return (cfg.output_uri or f"{job.store_uri}/sagemaker").rstrip("/")


def checkpoint_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    """The training job's checkpoint prefix, restored into /opt/ml/checkpoints of every host (with a trailing /)."""
    return f"{output_root(cfg, job)}/checkpoints/{job.stage}/{job.artifact_id}/"


def config_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    """Where the stage config goes (hyperparameter values are limited to 2500 characters)."""
    return f"{output_root(cfg, job)}/configs/{job.stage}/{job.artifact_id}.json"


def write_uri(uri: str, text: str, endpoint_url: str | None) -> None:
    """Write `text` to the object at `uri` (a config or hyperparameters file a job reads)."""
    parent, _, name = uri.rpartition("/")
    open_backend(parent, endpoint_url).write_bytes(name, text.encode())


def require_s3_inputs(job: StageJob) -> None:
    """SageMaker jobs (training and processing) read their data and models from S3, never from this machine."""
    uris = [s.uri for s in job.config.file_sources()] + job.config.model_uris()
    if isinstance(job.config, ModelConfig) and source_kind(job.config.source) in ("folder", "gguf"):
        uris.append(job.config.source)  # a recipe is fetched by the job itself; a local folder is not reachable
    if bad := [u for u in uris if not u.startswith("s3://")]:
        raise ConfigError(
            f"{job.stage}: {bad} are local paths; SageMaker jobs read data and models from S3: "
            "upload them and use s3:// URIs in the config"
        )


def stage_hyperparameters(job: StageJob, cfg: SageMakerConfig, endpoint_url: str | None) -> dict[str, str]:
    """The stage's request as SageMaker passes it (a training job's hyperparameters, a processing job's
    hyperparameters.json); `endpoint_url` is the S3 endpoint as the job's containers reach it."""
    return build_hyperparameters(
        job.config, job.artifact_uri, job.run_id, job.inputs, endpoint_url, config_uri=config_uri(cfg, job)
    )


def job_environment(job: StageJob, image: str, res: StageResources, extra: dict[str, str]) -> dict[str, str]:
    """What every dilforge job's containers get, then `extra`, then the config's own (validated) entries."""
    env = {"DILFORGE_IMAGE": image, "DILFORGE_RUN_ID": job.run_id, "DILFORGE_LOG_LEVEL": "INFO", **extra}
    return {**env, **res.environment}


def job_tags(job: StageJob, cfg: SageMakerConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    tags = {"dilforge:run-id": job.run_id, "dilforge:stage": job.stage, "dilforge:artifact-id": job.artifact_id}
    return {**tags, **(extra or {}), **cfg.tags}


def job_spec(job: StageJob, cfg: SageMakerConfig, image: str, endpoint_url: str | None = None) -> JobSpec:
    """The job definition of one stage; `endpoint_url` is the S3 endpoint as the job's containers reach it."""
    require_s3_inputs(job)
    res = cfg.resources(job.stage)
    if res.num_instances > 1 and job.stage not in MULTI_HOST_STAGES:
        raise ConfigError(
            f"sagemaker.stages.{job.stage}.num_instances: {job.stage} runs on one host "
            f"(multi-host stages: {sorted(MULTI_HOST_STAGES)})"
        )
    hp = stage_hyperparameters(job, cfg, endpoint_url)
    for key, value in hp.items():
        if len(value) > HYPERPARAMETER_LIMIT:
            raise ConfigError(
                f"hyperparameter {key!r} of stage {job.stage} is {len(value)} characters; "
                f"SageMaker allows {HYPERPARAMETER_LIMIT}"
            )
    spot = cfg.spot if res.spot is None else res.spot
    root = output_root(cfg, job)
    return JobSpec(
        stage=job.stage,
        base_job_name=job_base_name(cfg.job_name_prefix, job.stage, job.artifact_id),
        image=image,
        role_arn=cfg.role_arn,
        instance_type=res.instance_type,
        num_instances=res.num_instances,
        volume_size_gb=res.volume_size_gb,
        spot=spot,
        max_runtime_s=res.max_runtime_s,
        max_wait_s=(res.max_wait_s or min(2 * res.max_runtime_s, 28 * 24 * 3600)) if spot else None,
        input_mode=res.input_mode,
        channels={n: u.rstrip("/") + "/" for n, u in sorted(job.inputs.items())},
        output_path=f"{root}/output/",
        checkpoint_uri=checkpoint_uri(cfg, job),
        tensorboard_uri=f"{root}/tensorboard/{job.stage}/{job.artifact_id}/",
        environment=job_environment(job, image, res, module_env(job.stage)),
        hyperparameters=hp,
        tags=job_tags(job, cfg),
        metric_definitions=METRIC_DEFINITIONS.get(job.stage, []),
        subnets=list(cfg.subnets),
        security_group_ids=list(cfg.security_group_ids),
        max_retry_attempts=cfg.max_retry_attempts,
    )


# ---- curate: SageMaker Processing jobs across instances --------------------------------------------

PROCESSING_ROOT = "/opt/ml/processing"
PROCESSING_OPT_ML = f"{PROCESSING_ROOT}/dilforge"  # the stage's /opt/ml root inside a processing container
CURATE_PHASES = ("filter", "buckets", "cluster", "write")
PROCESSING_STAGES = {"curate"}  # stages that run as SageMaker Processing jobs, not training jobs


@dataclass(frozen=True)
class ProcessingSpec(Machines):
    """One SageMaker Processing job (a curate phase, or CPT's token cache), SDK-free (`run_processor` submits
    it)."""

    phase: str
    entrypoint: list[str]
    inputs: dict[str, tuple[str, str]]  # input name -> (S3 prefix, container path)
    outputs: dict[str, tuple[str, str]]  # output name -> (container path, S3 prefix)


def processing_root(cfg: SageMakerConfig, job: StageJob) -> str:
    """The S3 prefix of one artifact's Processing jobs (`config/`, `work/`); removed once the artifact is published,
    kept after a failure so that a rerun resumes."""
    return f"{output_root(cfg, job)}/processing/{job.stage}/{job.artifact_id}"


def hyperparameters_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    return f"{processing_root(cfg, job)}/config/hyperparameters.json"


def processing_spec(
    job: StageJob,
    cfg: SageMakerConfig,
    image: str,
    phase: str,
    entrypoint: list[str],
    inputs: dict[str, tuple[str, str]],
    outputs: dict[str, tuple[str, str]],
    num_instances: int = 1,
    instance_type: str | None = None,
    env: dict[str, str] | None = None,
) -> ProcessingSpec:
    """One Processing job of the stage; every one reads the stage's hyperparameters file."""
    require_s3_inputs(job)
    res = cfg.resources(job.stage)
    hp_dir = hyperparameters_uri(cfg, job).rsplit("/", 1)[0] + "/"
    return ProcessingSpec(
        stage=job.stage,
        phase=phase,
        base_job_name=f"{job_base_name(cfg.job_name_prefix, job.stage, job.artifact_id)}-{phase}",
        image=image,
        role_arn=cfg.role_arn,
        instance_type=instance_type or res.instance_type,
        num_instances=num_instances,
        volume_size_gb=res.volume_size_gb,
        max_runtime_s=res.max_runtime_s,
        entrypoint=entrypoint,
        inputs={"hyperparameters": (hp_dir, f"{PROCESSING_OPT_ML}/input/config"), **inputs},
        outputs=outputs,
        environment=job_environment(job, image, res, {"DILFORGE_OPT_ML": PROCESSING_OPT_ML, **(env or {})}),
        tags=job_tags(job, cfg, {"dilforge:phase": phase}),
    )


def processing_specs(job: StageJob, cfg: SageMakerConfig, image: str) -> list[ProcessingSpec]:
    """The curate stage on several instances: one Processing job per datatrove phase, each reading the earlier
    phases' outputs from one S3 prefix, then one that publishes (the output equals a one-machine run's)."""
    work = f"{processing_root(cfg, job)}/work/"
    specs = []
    for i, phase in enumerate((*CURATE_PHASES, "publish")):
        entry = ["python3", "-m", "dilforge_curate", "process", phase, "--read", f"{PROCESSING_ROOT}/work"]
        inputs = {"work": (work, f"{PROCESSING_ROOT}/work")} if i > 0 else {}  # every earlier phase's outputs
        outputs = {}
        if phase != "publish":
            entry += ["--write", f"{PROCESSING_ROOT}/output"]
            outputs["work"] = (f"{PROCESSING_ROOT}/output", work)
        hosts = cfg.resources(job.stage).num_instances if phase in ("filter", "buckets", "write") else 1
        specs.append(processing_spec(job, cfg, image, phase, entry, inputs, outputs, num_instances=hosts))
    return specs


# ---- cpt: the token cache as a Processing job before the training job ----------------------------


def token_cache_spec(job: StageJob, cfg: SageMakerConfig, image: str) -> ProcessingSpec | None:
    """CPT's token cache on one CPU instance (`token_cache_instance_type`), or None when the training job tokenises:
    `python -m dilforge_cpt build-cache` writes into the training job's checkpoint prefix, which SageMaker restores
    on every training host, where the stage finds the cache finished."""
    res = cfg.resources(job.stage)
    if job.stage != "cpt" or res.token_cache_instance_type is None:
        return None
    tokens = f"{checkpoint_uri(cfg, job)}tokens/"
    return processing_spec(
        job,
        cfg,
        image,
        "token-cache",
        ["python3", "-m", "dilforge_cpt", "build-cache"],
        {},
        {"tokens": (f"{PROCESSING_OPT_ML}/checkpoints/tokens", tokens)},
        instance_type=res.token_cache_instance_type,
        # the stage restores an earlier build's output from there and reuses it (an input cannot share the path)
        env={"DILFORGE_TOKEN_CACHE_URI": tokens},
    )


# ---- the SDK side: ModelTrainer / Processor from a spec, the offline dry run ------------------------


def require_sdk() -> None:
    """One line, not a traceback, when the optional SDK extra is missing."""
    try:
        import sagemaker.train.model_trainer  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"the SageMaker Python SDK is not installed ({exc.name}): install the SageMaker SDK extra: "
            "bash scripts/setup.sh --sagemaker (requirements-sagemaker.txt)"
        ) from None


OFFLINE_SDK_CONFIG = {"SchemaVersion": "1.0", "SageMaker": {"PythonSDK": {"Modules": {"TelemetryOptOut": True}}}}


def sdk_session(boto_session, offline: bool = False):
    """A sagemaker Session on `boto_session`; offline (dry run, local mode): the SDK's telemetry opted out
    through its documented defaults config, so nothing at all leaves the machine."""
    from sagemaker.core.helper.session_helper import Session

    session = Session(boto_session=boto_session)
    if offline:
        _validate_offline_config()
        session.sagemaker_config = OFFLINE_SDK_CONFIG  # after init: Session() would re-validate it 5 times
    return session


@functools.cache
def _validate_offline_config() -> None:
    from sagemaker.core.config.config_manager import SageMakerConfig as SdkConfig

    SdkConfig.validate_sagemaker_config(OFFLINE_SDK_CONFIG)


def _config_manager(session):
    """The SDK re-validates a session's defaults config against its whole JSON schema on every lookup, dozens of
    times per job; our offline config is a constant, validated here once, so the manager skips re-checks."""
    from sagemaker.core.config.config_manager import SageMakerConfig as SdkConfig

    if session is None or getattr(session, "sagemaker_config", None) is not OFFLINE_SDK_CONFIG:
        return {}
    _validate_offline_config()

    class Prevalidated(SdkConfig):
        @staticmethod
        def validate_sagemaker_config(sagemaker_config=None):
            return None

    return {"config_mgr": Prevalidated()}


def model_trainer(
    spec: JobSpec, session=None, local_root: str | None = None, local_channels: dict[str, str] | None = None
):
    """The SDK's ModelTrainer for `spec`: a SageMaker training job, or (local_root given) SageMaker's local
    container mode with the upstream artifacts as local channel folders (`local_channels`: name -> folder)."""
    from sagemaker.core.training import configs as sm
    from sagemaker.train.model_trainer import Mode, ModelTrainer

    local = local_root is not None
    if local:
        missing = sorted(set(spec.channels) - set(local_channels or {}))
        if missing:
            raise DilforgeError(f"{spec.stage}: local mode needs a folder for channels {missing}")
        channels = [sm.InputData(channel_name=n, data_source=str(local_channels[n])) for n in sorted(spec.channels)]
    else:
        channels = [
            sm.Channel(
                channel_name=n,
                input_mode=spec.input_mode,
                data_source=sm.DataSource(
                    s3_data_source=sm.S3DataSource(
                        s3_data_type="S3Prefix", s3_uri=uri, s3_data_distribution_type="FullyReplicated"
                    )
                ),
            )
            for n, uri in sorted(spec.channels.items())
        ]
    stopping = {"max_runtime_in_seconds": spec.max_runtime_s}
    if spec.spot:
        stopping["max_wait_time_in_seconds"] = spec.max_wait_s
    networking = {"enable_network_isolation": False}
    if spec.subnets:
        networking.update(subnets=spec.subnets, security_group_ids=spec.security_group_ids)
    trainer = ModelTrainer(
        training_mode=Mode.LOCAL_CONTAINER if local else Mode.SAGEMAKER_TRAINING_JOB,
        sagemaker_session=session,
        role=spec.role_arn,
        base_job_name=spec.base_job_name,
        training_image=spec.image,
        training_input_mode=spec.input_mode,
        compute=sm.Compute(
            instance_type="local" if local else spec.instance_type,
            instance_count=spec.num_instances,
            volume_size_in_gb=spec.volume_size_gb,
            enable_managed_spot_training=spec.spot,
        ),
        networking=sm.Networking(**networking),
        stopping_condition=sm.StoppingCondition(**stopping),
        output_data_config=sm.OutputDataConfig(s3_output_path=spec.output_path),
        checkpoint_config=sm.CheckpointConfig(s3_uri=spec.checkpoint_uri, local_path=CHECKPOINT_PATH),
        environment=dict(spec.environment),
        hyperparameters=dict(spec.hyperparameters),
        tags=[sm.Tag(key=k, value=v) for k, v in sorted(spec.tags.items())],
        input_data_config=channels or None,
        **({"local_container_root": str(local_root)} if local else {}),
        **_config_manager(session),
    )
    trainer.with_metric_definitions(
        [sm.MetricDefinition(name=d["Name"], regex=d["Regex"]) for d in spec.metric_definitions]
    )
    trainer.with_tensorboard_output_config(
        sm.TensorBoardOutputConfig(s3_output_path=spec.tensorboard_uri, local_path=TENSORBOARD_PATH)
    )
    if spec.max_retry_attempts:
        trainer.with_retry_strategy(sm.RetryStrategy(maximum_retry_attempts=spec.max_retry_attempts))
    return trainer


def run_processor(spec: ProcessingSpec, session, wait: bool = False) -> str:
    """Submit one Processing job through the SDK's `Processor.run` (the request is the SDK's own); its name."""
    from sagemaker.core.processing import Processor
    from sagemaker.core.shapes import ProcessingInput, ProcessingOutput, ProcessingS3Input, ProcessingS3Output

    processor = Processor(
        role=spec.role_arn,
        image_uri=spec.image,
        instance_count=spec.num_instances,
        instance_type=spec.instance_type,
        entrypoint=spec.entrypoint,
        volume_size_in_gb=spec.volume_size_gb,
        max_runtime_in_seconds=spec.max_runtime_s,
        base_job_name=spec.base_job_name,
        sagemaker_session=session,
        env=dict(spec.environment),
        tags=[{"Key": k, "Value": v} for k, v in sorted(spec.tags.items())],
    )
    prefix = {"s3_data_type": "S3Prefix", "s3_input_mode": "File", "s3_data_distribution_type": "FullyReplicated"}
    inputs = [
        ProcessingInput(input_name=name, s3_input=ProcessingS3Input(s3_uri=uri, local_path=path, **prefix))
        for name, (uri, path) in sorted(spec.inputs.items())
    ]
    outputs = [
        ProcessingOutput(
            output_name=name, s3_output=ProcessingS3Output(s3_uri=uri, local_path=path, s3_upload_mode="EndOfJob")
        )
        for name, (path, uri) in sorted(spec.outputs.items())
    ]
    name = f"{spec.base_job_name}-{dt.datetime.now(dt.UTC):%Y%m%d%H%M%S}"  # the phase kept whole (base names are cut)
    name = name[-63:].lstrip("-")
    processor.run(inputs=inputs, outputs=outputs, wait=wait, logs=False, job_name=name)
    return name


def _offline_response(operation: str, body: dict) -> dict:
    """The dry run's answer: the created job's ARN, or (DescribeTrainingJob) a job still starting."""
    if operation == "CreateProcessingJob":
        return {
            "ProcessingJobArn": f"arn:aws:sagemaker:us-east-1:000000000000:processing-job/{body['ProcessingJobName']}"
        }
    name = body.get("TrainingJobName", "dry-run")
    arn = f"arn:aws:sagemaker:us-east-1:000000000000:training-job/{name}"
    if operation == "CreateTrainingJob":
        return {"TrainingJobArn": arn}
    return {
        "TrainingJobName": name,
        "TrainingJobArn": arn,
        "TrainingJobStatus": "InProgress",
        "SecondaryStatus": "Starting",
        "CreationTime": dt.datetime.now(dt.UTC),
        "AlgorithmSpecification": {"TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceCount": 1, "VolumeSizeInGB": 1},
        "StoppingCondition": {},
        "ModelArtifacts": {"S3ModelArtifacts": "s3://dry-run/model.tar.gz"},
    }


def record_requests(boto_session, requests: list[dict]) -> None:
    """Append every CreateTrainingJob's and CreateProcessingJob's parameters, as botocore is about to serialize
    them, to `requests`."""
    import copy

    def params(params, model, **kwargs):
        requests.append(copy.deepcopy(params))

    boto_session.events.register("before-parameter-build.sagemaker.CreateTrainingJob", params)
    boto_session.events.register("before-parameter-build.sagemaker.CreateProcessingJob", params)


@contextlib.contextmanager
def offline(boto_session) -> Iterator[list[dict]]:
    """Answer every AWS call of `boto_session` in-process (nothing is signed or sent; no credentials needed) and
    yield the CreateTrainingJob requests it saw. botocore has validated each against its service model by then."""
    from botocore.awsrequest import AWSResponse

    requests: list[dict] = []
    record_requests(boto_session, requests)

    def answer(model, params, **kwargs):
        if model.name not in ("CreateTrainingJob", "DescribeTrainingJob", "CreateProcessingJob"):
            raise DilforgeError(f"dry run: unexpected AWS call {model.service_model.service_name}:{model.name}")
        body = json.loads(params.get("body") or b"{}")
        return AWSResponse("https://dry-run.invalid", 200, {}, None), _offline_response(model.name, body)

    boto_session.events.register("before-call", answer)
    previous = os.environ.get("SAGEMAKER_VALIDATE_ROLE")
    os.environ["SAGEMAKER_VALIDATE_ROLE"] = "false"  # the SDK's IAM role check needs credentials; a dry run has none
    try:
        yield requests
    finally:
        if previous is None:
            os.environ.pop("SAGEMAKER_VALIDATE_ROLE", None)
        else:
            os.environ["SAGEMAKER_VALIDATE_ROLE"] = previous


def offline_boto_session(region: str):
    """A boto3 session that can never sign: no credential provider, so nothing can leave this process."""
    import boto3
    import botocore.session

    core = botocore.session.Session()
    core.get_component("credential_provider").providers = []
    return boto3.Session(botocore_session=core, region_name=region)


# ---- the backend -----------------------------------------------------------------------------------


@dataclass
class SageMakerBackend:
    """`--backend sagemaker`: the SDK submits and waits through `boto_session` (default: made from the config's
    region)."""

    config: SageMakerConfig | None = None
    dry_run: bool = False
    boto_session: Any = None
    stream_logs: bool = True
    out: Callable[[str], None] = print
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

    def image(self, stage: str) -> str:
        """By digest: the config's `images`, else what `coordinator images push` recorded."""
        if image := self.config.images.get(stage):
            return image
        from ..images import default_tag, pushed_image

        if image := pushed_image(stage):
            return image
        if self.dry_run:
            return f"{self.config.registry}/{self.config.repository_prefix}-{stage}:{default_tag(gpu=True)}"
        raise ConfigError(f"no image for stage {stage}: run `coordinator images push` or set sagemaker.images.{stage}")

    # ---- the request -------------------------------------------------------------------------
    def dry_run_requests(self, pipeline: PipelineConfig, stage: str | None = None) -> list[dict]:
        """Every stage's CreateTrainingJob / CreateProcessingJob request, built by the SDK and captured at botocore."""
        self.prepare(pipeline)
        boto_session = offline_boto_session(self.config.region)
        with offline(boto_session) as requests:
            session = sdk_session(boto_session, offline=True)
            for job in offline_jobs(pipeline):
                if stage not in (None, job.stage):
                    continue
                image = self.image(image_of(job.stage))
                if job.stage in PROCESSING_STAGES:
                    specs = processing_specs(job, self.config, image)
                else:
                    specs = [
                        token_cache_spec(job, self.config, image),
                        job_spec(job, self.config, image, job.s3_endpoint_url),
                    ]
                for spec in filter(None, specs):
                    if isinstance(spec, ProcessingSpec):
                        run_processor(spec, session)
                    else:
                        model_trainer(spec, session).train(wait=False, logs=False)
        return requests

    # ---- a real run --------------------------------------------------------------------------
    def running_job(self, job: StageJob) -> str | None:
        """A job of this artifact still running (attach to it instead of submitting a second one), or None."""
        base = job_base_name(self.config.job_name_prefix, job.stage, job.artifact_id)
        pattern = re.compile(re.escape(base) + r"-[0-9]+")
        for page in self.session().client("sagemaker").get_paginator("list_training_jobs").paginate(NameContains=base):
            for summary in page["TrainingJobSummaries"]:
                running = summary["TrainingJobStatus"] in ("InProgress", "Stopping")
                if running and pattern.fullmatch(summary["TrainingJobName"]):
                    return summary["TrainingJobName"]
        return None

    def run(self, job: StageJob) -> None:
        write_uri(config_uri(self.config, job), job.config.model_dump_json(indent=2), job.s3_endpoint_url)
        if job.stage in PROCESSING_STAGES:
            self.run_processing(job, processing_specs(job, self.config, self.image(image_of(job.stage))))
            return
        if name := self.running_job(job):  # attaching needs no image
            self.out(f"[{job.stage}] attaching to running job {name}")
        else:
            image = self.image(image_of(job.stage))
            spec = job_spec(job, self.config, image, job.s3_endpoint_url)  # a bad request fails before the cache
            if cache := token_cache_spec(job, self.config, image):
                self.run_processing(job, [cache])
            submitted = len(self.requests)
            model_trainer(spec, sdk_session(self.session())).train(wait=False, logs=False)
            name = self.requests[submitted]["TrainingJobName"]
            self.out(f"[{job.stage}] submitted training job {name} ({spec.num_instances} x {spec.instance_type})")
        self.wait(job.stage, name)

    def run_processing(self, job: StageJob, specs: list[ProcessingSpec]) -> None:
        """Processing jobs in order (curate's phases, `processing_specs`, or CPT's token cache), each waited for; a
        failed one fails the stage, and a rerun's curate jobs skip the datatrove tasks the earlier attempt finished."""
        hp = stage_hyperparameters(job, self.config, job.s3_endpoint_url)
        write_uri(hyperparameters_uri(self.config, job), json.dumps(hp), job.s3_endpoint_url)
        session = sdk_session(self.session())
        for spec in specs:
            name = run_processor(spec, session)
            self.out(f"[{job.stage}] {spec.phase}: submitted processing job {name} ({spec.num_instances} x "
                     f"{spec.instance_type})")  # fmt: skip
            self.wait(job.stage, name, processing=True)
        open_backend(processing_root(self.config, job), job.s3_endpoint_url).delete_prefix("")  # intermediates

    def wait(self, stage: str, name: str, processing: bool = False) -> None:
        """Follow the job with the SDK's waiter (and its CloudWatch log reader when `stream_logs`) until it ends;
        raise StageFailed with the job's FailureReason unless it completed."""
        from sagemaker.core.resources import ProcessingJob, TrainingJob
        from sagemaker.core.utils.exceptions import FailedStatusError

        if self.stream_logs:
            read_logs_with(self.session())
        resource = ProcessingJob if processing else TrainingJob
        job = resource.get(name, session=self.session(), region=self.config.region)
        with contextlib.suppress(FailedStatusError):  # reported below, with the job's own reason
            job.wait(poll=math.ceil(self.config.poll_interval_s), logs=self.stream_logs)
        status = job.processing_job_status if processing else job.training_job_status
        kind = "processing job" if processing else "job"
        if status != "Completed":
            reason = job.failure_reason if isinstance(job.failure_reason, str) else f"job {name} ended {status}"
            raise StageFailed(stage, f"SageMaker {kind} {name} {status}: {' '.join(reason.split())}")
        billable = getattr(job, "billable_time_in_seconds", None)
        self.out(
            f"[{stage}] {name}: Completed" + (f" ({billable} billable seconds)" if isinstance(billable, int) else "")
        )


def read_logs_with(boto_session) -> None:
    """The SDK's log reader uses one process-wide CloudWatch Logs client made from the default boto3 session; make
    it one of `boto_session`, so logs are read in the job's region with the run's credentials."""
    from sagemaker.core.utils.logs import CloudWatchLogsClient

    client = boto_session.client("logs")
    CloudWatchLogsClient.client = client  # read by the singleton's constructor, if it has not run yet
    CloudWatchLogsClient().client = client  # the singleton every log stream handler asks
