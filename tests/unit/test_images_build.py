"""Image build inputs: one Dockerfile with the stage as a build argument, shared layers that cannot see it,
locks in step with the venv, exec-form entrypoint, nothing under /opt/ml; and the ECR push flow against moto."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import boto3
import pytest
from dilforge_coordinator import images
from dilforge_coordinator.stage_images import IMAGES
from dilforge_shared.errors import DilforgeError
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
STAGES = IMAGES
DOCKERFILE = ROOT / images.STAGE_DOCKERFILE


def _targets() -> dict[str, list[str]]:
    """The stage Dockerfile's build targets: name → its instructions (comments and blank lines dropped, each
    continued instruction on one line)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    targets: dict[str, list[str]] = {"global": []}
    name = "global"
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.startswith("FROM "):
            name = line.split(" AS ")[1].strip()
            targets[name] = []
        targets[name].append(" ".join(line.split()))
    return targets


def test_shared_layers_do_not_depend_on_the_stage():
    """Every stage image is built from one file; what comes before the stage layer cannot see STAGE, so the
    images share those layers."""
    targets = _targets()
    assert targets["global"] == ["ARG BASE_IMAGE=python:3.11-slim", "ARG STAGE=no-STAGE-build-arg"]
    assert targets["shared"][0] == "FROM ${BASE_IMAGE} AS shared"
    assert not any("STAGE" in line for line in targets["shared"])
    assert any("requirements-common.lock" in line for line in targets["shared"])
    stage = targets["stage"]
    assert stage[:2] == ["FROM shared AS stage", "ARG STAGE"]
    assert any(line.startswith("COPY services/${STAGE}/requirements.lock ") for line in stage)
    assert any("from=stage-source" in line and "import dilforge_${STAGE}" in line for line in stage)
    assert targets["stage-source"][1:] == ["ARG STAGE", "COPY services/${STAGE} /"]


def test_entrypoint_exec_form_and_nothing_under_opt_ml():
    targets = _targets()
    lines = [line for instructions in targets.values() for line in instructions]
    assert not any("/opt/ml" in line for line in lines), "SageMaker mounts over /opt/ml"
    entry = next(line for line in targets["stage"] if line.startswith("ENTRYPOINT"))
    assert json.loads(entry.removeprefix("ENTRYPOINT ")) == ["python3", "/usr/local/bin/dilforge-entrypoint"]
    # the default target (the last) trains; serve is its own target
    assert list(targets)[-1] == "train" and targets["train"] == ["FROM stage AS train", 'CMD ["train"]']
    # CA bundle as a secret, wheels as a bind mount: neither lands in a layer
    text = DOCKERFILE.read_text()
    assert "--mount=type=secret,id=ca_bundle" in text and "COPY docker/wheelhouse" not in text


def test_compose_builds_each_stage_as_images_build_does():
    import yaml

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for stage in STAGES:
        build = services[stage]["build"]
        cmd = images.build_command(stage, [f"dilforge-{stage}:dev"], "docker")
        assert build["dockerfile"] == images.STAGE_DOCKERFILE and cmd[cmd.index("-f") + 1] == str(DOCKERFILE)
        assert build["args"]["STAGE"] == stage and f"STAGE={stage}" in cmd
        assert build["target"] == cmd[cmd.index("--target") + 1] == "train"


LOCKS = {  # lock file → its input (docker/lock.sh compiles each one with uv)
    ROOT / "requirements-dev.lock": ROOT / "requirements-dev.txt",
    ROOT / "requirements-sagemaker.lock": ROOT / "requirements-sagemaker.txt",
    **{lock: lock.with_suffix(".in") for lock in sorted((ROOT / "docker").glob("requirements-*.lock"))},
    **{lock: lock.with_suffix(".txt") for lock in sorted((ROOT / "services").glob("*/requirements.lock"))},
}
IMAGE_LOCKS = [lock for lock in LOCKS if lock.parent.name != ROOT.name]  # docker/ and services/*/


def _pins(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in (line.split("==") for line in lines)}


