"""Real-run behaviour of the SageMaker backend: the SDK's waiter, failure reasons and log streaming (answered at
botocore), job submission and manifest hand-off between stages (moto's SageMaker and S3)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import boto3
import pytest
from dilforge_coordinator.backends.sagemaker import SageMakerBackend
from dilforge_coordinator.cloud import SageMakerConfig
from dilforge_coordinator.config import PipelineConfig
from dilforge_coordinator.pipeline import StageFailed, run_all
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import publish, read_manifest

ROLE = "arn:aws:iam::123456789012:role/dilforge-sagemaker"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
LOG_GROUP = "/aws/sagemaker/TrainingJobs"


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("DILFORGE_S3_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("DILFORGE_IMAGES_RECORD", str(tmp_path / "images.json"))
    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")  # the SDK's IAM check: moto has no SimulatePrincipalPolicy


def _describe(status: str, secondary: str, transitions: list[tuple[str, str]], reason: str | None = None) -> dict:
    resp = {
        "TrainingJobName": "job",
        "TrainingJobArn": "arn:aws:sagemaker:us-east-1:123456789012:training-job/job",
        "ModelArtifacts": {"S3ModelArtifacts": "s3://b/out/model.tar.gz"},
        "TrainingJobStatus": status,
        "SecondaryStatus": secondary,
        "AlgorithmSpecification": {"TrainingInputMode": "File"},
        "ResourceConfig": {"InstanceType": "ml.g5.8xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
        "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
        "CreationTime": NOW,
        "SecondaryStatusTransitions": [{"Status": s, "StartTime": NOW, "StatusMessage": m} for s, m in transitions],
    }
    if reason:
        resp["FailureReason"] = reason
    return resp


def _answered(replies: dict[str, list[dict]]):
    """A boto3 session whose SageMaker and CloudWatch Logs calls are answered in order from `replies`
    (operation -> responses), at botocore, under the SDK; nothing is sent. Also returns the calls it saw."""
    from botocore.awsrequest import AWSResponse

    session = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1")
    calls: list[tuple[str, dict]] = []

    def answer(model, params, **kwargs):
        calls.append((model.name, json.loads(params.get("body") or b"{}")))
        return AWSResponse("https://stub.invalid", 200, {}, None), replies[model.name].pop(0)

    session.events.register("before-call.sagemaker", answer)
    session.events.register("before-call.cloudwatch-logs", answer)
    return session, calls


def _backend(session, out: list[str], stream_logs: bool = False) -> SageMakerBackend:
    return SageMakerBackend(
        config=SageMakerConfig(role_arn=ROLE, poll_interval_s=7),
        boto_session=session,
        stream_logs=stream_logs,
        out=out.append,
    )


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The SDK waiter's pauses, recorded instead of slept."""
    import sagemaker.core.resources

    slept: list[float] = []
    monkeypatch.setattr(sagemaker.core.resources.time, "sleep", slept.append)
    return slept


def test_wait_polls_the_job_until_completed(sleeps):
    statuses = ["InProgress", "InProgress", "InProgress", "Completed"]  # get, then one describe per poll
    replies = [_describe(s, s, []) for s in statuses]
    replies[-1]["BillableTimeInSeconds"] = 1234
    session, calls = _answered({"DescribeTrainingJob": replies})
    out: list[str] = []
    _backend(session, out).wait("sft", "job")
    assert replies == [] and [c[1] for c in calls] == [{"TrainingJobName": "job"}] * 4
    assert sleeps == [7, 7]  # the config's poll interval, between polls
    assert out == ["[sft] job: Completed (1234 billable seconds)"]


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_a_job_that_does_not_complete_raises_with_its_failure_reason(sleeps, status):
    reason = "AlgorithmError: sft: train[0] /opt/ml/input/data/x.jsonl line 3:\nfield 'messages' missing"
    ended = _describe(status, status, [], reason)
    session, _ = _answered({"DescribeTrainingJob": [_describe("InProgress", "Training", []), ended]})
    with pytest.raises(StageFailed) as err:
        _backend(session, []).wait("sft", "job")
    assert err.value.stage == "sft"
    assert err.value.reason == f"SageMaker job job {status}: " + " ".join(reason.split())  # one line


