"""The SageMaker backend's CreateTrainingJob requests: the published preset, offline, checked field by field
and against botocore's own model of the API."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import botocore.session
import pytest
from botocore.validate import validate_parameters
from dilforge_coordinator.backends.sagemaker import METRIC_DEFINITIONS, SageMakerBackend, offline_jobs
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import load_pipeline
from dilforge_shared.errors import ConfigError
from factories import clear_aws
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "sagemaker-published.yaml"


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """No credentials anywhere: a dry run must not need them."""
    clear_aws(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> dict[str, dict]:
    """The preset's requests, built once (the SDK takes seconds per dry run)."""
    with pytest.MonkeyPatch.context() as mp:
        clear_aws(mp, tmp_path_factory.mktemp("no-aws"))
        cfg = load_pipeline(PRESET)
        return {_stage(r): r for r in SageMakerBackend(dry_run=True).dry_run_requests(cfg) if "TrainingJobName" in r}


def test_the_preset_tokenises_once_per_job_before_its_gpu_hosts_start(no_aws):
    """Two CPT hosts with their own checkpoint folders would each tokenise the whole corpus; the published preset
    builds the token cache once, in a Processing job on a CPU instance, before the training job."""
    requests = SageMakerBackend(dry_run=True).dry_run_requests(load_pipeline(PRESET), "cpt")
    assert ["TrainingJobName" in r for r in requests] == [False, True]
    cache, train = requests
    assert cache["AppSpecification"]["ContainerEntrypoint"][-1] == "build-cache"
    assert cache["ProcessingResources"]["ClusterConfig"]["InstanceType"].startswith("ml.c")
    assert train["ResourceConfig"]["InstanceCount"] == 2


def _stage(request: dict) -> str:
    return {t["Key"]: t["Value"] for t in request["Tags"]}["dilforge:stage"]


def test_preset_machines_match_the_published_setup(requests):
    assert list(requests) == ["tokenizer", "cpt", "sft", "eval"]
    assert requests["cpt"]["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert requests["cpt"]["ResourceConfig"]["InstanceCount"] == 2
    assert requests["sft"]["ResourceConfig"]["InstanceType"] == "ml.g5.8xlarge"
    assert requests["sft"]["ResourceConfig"]["InstanceCount"] == 1


def test_requests_are_valid_for_botocore(requests):
    model = botocore.session.get_session().get_service_model("sagemaker").operation_model("CreateTrainingJob")
    for request in requests.values():
        validate_parameters(request, model.input_shape)  # raises ParamValidationError on any wrong field
        assert re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}", request["TrainingJobName"])
        for d in request["AlgorithmSpecification"]["MetricDefinitions"]:
            assert len(d["Regex"]) <= 500 and re.compile(d["Regex"]).groups == 1


def test_channels_are_the_upstream_artifacts(requests):
    art = {stage: json.loads(json.dumps(r["HyperParameters"]))["artifact_uri"] for stage, r in requests.items()}
    channels = {
        stage: {c["ChannelName"]: c["DataSource"]["S3DataSource"] for c in r.get("InputDataConfig", [])}
        for stage, r in requests.items()
    }
    assert channels["tokenizer"] == {}
    assert channels["cpt"]["tokenizer"]["S3Uri"] == art["tokenizer"] + "/"
    assert channels["sft"]["cpt"]["S3Uri"] == art["cpt"] + "/"
    assert set(channels["eval"]) == {"tokenizer", "cpt", "sft"}
    for ch in channels["eval"].values():
        assert ch["S3DataType"] == "S3Prefix" and ch["S3Uri"].endswith("/")
    # the stage gets the same URIs as manifest inputs, so ctx.input() finds the mounted channel
    assert json.loads(requests["eval"]["HyperParameters"]["inputs"]) == {k: art[k] for k in ("tokenizer", "cpt", "sft")}


