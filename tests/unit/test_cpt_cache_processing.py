"""CPT's token cache as a SageMaker Processing job before the training job (`token_cache_instance_type`): offline
requests checked against botocore's model, and a run against moto's SageMaker and S3."""

from __future__ import annotations

import copy

import botocore.session
import pytest
from botocore.validate import validate_parameters
from dilforge_coordinator.backends.sagemaker import SageMakerBackend, offline_jobs
from dilforge_coordinator.config import PipelineConfig
from factories import clear_aws, fill_what_moto_omits
from pydantic import ValidationError

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/dilforge-{}@sha256:" + "a" * 64
CONFIG = {
    "run_id": "cache",
    "store": {"uri": "s3://bkt/dilforge"},
    "tokenizer": {"corpora": [{"uri": "s3://bkt/az/train.txt"}], "vocab_sizes": [1000]},
    "cpt": {
        "scratch_model": {},
        "phase1": {"num_steps": 1},
        "corpora": [{"uri": "s3://bkt/az/train.txt"}],
        "validation": [{"uri": "s3://bkt/az/dev.txt"}],
    },
    "sagemaker": {
        "region": "us-east-1",
        "role_arn": "arn:aws:iam::123456789012:role/dilforge-sagemaker",
        "images": {s: IMAGE.format(s) for s in ("tokenizer", "cpt")},
        "stages": {
            "cpt": {
                "instance_type": "ml.p4d.24xlarge",
                "num_instances": 2,
                "token_cache_instance_type": "ml.c7i.8xlarge",
            }
        },
    },
}


def _config(token_cache: str | None = "ml.c7i.8xlarge") -> dict:
    cfg = copy.deepcopy(CONFIG)
    cfg["sagemaker"]["stages"]["cpt"]["token_cache_instance_type"] = token_cache
    return cfg


def test_the_cache_job_runs_build_cache_into_the_training_jobs_checkpoint_prefix(monkeypatch, tmp_path):
    clear_aws(monkeypatch, tmp_path)
    requests = SageMakerBackend(dry_run=True).dry_run_requests(PipelineConfig.model_validate(_config()))
    kinds = ["TrainingJobName" in r and "training" or "processing" for r in requests]
    assert kinds == ["training", "processing", "training"]  # tokenizer, then cpt's cache before cpt's training
    cache, train = requests[1], requests[2]
    model = botocore.session.get_session().get_service_model("sagemaker").operation_model("CreateProcessingJob")
    validate_parameters(cache, model.input_shape)
    assert cache["AppSpecification"]["ContainerEntrypoint"] == ["python3", "-m", "dilforge_cpt", "build-cache"]
    assert (
        cache["AppSpecification"]["ImageUri"] == IMAGE.format("cpt") == train["AlgorithmSpecification"]["TrainingImage"]
    )
    assert cache["ProcessingResources"]["ClusterConfig"]["InstanceType"] == "ml.c7i.8xlarge"
    assert cache["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 1
    root = cache["Environment"]["DILFORGE_OPT_ML"]
    (output,) = cache["ProcessingOutputConfig"]["Outputs"]
    assert output["S3Output"]["LocalPath"] == f"{root}/checkpoints/tokens"  # ctx.opt.checkpoint_dir / "tokens"
    assert output["S3Output"]["S3Uri"] == train["CheckpointConfig"]["S3Uri"].rstrip("/") + "/tokens/"
    assert cache["Environment"]["DILFORGE_TOKEN_CACHE_URI"] == output["S3Output"]["S3Uri"]  # a rerun restores it
    assert train["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"  # restored there: the cache is found
    (hp,) = cache["ProcessingInputs"]
    assert hp["S3Input"]["LocalPath"] == f"{root}/input/config" and hp["S3Input"]["S3Uri"].endswith("/config/")


def test_without_the_field_the_training_job_tokenises(monkeypatch, tmp_path):
    clear_aws(monkeypatch, tmp_path)
    requests = SageMakerBackend(dry_run=True).dry_run_requests(PipelineConfig.model_validate(_config(None)))
    assert all("TrainingJobName" in r for r in requests) and len(requests) == 2


def test_only_cpt_has_a_token_cache():
    cfg = _config()
    cfg["sagemaker"]["stages"]["tokenizer"] = {"token_cache_instance_type": "ml.c7i.8xlarge"}
    with pytest.raises(ValidationError, match=r"stages\.tokenizer\.token_cache_instance_type: only the cpt stage"):
        PipelineConfig.model_validate(cfg)


def test_a_run_builds_the_cache_then_submits_the_training_job(monkeypatch, tmp_path):
    import boto3
    import moto

    clear_aws(monkeypatch, tmp_path)
    for key, value in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")  # the SDK's IAM check: moto has no SimulatePrincipalPolicy
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="bkt")
        pipeline = PipelineConfig.model_validate(_config())
        backend = SageMakerBackend(stream_logs=False, out=lambda line: None)
        backend.prepare(pipeline)
        job = offline_jobs(pipeline)[1]
        hyperparameters = []  # the file the cache job reads, while it runs
        real = SageMakerBackend.wait

        def wait(self, stage, name, processing=False):
            if processing:
                key = f"dilforge/sagemaker/processing/cpt/{job.artifact_id}/config/hyperparameters.json"
                hyperparameters.append(boto3.client("s3").get_object(Bucket="bkt", Key=key)["Body"].read())
            return real(self, stage, name, processing)

        monkeypatch.setattr(SageMakerBackend, "wait", wait)
        fill_what_moto_omits(backend)
        backend.run(job)
        cache, train = backend.requests  # in this order: the cache job was waited for before training began
        assert "-token-cache-" in cache["ProcessingJobName"] and "TrainingJobName" in train
        assert '"artifact_uri"' in hyperparameters[0].decode()
        prefix = "dilforge/sagemaker/processing/cpt/"  # removed once the cache job is done
        assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket="bkt", Prefix=prefix)
