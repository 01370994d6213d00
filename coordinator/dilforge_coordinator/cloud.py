"""The optional `sagemaker` section of the pipeline config: per stage its machines (instance type and count,
spot, max runtime); shared by all jobs the role, region, images, tags and network; the endpoint `deploy` makes."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from dilforge_shared.configs import StrictModel
from pydantic import AfterValidator, Field, model_validator

from .stage_images import ImageName

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,511}")
# dilforge sets these itself (model id, store, stage module, checkpoint sync, ...); one from a config would silently
# point a job or endpoint elsewhere. Credentials never travel in an environment: jobs and endpoints use their role.
RESERVED_ENV_PREFIXES = ("DILFORGE_", "SM_", "SAGEMAKER_")
ALLOWED_DILFORGE_ENV = ("DILFORGE_LOG_LEVEL",)
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")


def check_environment(env: dict[str, str]) -> dict[str, str]:
    """Container environment from a config: valid names, none that dilforge or SageMaker set, no credentials
    (SageMaker's count and value limits are the type's)."""
    for name in env:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*, ≤ 512 chars)")
        if name in CREDENTIAL_ENV:
            raise ValueError(f"{name}: credentials never go in an environment; jobs and endpoints use role_arn")
        if name.startswith(RESERVED_ENV_PREFIXES) and name not in ALLOWED_DILFORGE_ENV:
            raise ValueError(
                f"{name}: names starting with {', '.join(RESERVED_ENV_PREFIXES)} are set by dilforge or SageMaker"
            )
    return env


def check_tags(tags: dict[str, str]) -> dict[str, str]:
    """None of the reserved `aws:` or dilforge's own `dilforge:` keys (those would be refused by AWS, or overwrite
    the run id and artifact dilforge tags); SageMaker's key and value rules are the type's."""
    for key in tags:
        if key.lower().startswith(("aws:", "dilforge:")):
            raise ValueError(f"{key!r}: keys starting with aws: are reserved by AWS, dilforge: by dilforge")
    return tags


TAG_TEXT = r"^[\w\s.:/=+\-@]*$"  # SageMaker's tag characters: letters, digits, spaces and _.:/=+-@
ContainerEnvironment = Annotated[
    dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=100), AfterValidator(check_environment)
]
# SageMaker takes 50 tags; dilforge adds its own
Tags = Annotated[
    dict[
        Annotated[str, Field(min_length=1, max_length=128, pattern=TAG_TEXT)],
        Annotated[str, Field(max_length=256, pattern=TAG_TEXT)],
    ],
    Field(max_length=40),
    AfterValidator(check_tags),
]


class StageResources(StrictModel):
    """The machines one stage's training job runs on."""

    instance_type: str = Field(
        default="ml.m5.xlarge",
        pattern=r"^ml\.[a-z0-9]+\.[a-z0-9]+$",
        description="SageMaker instance type, e.g. ml.p4d.24xlarge.",
    )
    num_instances: int = Field(default=1, ge=1, le=64, description="Hosts; more than one starts torchrun across hosts.")
    volume_size_gb: int = Field(default=100, ge=1, le=16384, description="EBS volume per host (data channels, cache).")
    max_runtime_s: int = Field(
        default=24 * 3600,
        ge=60,
        le=28 * 24 * 3600,
        description="Hard stop: the job is stopped (SIGTERM, then SIGKILL) after this long.",
    )
    spot: bool | None = Field(default=None, description="Managed spot training; None = the section's `spot`.")
    max_wait_s: int | None = Field(
        default=None,
        ge=60,
        le=28 * 24 * 3600,
        description="Spot only: runtime + time waiting for capacity; None = 2 × max_runtime_s.",
    )
    input_mode: Literal["File", "FastFile"] = Field(
        default="File", description="How upstream artifacts reach /opt/ml/input/data: copied (File) or streamed."
    )
    environment: ContainerEnvironment = Field(
        default_factory=dict, description="Extra container environment variables."
    )
    token_cache_instance_type: str | None = Field(
        default=None,
        pattern=r"^ml\.[a-z0-9]+\.[a-z0-9]+$",
        description="cpt only: build the token cache first, in a SageMaker Processing job on one instance of this "
        "(CPU) type (`python -m dilforge_cpt build-cache` on all its cores), into the training job's checkpoint "
        "prefix, so the GPU hosts find it finished; None = the training job tokenises.",
    )

    @model_validator(mode="after")
    def _wait_covers_runtime(self):
        if self.max_wait_s is not None and self.max_wait_s < self.max_runtime_s:
            raise ValueError(f"max_wait_s ({self.max_wait_s}) must be >= max_runtime_s ({self.max_runtime_s})")
        return self