def test_the_sdk_streams_each_log_event_once(sleeps, caplog):
    stream = "job/algo-1-1700000000"
    streams = {"logStreams": [{"logStreamName": stream}]}
    session, calls = _answered(
        {
            "DescribeTrainingJob": [_describe(s, s, []) for s in ("InProgress", "InProgress", "Completed")],
            "DescribeLogStreams": [streams],
            "GetLogEvents": [
                {
                    "events": [
                        {"timestamp": 1, "message": "step=1 phase=1 loss=3.0"},
                        {"timestamp": 2, "message": "step=2 phase=1 loss=2.9"},
                    ],
                    "nextForwardToken": "f/1",
                },
                {"events": [], "nextForwardToken": "f/1"},
                {"events": [{"timestamp": 3, "message": "published"}], "nextForwardToken": "f/2"},
                {"events": [], "nextForwardToken": "f/2"},
            ],
        }
    )
    with caplog.at_level("INFO", logger="sagemaker.core.resources"):
        _backend(session, [], stream_logs=True).wait("cpt", "job")
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith(stream)]
    assert printed == [f"{stream}:\n{m}" for m in ("step=1 phase=1 loss=3.0", "step=2 phase=1 loss=2.9", "published")]
    assert (
        "DescribeLogStreams",
        {"logGroupName": LOG_GROUP, "logStreamNamePrefix": "job/", "orderBy": "LogStreamName"},
    ) in calls


def test_logs_are_read_with_the_run_session(monkeypatch):
    """The SDK's log handlers share one process-wide client, made from the default session: the run's replaces it."""
    from dilforge_coordinator.backends.sagemaker import read_logs_with
    from sagemaker.core.utils.logs import CloudWatchLogsClient, LogStreamHandler

    default = boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1").client("logs")
    monkeypatch.setattr(CloudWatchLogsClient, "client", default)
    monkeypatch.setattr(CloudWatchLogsClient(), "client", default)  # the singleton, made before with its own
    read_logs_with(boto3.Session(aws_access_key_id="x", aws_secret_access_key="x", region_name="eu-west-1"))
    assert LogStreamHandler(LOG_GROUP, "job/algo-1", 0).cw_client.meta.region_name == "eu-west-1"


# ---- moto: submit for real (to moto), hand the published manifest to the next stage -------------------


def _fake_job_publishes(backend: SageMakerBackend, s3, submitted: list[dict]):
    """Stand in for the container: when the SDK creates a job (through moto), publish the artifact its
    hyperparameters name. Hooked at botocore, under the SDK, on the session the backend submits with."""

    def create(params, model, **kwargs):
        request = params
        submitted.append(request)
        hp = request["HyperParameters"]
        config = json.loads(s3.get_object(**_split(hp["stage_config_uri"]))["Body"].read())
        stage = {t["Key"]: t["Value"] for t in request["Tags"]}["dilforge:stage"]
        out = Path(backend.tmp) / f"{stage}-{len(submitted)}"
        out.mkdir(parents=True)
        (out / "weights.txt").write_text(f"{stage} trained with inputs {hp['inputs']}")
        from dilforge_coordinator.config import STAGE_CONFIGS
        from dilforge_coordinator.pipeline import stage_refs
        from dilforge_shared.identity import code_version

        refs = stage_refs(
            STAGE_CONFIGS[stage].model_validate(config), json.loads(hp["inputs"]), hp.get("s3_endpoint_url")
        )
        manifest = Manifest(
            kind={"tokenizer": "tokenizer", "cpt": "model"}[stage],
            artifact_id=hp["artifact_uri"].rsplit("/", 1)[1],
            run_id=hp["run_id"],
            stage=stage,
            code_version=code_version(stage),
            producer=current_producer("dilforge-coordinator"),
            config=config,
            inputs=refs,
            data_dir="pending",
            files=[],
        )
        publish(hp["artifact_uri"], out, manifest)

    backend.session().events.register("before-parameter-build.sagemaker.CreateTrainingJob", create)