def test_locks_pin_their_inputs_at_the_dev_locks_versions():
    """Every lock satisfies its input, and pins each package at requirements-dev.lock's version: the images
    and the SDK extra run what the tests run (the stage layers then reinstall nothing of the shared one)."""
    dev = _pins(ROOT / "requirements-dev.lock")
    assert dev["torch"].endswith("+cpu") and len(IMAGE_LOCKS) >= 8
    for lock, source in LOCKS.items():
        pins = _pins(lock)
        for line in source.read_text().splitlines():
            if line.split("#", 1)[0].strip():
                req = Requirement(line.split("#", 1)[0])
                name = canonicalize_name(req.name)
                assert name in pins and req.specifier.contains(pins[name], prereleases=True), (
                    f"{lock.relative_to(ROOT)} does not satisfy {source.relative_to(ROOT)}'s {req}: "
                    "run bash docker/lock.sh"
                )
        clash = {name: (v, dev[name]) for name, v in pins.items() if name in dev and dev[name] != v}
        assert not clash, f"{lock.relative_to(ROOT)} pins differ from requirements-dev.lock: {clash}"
        if lock in IMAGE_LOCKS:
            assert set(pins) <= set(dev), f"{lock.relative_to(ROOT)}: not in the dev venv: {set(pins) - set(dev)}"


def test_the_venv_has_the_image_locks_versions():
    """What the tests import is what the images install (scripts/setup.sh installs with requirements-dev.lock)."""
    wrong = {}
    for lock in IMAGE_LOCKS:
        for name, version in _pins(lock).items():
            try:
                installed = metadata.version(name)
            except metadata.PackageNotFoundError:
                installed = None
            if installed != version:
                wrong[name] = (version, installed)
    assert not wrong, f"lock version vs installed (bash scripts/setup.sh): {wrong}"


@pytest.mark.slow
def test_lock_sh_reproduces_every_lock():
    """uv, from the inputs, writes exactly the committed locks (needs the package index)."""
    uv = pytest.importorskip("uv", reason="uv (requirements-dev.txt) is not installed: bash scripts/setup.sh")
    env = {**os.environ, "UV": uv.find_uv_bin(), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "docker" / "lock.sh"), "--check"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_build_command_cpu_and_gpu(tmp_path, monkeypatch):
    cmd = images.build_command(
        "cpt", ["dilforge-cpt:1-abc", "dilforge-cpt:dev"], "/usr/bin/docker", ca_bundle="/etc/ca.pem"
    )
    assert cmd[:3] == ["/usr/bin/docker", "build", "--pull=false"]
    assert cmd[cmd.index("-f") + 1] == str(DOCKERFILE) and cmd[-1] == str(ROOT)
    assert "STAGE=cpt" in cmd and cmd[cmd.index("--target") + 1] == "train"
    assert "id=ca_bundle,src=/etc/ca.pem" in cmd and cmd.count("-t") == 2
    gpu = images.build_command("cpt", ["dilforge-cpt:1-abc-gpu"], "docker", base_image="dlc:2.9", gpu=True)
    assert "BASE_IMAGE=dlc:2.9" in gpu and "VARIANT=gpu" in gpu
    assert not any(a.startswith("TORCH_INDEX_URL") for a in gpu)
    s3 = images.build_command("s3", ["dilforge-s3:dev"], "docker")
    assert s3[s3.index("-f") + 1].endswith("docker/seaweedfs.Dockerfile") and not any("STAGE" in a for a in s3)
    with pytest.raises(DilforgeError, match="services/tokeniser/pyproject.toml not found"):
        images.build_command("tokeniser", ["dilforge-tokeniser:dev"], "docker")


def test_wheelhouse_links_wheels(tmp_path):
    src = tmp_path / "wheels"
    src.mkdir()
    (src / "torch-0-cp311-none-any.whl").write_bytes(b"wheel")
    (tmp_path / "docker").mkdir()
    assert images.prepare_wheelhouse(str(src), root=tmp_path) == ["torch-0-cp311-none-any.whl"]
    linked = tmp_path / "docker" / "wheelhouse" / "torch-0-cp311-none-any.whl"
    assert (
        linked.read_bytes() == b"wheel" and linked.stat().st_ino == (src / "torch-0-cp311-none-any.whl").stat().st_ino
    )


class FakeDocker:
    """Records docker commands; `docker push` uploads a manifest to (moto's) ECR as a registry would."""

    def __init__(self, ecr):
        self.ecr, self.calls, self.stdin = ecr, [], []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if kw.get("input") is not None:
            self.stdin.append(kw["input"])
        out = ""
        if cmd[1:3] == ["image", "inspect"]:
            out = json.dumps({"Id": "sha256:" + "1" * 64, "Size": 123, "RepoDigests": []})
        if cmd[1] == "push":
            repo_uri, tag = cmd[2].rsplit(":", 1)
            manifest = json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": {
                        "digest": "sha256:" + "2" * 64,
                        "size": 1,
                        "mediaType": "application/vnd.docker.container.image.v1+json",
                    },
                    "layers": [],
                }
            )
            self.ecr.put_image(repositoryName=repo_uri.split("/", 1)[1], imageManifest=manifest, imageTag=tag)
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")


