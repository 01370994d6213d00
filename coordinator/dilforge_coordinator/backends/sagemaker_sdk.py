"""The SageMaker Python SDK side of a job: `model_trainer` builds the SDK's `ModelTrainer` from a `JobSpec` (a
training job, or SageMaker's local container mode), and `offline` answers every botocore call in-process.

`--dry-run` runs the SDK's own `train()` under `offline`: the printed CreateTrainingJob request is exactly what
botocore would send (already checked against botocore's service model), with no credentials and no network.

The SDK is an optional extra (requirements-sagemaker.txt; `bash scripts/setup.sh --sagemaker`): it is
imported only when a job is built, and its absence is a one-line error.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
from collections.abc import Iterator

from dilforge_shared.errors import ConfigError, DilforgeError

from .sagemaker_jobs import CHECKPOINT_PATH, TENSORBOARD_PATH, JobSpec, ProcessingSpec

SDK_HINT = "install the SageMaker SDK extra: bash scripts/setup.sh --sagemaker (requirements-sagemaker.txt)"


def require_sdk() -> None:
    """One line, not a traceback, when the optional SDK extra is missing."""
    try:
        import sagemaker.train.model_trainer  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"the SageMaker Python SDK is not installed ({exc.name}): {SDK_HINT}") from None


OFFLINE_SDK_CONFIG = {"SchemaVersion": "1.0", "SageMaker": {"PythonSDK": {"Modules": {"TelemetryOptOut": True}}}}


def sdk_session(boto_session, offline: bool = False):
    """A sagemaker Session on `boto_session`; offline (dry run, local mode): the SDK's telemetry opted out
    through its documented defaults config, so nothing at all leaves the machine."""
    require_sdk()
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
    """The SDK re-validates a session's defaults config against its whole JSON schema on every lookup (~0.3 s,
    dozens per job). Our offline config is a constant, validated here once; the manager then skips re-checks."""
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
    require_sdk()
    from sagemaker.core.training.configs import (
        Channel,
        CheckpointConfig,
        Compute,
        DataSource,
        InputData,
        MetricDefinition,
        Networking,
        OutputDataConfig,
        RetryStrategy,
        S3DataSource,
        StoppingCondition,
        Tag,
        TensorBoardOutputConfig,
    )
    from sagemaker.train.model_trainer import Mode, ModelTrainer

    local = local_root is not None
    if local:
        missing = sorted(set(spec.channels) - set(local_channels or {}))
        if missing:
            raise DilforgeError(f"{spec.stage}: local mode needs a folder for channels {missing}")
        channels = [InputData(channel_name=n, data_source=str(local_channels[n])) for n in sorted(spec.channels)]
    else:
        channels = [
            Channel(
                channel_name=n,
                input_mode=spec.input_mode,
                data_source=DataSource(
                    s3_data_source=S3DataSource(
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
        compute=Compute(
            instance_type="local" if local else spec.instance_type,
            instance_count=spec.num_instances,
            volume_size_in_gb=spec.volume_size_gb,
            enable_managed_spot_training=spec.spot,
        ),
        networking=Networking(**networking),
        stopping_condition=StoppingCondition(**stopping),
        output_data_config=OutputDataConfig(s3_output_path=spec.output_path),
        checkpoint_config=CheckpointConfig(s3_uri=spec.checkpoint_uri, local_path=CHECKPOINT_PATH),
        environment=dict(spec.environment),
        hyperparameters=dict(spec.hyperparameters),
        tags=[Tag(key=k, value=v) for k, v in sorted(spec.tags.items())],
        input_data_config=channels or None,
        **({"local_container_root": str(local_root)} if local else {}),
        **_config_manager(session),
    )
    trainer.with_metric_definitions(
        [MetricDefinition(name=d["Name"], regex=d["Regex"]) for d in spec.metric_definitions]
    )
    trainer.with_tensorboard_output_config(
        TensorBoardOutputConfig(s3_output_path=spec.tensorboard_uri, local_path=TENSORBOARD_PATH)
    )
    if spec.max_retry_attempts:
        trainer.with_retry_strategy(RetryStrategy(maximum_retry_attempts=spec.max_retry_attempts))
    return trainer


def run_processor(spec: ProcessingSpec, session, wait: bool = False) -> None:
    """Submit one Processing job through the SDK's `Processor.run` (the request is the SDK's own)."""
    require_sdk()
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
    inputs = [
        ProcessingInput(
            input_name=name,
            s3_input=ProcessingS3Input(
                s3_uri=uri,
                local_path=path,
                s3_data_type="S3Prefix",
                s3_input_mode="File",
                s3_data_distribution_type="FullyReplicated",
            ),
        )
        for name, (uri, path) in sorted(spec.inputs.items())
    ]
    outputs = [
        ProcessingOutput(
            output_name=name, s3_output=ProcessingS3Output(s3_uri=uri, local_path=path, s3_upload_mode="EndOfJob")
        )
        for name, (path, uri) in sorted(spec.outputs.items())
    ]
    name = f"{spec.base_job_name}-{dt.datetime.now(dt.UTC):%Y%m%d%H%M%S}"  # the phase kept whole (base names are cut)
    processor.run(inputs=inputs, outputs=outputs, wait=wait, logs=False, job_name=name[-63:].lstrip("-"))


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


def _offline_response(operation: str, body: dict) -> dict:
    now = dt.datetime.now(dt.UTC)
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
        "CreationTime": now,
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
