"""`images build`: docker/stage.Dockerfile per stage under BuildKit, tagged `dilforge-<stage>:<version>-<gitsha>`
and `:dev` (compose). `images push`: to ECR, recording `<repo>@sha256:<digest>` so SageMaker jobs name images by
digest."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated

import typer
from dilforge_shared.errors import DilforgeError
from dilforge_shared.manifest import git_sha

from .backends.compose import ROOT, docker_binary
from .common import fail
from .settings import coordinator_settings
from .stage_images import IMAGES

EXTRA_IMAGES = ("serve", "s3", "coordinator")  # the serving image (services/serve), SeaweedFS, the coordinator
STAGE_DOCKERFILE = "docker/stage.Dockerfile"  # every stage image and serve: --build-arg STAGE, --target
Runner = Callable[..., subprocess.CompletedProcess]


def load_record() -> dict:
    path = coordinator_settings().images_record
    return json.loads(path.read_text()) if path.exists() else {}


def short_sha(root: Path = ROOT) -> str:
    """12 characters of the source commit (dilforge_shared.manifest.git_sha), "nogit" outside a checkout."""
    return (git_sha(root) or "nogit")[:12]


def version() -> str:
    try:
        return metadata.version("dilforge-coordinator")
    except metadata.PackageNotFoundError:
        return "0.0.0"


def default_tag(gpu: bool = False) -> str:
    return f"{version()}-{short_sha()}" + ("-gpu" if gpu else "")


def prepare_wheelhouse(source: str | None = None, root: Path = ROOT) -> list[str]:
    """Hard-link (or copy) local wheels into the build context's docker/wheelhouse/ (git-ignored)."""
    dest = root / "docker" / "wheelhouse"
    dest.mkdir(parents=True, exist_ok=True)
    source = source if source is not None else os.environ.get("BUILD_WHEELHOUSE", "")
    linked = []
    if source and Path(source).is_dir():
        for wheel in sorted(Path(source).glob("*.whl")):
            target = dest / wheel.name
            if not target.exists():
                try:
                    os.link(wheel, target)
                except OSError:
                    shutil.copy2(wheel, target)
            linked.append(wheel.name)
    return linked


@dataclass
class BuildResult:
    stage: str
    ref: str
    image_id: str
    size_bytes: int
    build_s: float
    tag: str
    git_sha: str
    gpu: bool


