"""`coordinator deploy`: the endpoint requests, offline and checked against botocore's own model of the API;
create, update, no-op and delete against moto's SageMaker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import botocore.session
import pytest
from botocore.validate import validate_parameters
from dilforge_coordinator import deploy
from dilforge_coordinator.cli import app
from dilforge_shared.configs import load_pipeline
from dilforge_shared.errors import ConfigError
from factories import clear_aws
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "configs" / "sagemaker-published.yaml"
NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
DIGEST = "123456789012.dkr.ecr.us-east-1.amazonaws.com/dilforge-serve@sha256:" + "ab" * 32


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    return clear_aws(monkeypatch, tmp_path)


def operation(name: str):
    return botocore.session.get_session().get_service_model("sagemaker").operation_model(name)


def test_dry_run_prints_every_request_and_each_is_valid_for_botocore(no_aws):
    res = CliRunner().invoke(app, ["deploy", "-c", str(PRESET), "--dry-run"])
    assert res.exit_code == 0, res.output
    docs = [json.loads(chunk) for chunk in re.split(r"(?m)^(?=\{)", res.output.split("# dry run")[0]) if chunk.strip()]
    assert [d["operation"] for d in docs] == ["CreateModel", "CreateEndpointConfig", "CreateEndpoint"]
    for d in docs:
        validate_parameters(d["request"], operation(d["operation"]).input_shape)  # raises on any wrong field
    model, config, endpoint = (d["request"] for d in docs)
    assert NAME.fullmatch(model["ModelName"]) and NAME.fullmatch(endpoint["EndpointName"])
    assert endpoint["EndpointName"] == "dilforge-az-llama32-1b-published"
    assert config["EndpointConfigName"] == model["ModelName"] == endpoint["EndpointConfigName"]
    variant = config["ProductionVariants"][0]
    assert (variant["InstanceType"], variant["InitialInstanceCount"]) == ("ml.g5.xlarge", 1)  # from the preset
    source = model["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
    assert source["S3DataType"] == "S3Prefix" and source["CompressionType"] == "None"
    assert re.fullmatch(r"s3://dilforge-artifacts-123456789012/store/artifacts/sft/[0-9a-f]{16}/", source["S3Uri"])
    assert model["PrimaryContainer"]["Environment"]["DILFORGE_MODEL_ID"] == "az-llama32-1b-published-sft"
    assert model["ExecutionRoleArn"] == "arn:aws:iam::123456789012:role/dilforge-sagemaker"


def test_image_by_digest_from_the_push_record_and_system_prompt_from_sft(no_aws):
    (no_aws / "images.json").write_text(json.dumps({"serve-gpu": {"push": {"image": DIGEST}}}))
    cfg = load_pipeline(PRESET, overrides={"sft.system_prompt": "Sən köməkçisən."})
    image = deploy.serve_image(cfg.sagemaker, dry_run=False)
    assert image == DIGEST
    p = deploy.plan(cfg, "s3://b/store/artifacts/sft/0123456789abcdef", image)
    env = p.create_model["PrimaryContainer"]["Environment"]
    assert p.create_model["PrimaryContainer"]["Image"] == DIGEST and env["DILFORGE_SYSTEM_PROMPT"] == "Sən köməkçisən."
    other = deploy.plan(cfg, "s3://b/store/artifacts/sft/fedcba9876543210", image)
    assert other.model != p.model and other.endpoint == p.endpoint  # a new artifact is a new model + config
    assert deploy.plan(cfg, "s3://b/store/artifacts/sft/0123456789abcdef", image).model == p.model
    for op, request in deploy.delete_requests(p.endpoint, p.model, [p.model]):
        validate_parameters(request, operation(op).input_shape)
    for exists in (False, True):
        op, request = p.endpoint_request(exists)
        validate_parameters(request, operation(op).input_shape)


def test_no_image_and_local_artifacts_are_clear_errors(no_aws):
    cfg = load_pipeline(PRESET)
    with pytest.raises(ConfigError, match="images push --stage serve"):
        deploy.serve_image(cfg.sagemaker, dry_run=False)
    with pytest.raises(ConfigError, match="reads its model from S3"):
        deploy.plan(cfg, "/tmp/store/artifacts/sft/x", DIGEST)


def test_create_then_update_then_nothing_then_delete_against_moto(no_aws, monkeypatch):
    import boto3
    from moto import mock_aws

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    # moto's own list of instance types stops before g5 (the real API takes it: botocore's model has no enum)
    cfg = load_pipeline(PRESET, overrides={"sagemaker.endpoint.instance_type": "ml.g4dn.xlarge"})
    first = deploy.plan(cfg, "s3://b/store/artifacts/sft/0123456789abcdef", DIGEST)
    second = deploy.plan(cfg, "s3://b/store/artifacts/sft/fedcba9876543210", DIGEST)
    lines: list[str] = []

    class MotoWithUpdate:
        """moto 5.2 has no UpdateEndpoint: emulate its effect (same name, new config) on moto's own state."""

        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        def update_endpoint(self, EndpointName, EndpointConfigName):
            self.client.delete_endpoint(EndpointName=EndpointName)
            return self.client.create_endpoint(EndpointName=EndpointName, EndpointConfigName=EndpointConfigName)

    with mock_aws():
        sm = MotoWithUpdate(boto3.client("sagemaker", region_name="us-east-1"))
        d = deploy.Deployer(sm, out=lines.append, sleep=lambda s: None, poll_s=0)
        assert d.deploy(first)["EndpointStatus"] == "InService"
        assert [op for op, _ in d.sent] == ["CreateModel", "CreateEndpointConfig", "CreateEndpoint"]
        d.sent.clear()
        d.deploy(second)
        assert [op for op, _ in d.sent] == ["CreateModel", "CreateEndpointConfig", "UpdateEndpoint"]
        assert sm.describe_endpoint(EndpointName=first.endpoint)["EndpointConfigName"] == second.model
        d.sent.clear()
        d.deploy(second)
        assert d.sent == [] and "nothing to do" in lines[-2]
        deleted = d.delete(first.endpoint)
        assert [op for op, _ in deleted] == ["DeleteEndpoint", "DeleteEndpointConfig", "DeleteModel"]
        assert d.describe_endpoint(first.endpoint) is None
        assert d.delete(first.endpoint) == [] and "nothing to delete" in lines[-1]


@pytest.mark.parametrize(
    ("run_ids", "same"),
    [(("az.v1", "az_v1"), False), (("az-v1", "az.v1"), False), (("x" * 56, "x" * 57), False), (("az-v1",) * 2, True)],
)
def test_endpoint_names_are_valid_and_unique_per_run(no_aws, run_ids, same):
    names = [deploy.endpoint_name(load_pipeline(PRESET, overrides={"run_id": r})) for r in run_ids]
    assert all(NAME.fullmatch(n) and len(n) <= 63 for n in names), names
    assert (names[0] == names[1]) is same, names
    assert deploy.endpoint_name(load_pipeline(PRESET, overrides={"run_id": "az-v1"})) == "dilforge-az-v1"


def test_dry_run_without_a_push_record_cites_the_image_by_digest(no_aws):
    cfg = load_pipeline(PRESET).sagemaker
    image = deploy.serve_image(
        cfg.model_copy(update={"endpoint": cfg.endpoint.model_copy(update={"image": None})}), True
    )
    assert "@sha256:" in image and "coordinator images push --stage serve" in image
