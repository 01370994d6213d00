"""The curate stage on SageMaker: one Processing job per datatrove phase on several instances, then a publishing
job; offline requests checked against botocore's model, and a run against moto's SageMaker and S3."""

from __future__ import annotations

import contextlib
import json
import os
import re

import botocore.session
import pytest
from botocore.validate import validate_parameters
from dilforge_coordinator.backends.sagemaker import SageMakerBackend, offline_jobs
from dilforge_coordinator.config import PipelineConfig
from factories import clear_aws, fill_what_moto_omits

CONFIG = {
    "run_id": "web",
    "store": {"uri": "s3://bkt/dilforge"},
    "curate": {"corpora": [{"uri": "s3://bkt/raw/web/", "format": "jsonl", "name": "web"}]},
    "sagemaker": {
        "region": "us-east-1",
        "role_arn": "arn:aws:iam::123456789012:role/dilforge-sagemaker",
        "images": {"curate": "123456789012.dkr.ecr.us-east-1.amazonaws.com/dilforge-curate@sha256:" + "a" * 64},
        "stages": {"curate": {"instance_type": "ml.m5.4xlarge", "num_instances": 3}},
    },
}


@pytest.fixture
def requests(monkeypatch, tmp_path):
    clear_aws(monkeypatch, tmp_path)
    return SageMakerBackend(dry_run=True).dry_run_requests(PipelineConfig.model_validate(CONFIG))


def test_one_processing_job_per_phase_on_every_instance_then_one_publishes(requests):
    model = botocore.session.get_session().get_service_model("sagemaker").operation_model("CreateProcessingJob")
    for request in requests:
        validate_parameters(request, model.input_shape)
        assert re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", request["ProcessingJobName"])
    phases = [r["AppSpecification"]["ContainerEntrypoint"][4] for r in requests]
    assert phases == ["filter", "buckets", "cluster", "write", "publish"]
    counts = [r["ProcessingResources"]["ClusterConfig"]["InstanceCount"] for r in requests]
    assert counts == [3, 3, 1, 3, 1]
    inputs = [{i["InputName"]: i["S3Input"] for i in r["ProcessingInputs"]} for r in requests]
    work = inputs[1]["work"]["S3Uri"]
    hp = inputs[0]["hyperparameters"]["S3Uri"]
    assert not work.startswith(hp) and all(i["hyperparameters"]["S3Uri"] == hp for i in inputs)
    assert "work" not in inputs[0] and all(i["work"]["S3Uri"] == work for i in inputs[1:])
    assert all(i["work"]["S3DataDistributionType"] == "FullyReplicated" for i in inputs[1:])
    outputs = [
        [o["S3Output"]["S3Uri"] for o in r.get("ProcessingOutputConfig", {}).get("Outputs", [])] for r in requests
    ]
    assert outputs == [[work]] * 4 + [[]]  # every host's outputs under one prefix; the publisher writes the store
    assert all(r["Environment"]["DILFORGE_OPT_ML"] == "/opt/ml/processing/dilforge" for r in requests)
    assert not any("--shared-write" in r["AppSpecification"]["ContainerEntrypoint"] for r in requests)


def test_local_mode_hosts_of_a_phase_wait_for_each_other(tmp_path):
    """Local mode mounts one output folder into every host and stops them all when the first exits: a phase on
    several hosts gets --shared-write (each host waits for the others' tasks); SageMaker itself waits, so its
    requests above never carry it."""
    from dilforge_coordinator.backends.sagemaker import processing_specs
    from dilforge_coordinator.backends.sagemaker_local import local_processing_spec

    pipeline = PipelineConfig.model_validate(CONFIG)
    specs = processing_specs(offline_jobs(pipeline)[0], pipeline.sagemaker, "dilforge-curate:dev")
    local = [local_processing_spec(spec, tmp_path, {"DILFORGE_S3_ENDPOINT_URL": "http://s3:8333"}) for spec in specs]
    waits = {spec.phase: "--shared-write" in spec.entrypoint for spec in local}
    assert waits == {"filter": True, "buckets": True, "cluster": False, "write": True, "publish": False}
    assert all(spec.outputs["work"][1] == f"file://{tmp_path}" for spec in local if spec.outputs)
    assert all(spec.environment["DILFORGE_S3_ENDPOINT_URL"] == "http://s3:8333" for spec in local)


@pytest.mark.parametrize("others_done", [True, False])
def test_local_mode_stop_of_a_waiting_host_is_a_failure_only_while_tasks_are_unfinished(tmp_path, others_done):
    """The first host to exit makes local mode SIGTERM the others: a host waiting for the others' tasks exits 0 when
    every task is marked, and stops (a failure) when one is not."""
    import signal
    import threading

    from dilforge_curate.config import CurateConfig
    from dilforge_curate.stage import Stopped, _stop, num_tasks, wait_for_other_hosts

    config = CurateConfig.model_validate({"corpora": [{"uri": "s3://bkt/raw/web/", "name": "web"}]})
    marks = tmp_path / "logs" / "write" / "completions"
    marks.mkdir(parents=True)
    for rank in range(num_tasks(config, "write") - 1):  # this host's tasks and all but one of the others'
        (marks / f"{rank:05d}").touch()

    def last_host_exits():
        if others_done:
            (marks / f"{num_tasks(config, 'write') - 1:05d}").touch()
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, _stop)
    timer = threading.Timer(0.2, last_host_exits)
    try:
        timer.start()
        with contextlib.nullcontext() if others_done else pytest.raises(Stopped):
            wait_for_other_hosts(tmp_path, config, "write")
    finally:
        timer.join()
        signal.signal(signal.SIGTERM, previous)


def test_a_run_uploads_the_hyperparameters_and_submits_the_phases_in_order(monkeypatch, tmp_path):
    import boto3
    import moto

    clear_aws(monkeypatch, tmp_path)
    for key, value in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="bkt")
        pipeline = PipelineConfig.model_validate(CONFIG)
        backend = SageMakerBackend(stream_logs=False, out=lambda line: None)
        backend.prepare(pipeline)
        job = offline_jobs(pipeline)[0]
        uploaded = []  # the hyperparameters file the jobs read, as uploaded
        real = SageMakerBackend.wait
        monkeypatch.setattr(
            SageMakerBackend,
            "wait",
            lambda self, stage, name, processing: uploaded.append(_hp(job)) or real(self, stage, name, processing),
        )
        fill_what_moto_omits(backend)
        backend.run(job)
        names = [r["ProcessingJobName"] for r in backend.requests]
        assert [n.rsplit("-", 1)[0].rsplit("-", 1)[1] for n in names] == [
            "filter", "buckets", "cluster", "write", "publish",
        ]  # fmt: skip
        hp = json.loads(uploaded[0])
        assert hp["artifact_uri"] == job.artifact_uri and hp["stage_config_uri"].startswith("s3://bkt/")
        prefix = "dilforge/sagemaker/processing/curate/"  # intermediates removed once the artifact is published
        assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket="bkt", Prefix=prefix)


def _hp(job) -> bytes:
    import boto3

    key = f"dilforge/sagemaker/processing/curate/{job.artifact_id}/config/hyperparameters.json"
    return boto3.client("s3").get_object(Bucket="bkt", Key=key)["Body"].read()