class EndpointResources(StrictModel):
    """The SageMaker real-time endpoint `coordinator deploy` creates or updates (the serve image)."""

    name: str | None = Field(
        default=None,
        pattern=r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$",
        description="Endpoint name; None = <job_name_prefix>-<run_id>.",
    )
    instance_type: str = Field(
        default="ml.g5.xlarge",
        pattern=r"^ml\.[a-z0-9]+\.[a-z0-9]+$",
        description="Hosting instance type, e.g. ml.g5.xlarge (1 A10G) or ml.c7i.2xlarge (CPU).",
    )
    num_instances: int = Field(default=1, ge=1, le=100, description="Instances behind the endpoint.")
    image: str | None = Field(
        default=None,
        description="Serving image (repo@sha256:digest); None = the digest "
        "`coordinator images push --stage serve` recorded.",
    )
    container_startup_timeout_s: int = Field(
        default=900, ge=60, le=3600, description="How long /ping may take to answer after start (merge, load)."
    )
    model_data_download_timeout_s: int = Field(
        default=1200, ge=60, le=3600, description="How long copying the artifact into /opt/ml/model may take."
    )
    environment: ContainerEnvironment = Field(
        default_factory=dict, description="Extra container environment variables."
    )


class SageMakerConfig(StrictModel):
    """Settings for `--backend sagemaker` (and `coordinator images push`)."""

    region: str = Field(
        default="us-east-1", pattern=r"^[a-z]{2}(-[a-z]+)+-\d$", description="AWS region of jobs and ECR."
    )
    role_arn: str = Field(
        pattern=r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$",
        description="Execution role the jobs assume (S3 read/write, ECR pull, CloudWatch logs).",
    )
    account_id: str | None = Field(
        default=None, pattern=r"^\d{12}$", description="ECR registry account; None = the role ARN's account."
    )
    repository_prefix: str = Field(
        default="dilforge", pattern=r"^[a-z0-9][a-z0-9._/-]*$", description="ECR repositories are <prefix>-<stage>."
    )
    images: dict[ImageName, str] = Field(
        default_factory=dict,
        description="Image per stage (repo@sha256:digest); None = the digest `coordinator images push` recorded.",
    )
    output_uri: str | None = Field(
        default=None,
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$",
        description="S3 prefix (s3://bucket[/prefix]) for job outputs, checkpoints, TensorBoard; None = <store>/sagemaker.",
    )
    spot: bool = Field(default=True, description="Managed spot training for stages that don't say otherwise.")
    max_retry_attempts: int = Field(default=0, ge=0, le=30, description="SageMaker's own retries of a failed job.")
    job_name_prefix: str = Field(
        default="dilforge",
        pattern=r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,19}$",
        description="Training job names start with this.",
    )
    subnets: list[str] = Field(default_factory=list, description="VPC subnets (EFA multi-node needs one placement).")
    security_group_ids: list[str] = Field(default_factory=list, description="VPC security groups (with subnets).")
    tags: Tags = Field(default_factory=dict, description="Tags on every job, besides dilforge's own.")

    poll_interval_s: float = Field(le=3600, default=30.0, gt=0, description="How often a real run polls job status.")
    stages: dict[ImageName, StageResources] = Field(
        default_factory=dict, description="Per-stage machines; a stage not listed runs on one ml.m5.xlarge."
    )
    endpoint: EndpointResources = Field(
        default_factory=EndpointResources, description="The real-time endpoint `coordinator deploy` manages."
    )

    @model_validator(mode="after")
    def _vpc_pairs(self):
        if bool(self.subnets) != bool(self.security_group_ids):
            raise ValueError("subnets and security_group_ids go together (give both or neither)")
        return self

    @model_validator(mode="after")
    def _token_cache_is_cpts(self):
        if bad := sorted(s for s, r in self.stages.items() if s != "cpt" and r.token_cache_instance_type):
            raise ValueError(f"stages.{bad[0]}.token_cache_instance_type: only the cpt stage has a token cache")
        return self

    def resources(self, stage: str) -> StageResources:
        return self.stages.get(stage) or StageResources()

    @property
    def registry(self) -> str:
        suffix = ".amazonaws.com.cn" if self.region.startswith("cn-") else ".amazonaws.com"
        return f"{self.account_id or self.role_arn.split(':')[4]}.dkr.ecr.{self.region}{suffix}"
