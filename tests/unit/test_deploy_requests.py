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
from dilforge_coordinator.config import load_pipeline
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
        d = deploy.Deployer(sm, out=lines.append, poll_s=0)
        assert d.deploy(first)["EndpointStatus"] == "InService"
        assert [op for op, _ in d.sent] == ["CreateModel", "CreateEndpointConfig", "CreateEndpoint"]
        d.sent.clear()
        d.deploy(second)
        assert [op for op, _ in d.sent] == ["CreateModel", "CreateEndpointConfig", "UpdateEndpoint"]
        assert sm.describe_endpoint(EndpointName=first.endpoint)["EndpointConfigName"] == second.model
        d.sent.clear()
        d.deploy(second)
        assert d.sent == [] and "nothing to do" in lines[-1]
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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"sagemaker.output_uri": "s3://"}, r"sagemaker\.output_uri: String should match pattern"),
        (
            {"sagemaker.tags": {"aws:team": "nlp"}},
            r"sagemaker\.tags: .*'aws:team': keys starting with aws: are reserved",
        ),
        ({"sagemaker.tags": {"dilforge:run-id": "other"}}, r"sagemaker\.tags: .*dilforge: by dilforge"),
        (
            {"sagemaker.endpoint.environment": {"DILFORGE_MODEL_ID": "someone-else"}},
            r"sagemaker\.endpoint\.environment: .*DILFORGE_MODEL_ID: names starting with DILFORGE_",
        ),
        (
            {"sagemaker.stages": {"cpt": {"environment": {"AWS_SECRET_ACCESS_KEY": "x"}}}},
            r"sagemaker\.stages\.cpt\.environment: .*credentials never go in an environment",
        ),
        ({"sagemaker.endpoint.environment": {"1BAD": "x"}}, r"'1BAD' is not an environment variable name"),
    ],
)
def test_deploy_settings_that_would_clash_or_leak_are_refused_naming_the_field(no_aws, override, message):
    """Issue 31: deploy accepted output_uri "s3://", an environment overriding the served model id, aws: tags."""
    with pytest.raises(ConfigError, match=message):
        load_pipeline(PRESET, overrides=override)
    res = CliRunner().invoke(app, ["deploy", "-c", str(_with(no_aws, override)), "--dry-run"])
    assert res.exit_code == 1 and "CreateModel" not in res.output, res.output
    field = message.split(":")[0]  # the printed line is redacted: "credentials" may read "***"
    assert res.output.count("error:") == 1 and re.search(field, res.output.partition("error:")[2]), res.output


def _with(tmp_path: Path, override: dict) -> Path:
    """The preset with one dotted key replaced, as a user would edit it."""
    import yaml

    doc = yaml.safe_load(PRESET.read_text())
    ((key, value),) = override.items()
    *parents, leaf = key.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    path = Path(tmp_path) / "edited.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_log_level_and_a_plain_variable_still_reach_the_endpoint(no_aws):
    cfg = load_pipeline(
        PRESET, overrides={"sagemaker.endpoint.environment": {"DILFORGE_LOG_LEVEL": "DEBUG", "OMP_NUM_THREADS": "4"}}
    )
    assert cfg.sagemaker.endpoint.environment == {"DILFORGE_LOG_LEVEL": "DEBUG", "OMP_NUM_THREADS": "4"}


def test_a_failed_endpoint_ends_the_wait_with_sagemakers_reason(no_aws):
    """The wait is boto3's own `endpoint_in_service` waiter; its Failed state becomes one line with the reason."""
    import boto3
    from botocore.stub import Stubber
    from dilforge_shared.errors import DilforgeError

    # a session of its own: boto3's default session would keep these keys for every later client in the process
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    client = session.client("sagemaker")
    base = {
        "EndpointName": "ep",
        "EndpointArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint/ep",
        "EndpointConfigName": "cfg",
        "CreationTime": "2026-12-03T00:00:00Z",
        "LastModifiedTime": "2026-12-03T00:00:00Z",
    }
    lines: list[str] = []
    with Stubber(client) as stub:
        for _ in range(2):  # the first look, then the waiter's first attempt
            stub.add_response("describe_endpoint", {**base, "EndpointStatus": "Creating"}, {"EndpointName": "ep"})
        stub.add_response(
            "describe_endpoint",
            {**base, "EndpointStatus": "Failed", "FailureReason": "ping health check failed"},
            {"EndpointName": "ep"},
        )
        with pytest.raises(DilforgeError, match="endpoint ep is Failed: ping health check failed"):
            deploy.Deployer(client, out=lines.append, poll_s=0).wait("ep")
        stub.assert_no_pending_responses()
    assert lines == ["endpoint ep: waiting for InService (checked every 0 s)"]