def test_output_checkpoint_tensorboard_spot_runtime(requests):
    machines = load_pipeline(PRESET).sagemaker
    for stage, r in requests.items():
        assert r["OutputDataConfig"]["S3OutputPath"].endswith("/")
        assert r["CheckpointConfig"]["S3Uri"].endswith("/") and stage in r["CheckpointConfig"]["S3Uri"]
        assert r["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
        assert r["TensorBoardOutputConfig"]["S3OutputPath"].endswith("/")
        assert r["TensorBoardOutputConfig"]["LocalPath"] == "/opt/ml/output/tensorboard"
        stop = r["StoppingCondition"]
        assert stop["MaxRuntimeInSeconds"] == machines.resources(stage).max_runtime_s
        if r["EnableManagedSpotTraining"]:
            assert stop["MaxWaitTimeInSeconds"] >= stop["MaxRuntimeInSeconds"]
        else:
            assert "MaxWaitTimeInSeconds" not in stop
    assert requests["cpt"]["StoppingCondition"] == {"MaxRuntimeInSeconds": 172800, "MaxWaitTimeInSeconds": 345600}
    assert requests["eval"]["EnableManagedSpotTraining"] is False
    assert requests["cpt"]["Environment"]["NCCL_DEBUG"] == "WARN"


def test_hyperparameters_are_short_strings_with_a_config_uri(requests):
    for stage, r in requests.items():
        hp = r["HyperParameters"]
        assert all(isinstance(v, str) and len(v) <= 2500 for v in hp.values())
        assert "stage_config" not in hp and hp["stage_config_uri"].endswith(
            f"/configs/{stage}/{hp['artifact_uri'].rsplit('/', 1)[1]}.json"
        )
        assert r["Environment"]["DILFORGE_IMAGE"] == r["AlgorithmSpecification"]["TrainingImage"]


def test_image_by_recorded_digest(no_aws, tmp_path):
    digest = "sha256:" + "ab" * 32
    image = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/dilforge-cpt@{digest}"
    (tmp_path / "images.json").write_text(json.dumps({"cpt-gpu": {"push": {"image": image}}}))
    reqs = SageMakerBackend(dry_run=True).dry_run_requests(load_pipeline(PRESET))
    images = [r.get("AlgorithmSpecification", r.get("AppSpecification", {})) for r in reqs if _stage(r) == "cpt"]
    assert [i.get("TrainingImage") or i.get("ImageUri") for i in images] == [image, image]  # token cache, training


def test_single_host_stages_refuse_several_instances(no_aws, tmp_path):
    text = PRESET.read_text().replace(
        "      instance_type: ml.g5.8xlarge\n", "      instance_type: ml.g5.8xlarge\n      num_instances: 2\n"
    )
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="sft runs on one host"):
        SageMakerBackend(dry_run=True).dry_run_requests(load_pipeline(path))


def test_local_data_or_model_paths_are_refused_before_submitting(no_aws, tmp_path):
    text = PRESET.read_text().replace(
        "  base_model: s3://dilforge-data-123456789012/models/llama-3.2-1b/", f"  base_model: {tmp_path}/llama"
    )
    assert text != PRESET.read_text()
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"cpt: \['{tmp_path}/llama'\] are local paths"):
        SageMakerBackend(dry_run=True).dry_run_requests(load_pipeline(path))


