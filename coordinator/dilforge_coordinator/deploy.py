"""`coordinator deploy`: the pipeline's SFT artifact as a SageMaker real-time endpoint, on the serve image.

CreateModel (image by digest, the artifact's S3 folder as model data), CreateEndpointConfig and CreateEndpoint
(or UpdateEndpoint), named by digest so a redeploy of the same thing changes nothing; then wait for InService.
`--delete` removes all three. Plain boto3 calls, so `--dry-run` prints exactly what would be sent, offline."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer
from botocore import xform_name
from botocore.exceptions import ClientError, WaiterError
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.model_id import MODEL_ID_ENV, SYSTEM_PROMPT_ENV, default_model_id

from .cloud import SageMakerConfig
from .common import ForceOpt
from .config import PipelineConfig, load_pipeline

GPU_FAMILIES = ("g", "p")  # ml.g5/g6/p4d/p5...: the serve image's GPU variant
VARIANT = "AllTraffic"


def endpoint_name(pipeline: PipelineConfig) -> str:
    """A valid SageMaker endpoint name (1-63 letters, digits and inner hyphens), unique per run by construction:
    a name that had to change (other characters, over 63) carries 8 hex digits of the name it came from, so
    `az.v1` and `az_v1` never share an endpoint (a deploy would update, and --delete remove, the other's)."""
    cfg = pipeline.sagemaker
    raw = cfg.endpoint.name or f"{cfg.job_name_prefix}-{pipeline.run_id}"
    clean = re.sub(r"[^A-Za-z0-9]+", "-", raw).strip("-")
    if clean == raw and len(clean) <= 63:
        return clean
    return f"{clean[:54].rstrip('-')}-{hashlib.sha256(raw.encode()).hexdigest()[:8]}"


def serve_image(cfg: SageMakerConfig, dry_run: bool) -> str:
    """The serve image by digest: the config's, else the one `coordinator images push --stage serve` recorded."""
    from .images import pushed_image

    gpu = cfg.endpoint.instance_type.split(".")[1].startswith(GPU_FAMILIES)
    if image := cfg.endpoint.image or pushed_image("serve", gpu=gpu):
        return image
    if dry_run:  # no push record yet: the digest the real deploy would cite comes from `images push`
        return f"{cfg.registry}/{cfg.repository_prefix}-serve@sha256:<digest recorded by: coordinator images push --stage serve>"
    raise ConfigError(
        "no serve image: run `coordinator images build --stage serve` and `coordinator images push "
        "--stage serve`, or set sagemaker.endpoint.image (repo@sha256:digest)"
    )


@dataclass
class DeployPlan:
    endpoint: str
    model: str  # model and endpoint config share this name: <endpoint>-<digest of what they hold>
    create_model: dict
    create_endpoint_config: dict
    artifact_uri: str

    def endpoint_request(self, exists: bool) -> tuple[str, dict]:
        if exists:
            return "UpdateEndpoint", {"EndpointName": self.endpoint, "EndpointConfigName": self.model}
        return "CreateEndpoint", {
            "EndpointName": self.endpoint,
            "EndpointConfigName": self.model,
            "Tags": self.create_model["Tags"],
        }


def plan(
    pipeline: PipelineConfig,
    artifact_uri: str,
    image: str,
    system_prompt: str | None = None,
    model_id: str | None = None,
) -> DeployPlan:
    """Every request of a deployment, built offline from the config (with its `sagemaker:` section), the artifact's
    URI and the image."""
    cfg = pipeline.sagemaker
    if not artifact_uri.startswith("s3://"):
        raise ConfigError(
            f"{artifact_uri}: a SageMaker endpoint reads its model from S3; deploy an artifact of an s3:// store"
        )
    ep = cfg.endpoint
    if system_prompt is None and pipeline.sft is not None:
        system_prompt = pipeline.sft.system_prompt
    env = {
        MODEL_ID_ENV: model_id or default_model_id(pipeline.run_id, "sft", "model"),
        "DILFORGE_LOG_LEVEL": "INFO",
        **({SYSTEM_PROMPT_ENV: system_prompt} if system_prompt else {}),
        **({"DILFORGE_S3_ENDPOINT_URL": pipeline.store.s3_endpoint_url} if pipeline.store.s3_endpoint_url else {}),
        **ep.environment,
    }
    name = endpoint_name(pipeline)
    digest = hashlib.sha256(
        json.dumps([artifact_uri, image, env, ep.instance_type, ep.num_instances], sort_keys=True).encode()
    ).hexdigest()[:10]
    model = f"{name[:52]}-{digest}"
    tagged = {"dilforge:run-id": pipeline.run_id, "dilforge:artifact": artifact_uri[-256:], **cfg.tags}
    tags = [{"Key": k, "Value": v} for k, v in sorted(tagged.items())]
    create_model: dict[str, Any] = {
        "ModelName": model,
        "ExecutionRoleArn": cfg.role_arn,
        "PrimaryContainer": {
            "Image": image,
            "Mode": "SingleModel",
            "ModelDataSource": {
                "S3DataSource": {
                    "S3Uri": artifact_uri.rstrip("/") + "/",
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            },
            "Environment": env,
        },
        "EnableNetworkIsolation": False,
        "Tags": tags,
    }
    if cfg.subnets:
        create_model["VpcConfig"] = {"Subnets": cfg.subnets, "SecurityGroupIds": cfg.security_group_ids}
    create_config = {
        "EndpointConfigName": model,
        "ProductionVariants": [
            {
                "VariantName": VARIANT,
                "ModelName": model,
                "InstanceType": ep.instance_type,
                "InitialInstanceCount": ep.num_instances,
                "InitialVariantWeight": 1.0,
                "ContainerStartupHealthCheckTimeoutInSeconds": ep.container_startup_timeout_s,
                "ModelDataDownloadTimeoutInSeconds": ep.model_data_download_timeout_s,
            }
        ],
        "Tags": tags,
    }
    return DeployPlan(name, model, create_model, create_config, artifact_uri)


def delete_requests(name: str, config_name: str | None, models: list[str]) -> list[tuple[str, dict]]:
    return [
        ("DeleteEndpoint", {"EndpointName": name}),
        *([("DeleteEndpointConfig", {"EndpointConfigName": config_name})] if config_name else []),
        *[("DeleteModel", {"ModelName": m}) for m in models],
    ]


# ---- against SageMaker ------------------------------------------------------------------------------


@dataclass
class Deployer:
    sagemaker: Any  # a boto3 SageMaker client
    out: Callable[[str], None] = print
    poll_s: float = 30.0
    timeout_s: float = 3600.0
    sent: list[tuple[str, dict]] = field(default_factory=list)

    def _call(self, op: str, request: dict) -> dict:
        self.sent.append((op, request))
        return getattr(self.sagemaker, xform_name(op))(**request)

    def _describe(self, method: str, **name: str) -> dict | None:
        """SageMaker's description of one resource, or None when there is none."""
        try:
            return getattr(self.sagemaker, method)(**name)
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("ValidationException", "ResourceNotFound"):
                return None
            raise

    def describe_endpoint(self, name: str) -> dict | None:
        return self._describe("describe_endpoint", EndpointName=name)

    def deploy(self, deploy: DeployPlan) -> dict:
        current = self.describe_endpoint(deploy.endpoint)
        if current is not None and current.get("EndpointConfigName") == deploy.model:
            self.out(f"endpoint {deploy.endpoint} already serves {deploy.artifact_uri} ({deploy.model}): nothing to do")
        else:
            if self._describe("describe_model", ModelName=deploy.model) is None:
                self._call("CreateModel", deploy.create_model)
            if self._describe("describe_endpoint_config", EndpointConfigName=deploy.model) is None:
                self._call("CreateEndpointConfig", deploy.create_endpoint_config)
            op, request = deploy.endpoint_request(exists=current is not None)
            self._call(op, request)
            self.out(
                f"{'updating' if current else 'creating'} endpoint {deploy.endpoint} "
                f"({deploy.create_endpoint_config['ProductionVariants'][0]['InitialInstanceCount']} x "
                f"{deploy.create_endpoint_config['ProductionVariants'][0]['InstanceType']})"
            )
        return self.wait(deploy.endpoint)

    def wait(self, name: str) -> dict:
        """boto3's `endpoint_in_service` waiter: DescribeEndpoint every poll_s until InService; Failed (or the
        attempts running out) raises with SageMaker's FailureReason."""
        desc = self.describe_endpoint(name) or {}
        if desc.get("EndpointStatus") == "InService":
            return desc
        self.out(f"endpoint {name}: waiting for InService (checked every {self.poll_s:.0f} s)")
        attempts = max(1, math.ceil(self.timeout_s / max(self.poll_s, 1.0)))
        try:
            self.sagemaker.get_waiter("endpoint_in_service").wait(
                EndpointName=name, WaiterConfig={"Delay": self.poll_s, "MaxAttempts": attempts}
            )
        except WaiterError as exc:
            desc = exc.last_response or {}
            reason = desc.get("FailureReason") or desc.get("Error", {}).get("Message") or exc.last_response
            raise DilforgeError(
                f"endpoint {name} is {desc.get('EndpointStatus', 'not in service')}: {reason}"
            ) from None
        desc = self.describe_endpoint(name) or {}
        self.out(f"endpoint {name}: {desc.get('EndpointStatus')}")
        return desc

    def delete(self, name: str) -> list[tuple[str, dict]]:
        desc = self.describe_endpoint(name)
        if desc is None:
            self.out(f"endpoint {name} does not exist: nothing to delete")
            return []
        config_name = desc["EndpointConfigName"]
        config = self._describe("describe_endpoint_config", EndpointConfigName=config_name)
        variants = config["ProductionVariants"] if config else []
        requests = delete_requests(name, config_name, [v["ModelName"] for v in variants])
        for op, request in requests:
            self._call(op, request)
        self.out(
            f"deleted endpoint {name}, endpoint config {config_name} and model(s) {[v['ModelName'] for v in variants]}"
        )
        return requests


# ---- the command --------------------------------------------------------------------------------------


def artifact_of(pipeline: PipelineConfig, dry_run: bool) -> str:
    """The pipeline's SFT artifact: from its run record, or (dry run, offline) the URI the plan gives it."""
    from .backends.sagemaker import offline_jobs
    from .pipeline import upstream_from_record

    produced = {j.stage: j.artifact_uri for j in offline_jobs(pipeline)} if dry_run else upstream_from_record(pipeline)
    if "sft" in produced:
        return produced["sft"]
    if dry_run:
        raise ConfigError("the pipeline has no sft stage: pass the artifact URI to deploy")
    raise ConfigError(f"run {pipeline.run_id} has no SFT artifact yet (run the pipeline, or pass the artifact URI)")


def deploy_cmd(
    config: Annotated[str, typer.Option("--config", "-c", help="Pipeline YAML with a `sagemaker:` section.")],
    artifact: Annotated[
        str | None, typer.Argument(help="SFT (or model) artifact URI on S3; default the run's SFT artifact.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print every request offline; send nothing.")] = False,
    delete: Annotated[bool, typer.Option("--delete", help="Delete the endpoint, its config and its model.")] = False,
    model_id: Annotated[str | None, typer.Option("--model-id", help="OpenAI model id; default <run_id>-sft.")] = None,
    system_prompt: Annotated[
        str | None,
        typer.Option("--system-prompt", help="Default system message; default the config's sft.system_prompt."),
    ] = None,
    force: ForceOpt = False,
) -> None:
    """Deploy the SFT artifact to a SageMaker real-time endpoint (create or update, wait), or --delete it."""
    from pathlib import Path

    pipeline = load_pipeline(Path(config))
    if pipeline.sagemaker is None:
        raise ConfigError(f"{config}: deploy needs a `sagemaker:` section (role_arn, region, endpoint)")
    name = endpoint_name(pipeline)
    if delete and dry_run:
        for op, request in delete_requests(name, "<its endpoint config>", ["<its model>"]):
            typer.echo(json.dumps({"operation": op, "request": request}, indent=2))
        return
    if not delete:
        uri = artifact or artifact_of(pipeline, dry_run)
        if not dry_run:  # a dry run plans offline, before the artifact or its eval may exist
            from . import gate

            gate.check(uri, pipeline.store.uri, pipeline.run_id, pipeline.store.s3_endpoint_url, force, "deploy")
        deploy = plan(pipeline, uri, serve_image(pipeline.sagemaker, dry_run), system_prompt, model_id)
    if dry_run:  # what a first deployment sends
        first = [("CreateModel", deploy.create_model), ("CreateEndpointConfig", deploy.create_endpoint_config)]
        for op, request in [*first, deploy.endpoint_request(exists=False)]:
            typer.echo(json.dumps({"operation": op, "request": request}, indent=2, ensure_ascii=False))
        typer.echo(
            f"# dry run: nothing sent. An existing endpoint {name} gets UpdateEndpoint instead of CreateEndpoint."
        )
        return
    import boto3

    client = boto3.client("sagemaker", region_name=pipeline.sagemaker.region)
    deployer = Deployer(client, out=typer.echo, poll_s=pipeline.sagemaker.poll_interval_s)
    if delete:
        deployer.delete(name)
        return
    desc = deployer.deploy(deploy)
    typer.echo(
        f"endpoint {name}: {desc.get('EndpointStatus')}; model id "
        f"{deploy.create_model['PrimaryContainer']['Environment'][MODEL_ID_ENV]}; invoke with "
        f"aws sagemaker-runtime invoke-endpoint --endpoint-name {name} --content-type application/json "
        '--body \'{"messages": [{"role": "user", "content": "Salam!"}]}\' --cli-binary-format '
        "raw-in-base64-out out.json"
    )