def _split(uri: str) -> dict:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return {"Bucket": bucket, "Key": key}


def test_run_all_submits_jobs_and_chains_manifests(aws_env, tmp_path):
    import moto

    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="store")
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="az/train.txt", Body="Salam dünya.\nBakı gözəl şəhərdir.\n".encode())
        s3.put_object(Bucket="data", Key="az/dev.txt", Body="Azərbaycan dili.\n".encode())
        image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/dilforge-{}@sha256:" + "0" * 64
        pipeline = PipelineConfig.model_validate(
            {
                "run_id": "moto-run",
                "store": {"uri": "s3://store/dilforge"},
                "sagemaker": {
                    "role_arn": ROLE,
                    "poll_interval_s": 0.01,
                    "images": {s: image.format(s) for s in ("tokenizer", "cpt")},
                    "stages": {"cpt": {"instance_type": "ml.p4d.24xlarge", "num_instances": 2}},
                },
                "tokenizer": {"corpora": [{"uri": "s3://data/az/train.txt"}], "vocab_sizes": [1000]},
                "cpt": {
                    "scratch_model": {},
                    "phase1": {"num_steps": 1},
                    "corpora": [{"uri": "s3://data/az/train.txt"}],
                    "validation": [{"uri": "s3://data/az/dev.txt"}],
                },
            }
        )
        out: list[str] = []
        backend = SageMakerBackend(stream_logs=False, out=out.append)
        backend.tmp = tmp_path
        pipeline = backend.prepare(pipeline)
        submitted: list[dict] = []
        _fake_job_publishes(backend, s3, submitted)
        produced = run_all(pipeline, backend)

        assert [r["TrainingJobName"].split("-")[1] for r in submitted] == ["tokenizer", "cpt"]
        tok_uri = produced["tokenizer"]
        cpt_req = submitted[1]
        assert cpt_req["InputDataConfig"][0]["ChannelName"] == "tokenizer"
        assert cpt_req["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == tok_uri + "/"
        assert json.loads(cpt_req["HyperParameters"]["inputs"]) == {"tokenizer": tok_uri}
        assert cpt_req["ResourceConfig"]["InstanceCount"] == 2
        assert cpt_req["AlgorithmSpecification"]["TrainingImage"] == image.format("cpt")
        manifest, _ = read_manifest(produced["cpt"])
        assert manifest.stage == "cpt" and manifest.run_id == "moto-run"
        described = (
            backend.session().client("sagemaker").describe_training_job(TrainingJobName=cpt_req["TrainingJobName"])
        )
        assert described["RoleArn"] == ROLE
        assert any("submitted training job" in line for line in out)

        # same config and inputs again: both artifacts reused, nothing submitted
        first = list(submitted)
        submitted.clear()
        assert run_all(pipeline, backend) == produced
        assert submitted == []

        # the SDK names each job <prefix>-<stage>-<artifact id>-<timestamp>; a job of the artifact still running
        # is attached to instead of submitting a second one
        job = cpt_req["TrainingJobName"]
        assert re.fullmatch(r"dilforge-cpt-[0-9a-f]+-[0-9]{14}", job) and len(job) <= 63
        assert backend.running_job(_job_of(pipeline, produced)) is None  # moto's jobs complete at once
        assert backend.requests == first  # what botocore was handed, recorded once per job


def _job_of(pipeline, produced):
    from dilforge_coordinator.pipeline import plan_stage

    return plan_stage(pipeline, "cpt", produced)