def test_dry_run_cli_prints_every_request_offline(no_aws):
    result = CliRunner().invoke(app, ["run-all", "-c", str(PRESET), "--backend", "sagemaker", "--dry-run"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert [_stage(r) for r in printed] == ["tokenizer", "cpt", "cpt", "sft", "eval"]  # cpt: token cache, training
    one = CliRunner().invoke(app, ["run", "sft", "-c", str(PRESET), "--backend", "sagemaker", "--dry-run"])
    assert one.exit_code == 0, one.output
    assert [_stage(r) for r in json.loads(one.stdout)] == ["sft"]


def test_offline_ids_are_deterministic_and_chain(no_aws):
    a, b = offline_jobs(load_pipeline(PRESET)), offline_jobs(load_pipeline(PRESET))
    assert [j.artifact_uri for j in a] == [j.artifact_uri for j in b]
    assert a[1].inputs == {"tokenizer": a[0].artifact_uri}


# Lines as the stages print them (cpt: Metrics.record; sft: transformers' PrinterCallback + stage.py;
# eval: stage.py's bpb line; tokenizer: the sweep line).
LOG_LINES = {
    "cpt": (
        (
            "2026-01-01 10:00:00,000 INFO dilforge.cpt: step=20 phase=2 loss=2.31456 lr=0.0003 grad_norm=0.912 "
            "tokens_per_s=10234.5 tokens_per_s_per_device=1279.3 mfu=0.412 peak_memory_gb=30.1"
        ),
        "2026-01-01 10:00:01,000 INFO dilforge.cpt: step=20 val_loss=2.4 val_bpb=1.125",
    ),
    "sft": (
        "{'loss': '1.873', 'grad_norm': '0.5312', 'learning_rate': '9.5e-05', 'epoch': '0.25'}",
        "2026-01-01 10:00:00,000 INFO dilforge.sft: validation loss after: 1.2345 (before 1.5000)",
    ),
    "eval": (
        "2026-01-01 10:00:00,000 INFO dilforge.eval: bpb sft / flores-dev: 1.0432 (1000 tokens, 4000 bytes, 9 bytes/s)",
    ),
    "tokenizer": ("2026-01-01 10:00:00,000 INFO dilforge.tokenizer: sweep (selected 32000):",),
}
EXPECTED = {
    "cpt": {
        "train:loss": "2.31456",
        "train:lr": "0.0003",
        "train:grad_norm": "0.912",
        "train:tokens_per_s": "10234.5",
        "train:mfu": "0.412",
        "validation:loss": "2.4",
        "validation:bpb": "1.125",
    },
    "sft": {"train:loss": "1.873", "train:grad_norm": "0.5312", "train:lr": "9.5e-05", "validation:loss": "1.2345"},
    "eval": {"eval:bpb": "1.0432"},
    "tokenizer": {"tokenizer:selected_vocab_size": "32000"},
}


@pytest.mark.parametrize("stage", list(EXPECTED))
def test_metric_definitions_match_the_stage_log_lines(stage):
    found = {}
    for d in METRIC_DEFINITIONS[stage]:
        for line in LOG_LINES[stage]:
            if m := re.search(d["Regex"], line):
                found.setdefault(d["Name"], m.group(1))
    assert found == EXPECTED[stage]
    # a validation line is not a training loss
    if stage == "cpt":
        assert not re.search(METRIC_DEFINITIONS["cpt"][0]["Regex"], LOG_LINES["cpt"][1])


def test_model_stage_runs_the_importer_in_the_cpt_image(no_aws, tmp_path):
    """The model stage has no image of its own: the cpt image's entrypoint runs dilforge_cpt.import_model."""
    digest = "sha256:" + "cd" * 32
    image = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/dilforge-cpt@{digest}"
    (tmp_path / "images.json").write_text(json.dumps({"cpt-gpu": {"push": {"image": image}}}))
    cfg = load_pipeline(
        PRESET, {"model": {"source": "smollm2-135m-instruct"}, "cpt.base_model": None, "tokenizer.base_tokenizer": None}
    )
    reqs = {_stage(r): r for r in SageMakerBackend(dry_run=True).dry_run_requests(cfg)}
    model = reqs["model"]
    assert model["AlgorithmSpecification"]["TrainingImage"] == image
    assert model["Environment"]["DILFORGE_STAGE_MODULE"] == "dilforge_cpt.import_model"
    assert "DILFORGE_STAGE_MODULE" not in reqs["cpt"]["Environment"]
    assert [c["ChannelName"] for c in reqs["cpt"]["InputDataConfig"]] == ["model", "tokenizer"]


def test_model_stage_with_a_local_folder_is_refused_before_submitting(no_aws, tmp_path):
    cfg = load_pipeline(
        PRESET, {"model": {"source": "/home/me/llama"}, "cpt.base_model": None, "tokenizer.base_tokenizer": None}
    )
    with pytest.raises(ConfigError, match=r"model: \['/home/me/llama'\] are local paths"):
        SageMakerBackend(dry_run=True).dry_run_requests(cfg)


def test_without_the_sdk_extra_the_backend_fails_in_one_line(no_aws, monkeypatch):
    monkeypatch.setitem(sys.modules, "sagemaker.train.model_trainer", None)
    result = CliRunner().invoke(app, ["run-all", "-c", str(PRESET), "--backend", "sagemaker", "--dry-run"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "SageMaker Python SDK is not installed" in lines[0] and "--sagemaker" in lines[0]


def test_dry_run_sends_nothing_and_needs_no_credentials(no_aws):
    """The offline session has no credential provider: had any call escaped the in-process answers, signing it
    would have raised NoCredentialsError; and an unexpected operation is refused outright."""
    from dilforge_coordinator.backends.sagemaker import offline, offline_boto_session
    from dilforge_shared.errors import DilforgeError

    session = offline_boto_session("us-east-1")
    assert session.get_credentials() is None
    with offline(session) as requests, pytest.raises(DilforgeError, match="unexpected AWS call s3:ListBuckets"):
        session.client("s3").list_buckets()
    assert requests == []
