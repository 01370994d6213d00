"""Real-run behaviour of the SageMaker backend: status transitions and failure reasons (botocore Stubber),
job submission and manifest hand-off between stages (moto's SageMaker and S3)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from dilforge_coordinator.backends.sagemaker import LOG_GROUP, SageMakerBackend
from dilforge_coordinator.pipeline import StageFailed, run_all
from dilforge_shared.configs import PipelineConfig
from dilforge_shared.configs.cloud import SageMakerConfig
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import publish, read_manifest

ROLE = "arn:aws:iam::123456789012:role/dilforge-sagemaker"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


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


def _backend(sm, out: list[str], stream_logs: bool = False, logs=None) -> SageMakerBackend:
    sleeps: list[float] = []
    backend = SageMakerBackend(
        config=SageMakerConfig(role_arn=ROLE, poll_interval_s=7),
        clients={"sagemaker": sm, **({"logs": logs} if logs else {})},
        stream_logs=stream_logs,
        out=out.append,
        sleep=sleeps.append,
    )
    backend.sleeps = sleeps
    return backend


def test_wait_follows_status_transitions_until_completed():
    sm = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    steps = [
        _describe("InProgress", "Starting", [("Starting", "Preparing the instances for training")]),
        _describe(
            "InProgress",
            "Training",
            [
                ("Starting", "Preparing the instances for training"),
                ("Downloading", "Downloading input data"),
                ("Training", "Training image download completed."),
            ],
        ),
        _describe(
            "Completed",
            "Completed",
            [
                ("Starting", ""),
                ("Downloading", ""),
                ("Training", ""),
                ("Uploading", "Uploading generated training model"),
                ("Completed", "Training job completed"),
            ],
        ),
    ]
    out: list[str] = []
    with Stubber(sm) as stub:
        for resp in steps:
            stub.add_response("describe_training_job", resp, {"TrainingJobName": "job"})
        backend = _backend(sm, out)
        desc = backend.wait("sft", "job")
        stub.assert_no_pending_responses()
    assert desc["TrainingJobStatus"] == "Completed"
    assert backend.sleeps == [7, 7]
    printed = "\n".join(out)
    for status in ("Starting", "Downloading", "Training", "Uploading", "Completed"):
        assert f"job: {status}" in printed
    assert printed.count("job: Starting") == 1  # each transition printed once


def test_failed_job_raises_with_its_failure_reason():
    sm = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    reason = "AlgorithmError: sft: train[0] /opt/ml/input/data/x.jsonl line 3: field 'messages' missing"
    with Stubber(sm) as stub:
        stub.add_response(
            "describe_training_job", _describe("InProgress", "Training", [("Training", "")]), {"TrainingJobName": "job"}
        )
        stub.add_response(
            "describe_training_job",
            _describe("Failed", "Failed", [("Failed", reason)], reason),
            {"TrainingJobName": "job"},
        )
        with pytest.raises(StageFailed) as err:
            _backend(sm, []).wait("sft", "job")
    assert err.value.stage == "sft" and "line 3: field 'messages' missing" in err.value.reason


def test_logs_are_streamed_once_per_event():
    sm = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    logs = boto3.client("logs", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stream = "job/algo-1-1700000000"
    out: list[str] = []
    with Stubber(sm) as s1, Stubber(logs) as s2:
        s1.add_response("describe_training_job", _describe("InProgress", "Training", []), {"TrainingJobName": "job"})
        s1.add_response("describe_training_job", _describe("Completed", "Completed", []), {"TrainingJobName": "job"})
        streams = {"logStreams": [{"logStreamName": stream}]}
        q = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": "job/", "orderBy": "LogStreamName"}
        ev = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
        # poll 1 (in progress): two lines, then nothing new
        s2.add_response("describe_log_streams", streams, q)
        s2.add_response(
            "get_log_events",
            {
                "events": [
                    {"timestamp": 1, "message": "step=1 phase=1 loss=3.0"},
                    {"timestamp": 2, "message": "step=2 phase=1 loss=2.9"},
                ],
                "nextForwardToken": "f/1",
            },
            ev,
        )
        s2.add_response("get_log_events", {"events": [], "nextForwardToken": "f/1"}, {**ev, "nextToken": "f/1"})
        # poll 2 (completed) and the final drain: one more line, then nothing
        s2.add_response("describe_log_streams", streams, q)
        s2.add_response(
            "get_log_events",
            {"events": [{"timestamp": 3, "message": "published"}], "nextForwardToken": "f/2"},
            {**ev, "nextToken": "f/1"},
        )
        s2.add_response("get_log_events", {"events": [], "nextForwardToken": "f/2"}, {**ev, "nextToken": "f/2"})
        s2.add_response("describe_log_streams", streams, q)
        s2.add_response("get_log_events", {"events": [], "nextForwardToken": "f/2"}, {**ev, "nextToken": "f/2"})
        _backend(sm, out, stream_logs=True, logs=logs).wait("cpt", "job")
        s2.assert_no_pending_responses()
    lines = [line for line in out if "|" in line]
    assert lines == ["  algo-1| step=1 phase=1 loss=3.0", "  algo-1| step=2 phase=1 loss=2.9", "  algo-1| published"]


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
        from dilforge_shared.configs import STAGE_CONFIGS
        from dilforge_shared.identity import stage_refs
        from dilforge_shared.stages import code_version

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
        backend = SageMakerBackend(stream_logs=False, out=out.append, sleep=lambda s: None)
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
        described = backend.clients["sagemaker"].describe_training_job(TrainingJobName=cpt_req["TrainingJobName"])
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