def build_command(
    stage: str,
    tags: list[str],
    docker: str,
    base_image: str | None = None,
    gpu: bool = False,
    ca_bundle: str | None = None,
    root: Path = ROOT,
    no_cache: bool = False,
) -> list[str]:
    own = {"s3": "docker/seaweedfs.Dockerfile", "coordinator": "docker/coordinator.Dockerfile"}
    cmd = [docker, "build", "--pull=false", "--progress=plain", "-f", str(root / own.get(stage, STAGE_DOCKERFILE))]
    if stage not in own:
        if not (root / "services" / stage / "pyproject.toml").exists():
            raise DilforgeError(f"services/{stage}/pyproject.toml not found (is the {stage} service in this checkout?)")
        cmd += ["--build-arg", f"STAGE={stage}", "--target", "serve" if stage == "serve" else "train"]
    for tag in tags:
        cmd += ["-t", tag]
    if ca_bundle:
        cmd += ["--secret", f"id=ca_bundle,src={ca_bundle}"]
    if base_image:
        cmd += ["--build-arg", f"BASE_IMAGE={base_image}"]
    if gpu:
        cmd += ["--build-arg", "VARIANT=gpu"]
    if not gpu and not any((root / "docker" / "wheelhouse").glob("torch-*.whl")):
        cmd += ["--build-arg", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"]  # no local CPU wheel
    if no_cache:
        cmd += ["--no-cache"]
    cmd += [
        "--build-arg",
        f"GIT_SHA={short_sha(root)}",
        "--build-arg",
        f"IMAGE_VERSION={tags[0].rsplit(':', 1)[-1]}",
        str(root),
    ]
    return cmd


def inspect(ref: str, docker: str, runner: Runner = subprocess.run) -> dict:
    proc = runner([docker, "image", "inspect", ref, "--format", "{{json .}}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DilforgeError(f"docker image inspect {ref}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def build(stage: str, tag: str | None = None, base_image: str | None = None, gpu=False, no_cache=False) -> BuildResult:
    """Build one image (a stage, or 'serve' / 's3' / 'coordinator'); returns its id, size and build time."""
    docker = docker_binary()
    tag = tag or default_tag(gpu)
    name = f"dilforge-{stage}"
    tags = [f"{name}:{tag}"] + ([] if gpu or tag == "dev" else [f"{name}:dev"])
    ca_bundle = os.environ.get("BUILD_CA_BUNDLE") or None
    cmd = build_command(stage, tags, docker, base_image, gpu, ca_bundle, no_cache=no_cache)
    start, log_file = time.monotonic(), Path(".dilforge/build-logs") / f"{name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        proc = subprocess.run(cmd, env={**os.environ, "DOCKER_BUILDKIT": "1"}, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = log_file.read_text()[-3000:] if log_file.exists() else ""
        raise DilforgeError(f"building {tags[0]} failed (exit {proc.returncode}); log {log_file}:\n{tail}")
    info = inspect(tags[0], docker)
    return BuildResult(stage, tags[0], info["Id"], int(info.get("Size", 0)), round(seconds, 1), tag, short_sha(), gpu)


# ---------------------------------------------------------------- ECR


def ensure_repository(ecr, name: str, tags: dict[str, str] | None = None) -> str:
    """The repository's URI, creating it (scan on push, immutable tags) when missing."""
    try:
        repo = ecr.describe_repositories(repositoryNames=[name])["repositories"][0]
    except ecr.exceptions.RepositoryNotFoundException:
        kwargs = {
            "repositoryName": name,
            "imageScanningConfiguration": {"scanOnPush": True},
            "imageTagMutability": "IMMUTABLE",
        }
        if tags:
            kwargs["tags"] = [{"Key": k, "Value": v} for k, v in sorted(tags.items())]
        repo = ecr.create_repository(**kwargs)["repository"]
    return repo["repositoryUri"]


def docker_login(ecr, docker: str, runner: Runner = subprocess.run) -> str:
    """docker login to the registry with a 12-hour token from ecr:GetAuthorizationToken (password on stdin)."""
    data = ecr.get_authorization_token()["authorizationData"][0]
    user, password = base64.b64decode(data["authorizationToken"]).decode().split(":", 1)
    endpoint = data["proxyEndpoint"]
    proc = runner(
        [docker, "login", "--username", user, "--password-stdin", endpoint],
        input=password,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise DilforgeError(f"docker login {endpoint} failed: {proc.stderr.strip()}")
    return endpoint


@dataclass
class PushResult:
    stage: str
    source: str
    repository_uri: str
    tag: str
    digest: str
    image: str  # <repository uri>@<digest>


def push(
    stage: str,
    ecr,
    repository: str,
    tag: str | None = None,
    docker: str | None = None,
    runner: Runner = subprocess.run,
    logged_in: set[str] | None = None,
    gpu: bool = False,
) -> PushResult:
    """Tag the local image for ECR, push it, and read back the digest the registry assigned."""
    docker, tag = docker or docker_binary(), tag or default_tag(gpu)
    logged_in = set() if logged_in is None else logged_in  # registries this process has logged in to
    source = f"dilforge-{stage}:{tag}"
    inspect(source, docker, runner)  # fails clearly when the image was not built
    uri = ensure_repository(ecr, repository, {"project": "dilforge", "stage": stage})
    if (registry := uri.split("/", 1)[0]) not in logged_in:
        docker_login(ecr, docker, runner)
        logged_in.add(registry)
    target = f"{uri}:{tag}"
    for cmd in ([docker, "tag", source, target], [docker, "push", target]):
        proc = runner(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise DilforgeError(f"{' '.join(cmd[:2])} {target} failed: {proc.stderr.strip()[-2000:]}")
    details = ecr.describe_images(repositoryName=repository, imageIds=[{"imageTag": tag}])["imageDetails"]
    if not details:
        raise DilforgeError(f"pushed {target} but ECR does not list it")
    digest = details[0]["imageDigest"]
    return PushResult(stage, source, uri, tag, digest, f"{uri}@{digest}")


def record(result: BuildResult | PushResult, gpu: bool) -> None:
    """Keep a build's or push's result in the images record, under `<stage>[-gpu]`."""
    path = coordinator_settings().images_record
    entries = load_record()
    section = "build" if isinstance(result, BuildResult) else "push"
    entries.setdefault(result.stage + ("-gpu" if gpu else ""), {})[section] = asdict(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")


def pushed_image(stage: str, gpu: bool = True) -> str | None:
    """The recorded `repo@sha256:...` for a stage (the GPU variant first when asked), or None."""
    record = load_record()
    for key in ([f"{stage}-gpu"] if gpu else []) + [stage]:
        if image := record.get(key, {}).get("push", {}).get("image"):
            return image
    return None


# ---------------------------------------------------------------- CLI: coordinator images build|push

images_app = typer.Typer(help="Build the stage images and push them to ECR.", no_args_is_help=True)
StageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--stage",
        "-s",
        help=f"{', '.join(IMAGES)} (repeatable); also {', '.join(EXTRA_IMAGES)}. Default: every stage image.",
    ),
]
TagOpt = Annotated[str | None, typer.Option("--tag", help="Image tag; default <version>-<git sha>[-gpu].")]
GpuOpt = Annotated[bool, typer.Option("--gpu", help="GPU variant on the AWS PyTorch training DLC (--base-image).")]


def _stages(stages: list[str] | None) -> list[str]:
    chosen = stages or list(IMAGES)
    bad = [s for s in chosen if s not in (*IMAGES, *EXTRA_IMAGES)]
    if bad:
        fail(f"unknown --stage {bad}; choose from {[*IMAGES, *EXTRA_IMAGES]}", 2)
    return chosen


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


@images_app.command("build")
def build_cmd(
    stage: StageOpt = None,
    tag: TagOpt = None,
    gpu: GpuOpt = False,
    base_image: Annotated[
        str | None,
        typer.Option("--base-image", help="FROM image; CPU default python:3.11-slim. The GPU variant needs the DLC."),
    ] = None,
    no_cache: bool = typer.Option(False, "--no-cache", help="Build every layer again (timing from scratch)."),
) -> None:
    """Build images (BuildKit; CA bundle from $BUILD_CA_BUNDLE, local wheels from $BUILD_WHEELHOUSE)."""
    if gpu and not base_image:
        fail("--gpu needs --base-image (the AWS PyTorch training DLC; see docs/containers.md)", 2)
    wheels = prepare_wheelhouse()
    if wheels:
        typer.echo(f"wheelhouse: {', '.join(wheels)}")
    for name in _stages(stage):
        result = build(name, tag, base_image, gpu, no_cache=no_cache)
        record(result, gpu)
        typer.echo(
            f"{result.ref}: {_human(result.size_bytes)}, built in {result.build_s:.0f} s ({result.image_id[:19]})"
        )


@images_app.command("push")
def push_cmd(
    stage: StageOpt = None,
    tag: TagOpt = None,
    gpu: GpuOpt = False,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="Pipeline YAML whose sagemaker section names region and repository prefix."
        ),
    ] = None,
    region: Annotated[str | None, typer.Option("--region", help="AWS region (overrides the config).")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print each local image and its ECR target; contact nothing.")
    ] = False,
) -> None:
    """Push images to ECR (creating repositories) and record their digests for --backend sagemaker."""
    section = {}
    if config is not None:
        from .config import load_yaml

        section = load_yaml(config).get("sagemaker") or {}
        region = region or section.get("region")
    prefix = section.get("repository_prefix", "dilforge")  # ECR repositories <prefix>-<stage>
    if dry_run:
        chosen_tag = tag or default_tag(gpu)
        for name in _stages(stage):
            typer.echo(
                f"dilforge-{name}:{chosen_tag} → <account>.dkr.ecr.{region or '<region>'}.amazonaws.com/"
                f"{prefix}-{name}:{chosen_tag} (dry run: nothing pushed, no AWS call)"
            )
        return
    import boto3

    ecr = boto3.client("ecr", region_name=region)
    logged_in: set[str] = set()
    for name in _stages(stage):
        result = push(name, ecr, f"{prefix}-{name}", tag, logged_in=logged_in, gpu=gpu)
        record(result, gpu)
        typer.echo(f"{result.source} → {result.image}")
    typer.echo(f"recorded in {coordinator_settings().images_record}")