@pytest.fixture
def ecr(monkeypatch, tmp_path):
    import moto

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DILFORGE_IMAGES_RECORD", str(tmp_path / "images.json"))
    with moto.mock_aws():
        yield boto3.client("ecr", region_name="us-east-1")


def test_push_creates_repository_logs_in_and_records_digest(ecr):
    docker = FakeDocker(ecr)
    logged: set[str] = set()
    result = images.push("sft", ecr, "dilforge-sft", tag="0.1.0-abc", docker="docker", runner=docker, logged_in=logged)
    repo = ecr.describe_repositories(repositoryNames=["dilforge-sft"])["repositories"][0]
    assert result.repository_uri == repo["repositoryUri"]
    detail = ecr.describe_images(repositoryName="dilforge-sft", imageIds=[{"imageTag": "0.1.0-abc"}])["imageDetails"][0]
    assert result.digest == detail["imageDigest"] and result.image == f"{repo['repositoryUri']}@{detail['imageDigest']}"
    login = next(c for c in docker.calls if c[1] == "login")
    assert login[2:5] == ["--username", "AWS", "--password-stdin"] and "--password" not in login
    token = ecr.get_authorization_token()["authorizationData"][0]["authorizationToken"]
    assert docker.stdin == [base64.b64decode(token).decode().split(":", 1)[1]]
    assert ["docker", "tag", "dilforge-sft:0.1.0-abc", f"{repo['repositoryUri']}:0.1.0-abc"] in docker.calls

    # second stage: the repository is created, but docker is not logged in twice
    images.push("eval", ecr, "dilforge-eval", tag="0.1.0-abc", docker="docker", runner=docker, logged_in=logged)
    assert sum(1 for c in docker.calls if c[1] == "login") == 1

    images.record(result, gpu=True)
    assert images.pushed_image("sft") == result.image
    # an existing repository is reused
    assert images.ensure_repository(ecr, "dilforge-sft") == repo["repositoryUri"]
    assert len(ecr.describe_repositories()["repositories"]) == 2


def test_serve_image_shares_the_stage_layers_and_runs_serve_on_8080():
    """SageMaker hosting runs `IMAGE serve` and talks to port 8080; the layers below are the stage images'."""
    assert _targets()["serve"] == ["FROM stage AS serve", "EXPOSE 8080", 'CMD ["serve"]']
    cmd = images.build_command("serve", ["dilforge-serve:dev"], "docker")
    assert cmd[cmd.index("--target") + 1] == "serve" and "STAGE=serve" in cmd
    assert cmd[cmd.index("-f") + 1] == str(DOCKERFILE)
    # what the entrypoint execs for `serve`: the package's console script, resolving to a callable
    import importlib
    import tomllib

    target = tomllib.loads((ROOT / "services/serve/pyproject.toml").read_text())["project"]["scripts"]["serve"]
    module, _, attr = target.partition(":")
    assert target == "dilforge_serve.cli:main" and callable(getattr(importlib.import_module(module), attr))


def test_one_git_sha_for_manifests_and_image_tags(monkeypatch, tmp_path):
    from dilforge_shared.manifest import current_producer, git_sha

    monkeypatch.delenv("DILFORGE_GIT_SHA", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert git_sha() == current_producer("dilforge-test").git_sha == (head or None)
    assert images.default_tag() == f"{images.version()}-{(head or 'nogit')[:12]}"
    assert git_sha(tmp_path) is None and images.short_sha(tmp_path) == "nogit"  # outside a checkout
    monkeypatch.setenv("DILFORGE_GIT_SHA", "0123456789abcdef0123")  # what an image sets at build time
    assert current_producer("dilforge-test").git_sha == "0123456789abcdef0123"
    assert images.default_tag(gpu=True) == f"{images.version()}-0123456789ab-gpu"


def test_push_dry_run_names_every_target_and_contacts_nothing(monkeypatch):
    from dilforge_coordinator.cli import app
    from typer.testing import CliRunner

    monkeypatch.setattr(boto3, "client", lambda *a, **k: pytest.fail("the dry run called AWS"))
    result = CliRunner().invoke(
        app, ["images", "push", "--dry-run", "--tag", "t1", "--region", "eu-west-1", "-s", "cpt", "-s", "eval"]
    )
    assert result.exit_code == 0, result.output
    assert "dilforge-cpt:t1 → <account>.dkr.ecr.eu-west-1.amazonaws.com/dilforge-cpt:t1" in result.output
    assert "dilforge-eval:t1" in result.output and "dilforge-sft" not in result.output
