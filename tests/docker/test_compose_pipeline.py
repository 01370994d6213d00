"""The tiny pipeline end to end in containers: `coordinator run-all --backend compose`, manifests in the
compose S3 (SeaweedFS). Needs Docker and the images: run after ../shared/tools/container-env.sh and
`coordinator images build` (scripts/ci_containers.sh does both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from dilforge_coordinator.stage_images import IMAGES
from docker_stack import DOCKER, S3

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STAGES = IMAGES


def _have_image(stage: str) -> bool:
    return subprocess.run([DOCKER, "image", "inspect", f"dilforge-{stage}:dev"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def docker_ready():
    # scripts/ci_containers.sh sets DILFORGE_REQUIRE_DOCKER: there a missing engine or image fails, never skips
    missing = pytest.fail if os.environ.get("DILFORGE_REQUIRE_DOCKER") else pytest.skip
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        missing("no Docker engine (run ../shared/tools/container-env.sh)")
    absent = [name for name in ("s3", *STAGES) if not _have_image(name)]
    if absent:
        missing(f"images not built: {absent} (coordinator images build --stage s3 --stage tokenizer ...)")


def tiny_pipeline(tmp_path: Path, run_id: str) -> Path:
    """configs/az-tiny.yaml, every stage, in a fresh prefix of the compose S3."""
    raw = yaml.safe_load((ROOT / "configs" / "az-tiny.yaml").read_text())
    # a fresh prefix in the compose S3, so every stage really runs (nothing to reuse)
    raw.update(run_id=run_id, store={"uri": f"s3://dilforge/{run_id}", "s3_endpoint_url": S3["endpoint_url"]})
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def coordinator(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DILFORGE_WORKDIR": str(tmp_path / "work"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def test_tiny_pipeline_runs_in_containers(docker_ready, data_root, tmp_path):
    import boto3

    run_id = f"compose-{uuid.uuid4().hex[:8]}"
    config = tiny_pipeline(tmp_path, run_id)
    stages = [s for s in STAGES if s in yaml.safe_load(config.read_text())]
    proc = coordinator(
        "run-all", "-c", str(config), "--data", str(data_root), "--backend", "compose", tmp_path=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s3 = boto3.client("s3", **S3)
    record = json.loads(s3.get_object(Bucket="dilforge", Key=f"{run_id}/runs/{run_id}.json")["Body"].read())
    artifacts = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[") and "] artifact: " in line:
            stage, uri = line[1:].split("] artifact: ")
            artifacts[stage] = uri
    assert list(artifacts) == stages
    for stage in stages:
        assert f"[{stage}] running on compose" in proc.stdout
    for stage, uri in artifacts.items():
        assert uri.startswith(f"s3://dilforge/{run_id}/artifacts/{stage}/")
        key = uri.removeprefix("s3://dilforge/") + "/manifest.json"
        manifest = json.loads(s3.get_object(Bucket="dilforge", Key=key)["Body"].read())
        assert manifest["stage"] == stage and manifest["run_id"] == run_id
        assert f"dilforge-{stage}:dev" in manifest["producer"]["image"]  # the manifest cites its image
        assert manifest["producer"]["package"] == f"dilforge-{stage}"
        assert manifest["files"], f"{stage} published no files"
        for upstream in ("tokenizer", "cpt", "sft"):
            if upstream in artifacts and upstream != stage and upstream in _consumes(stage):
                ref = next(r for r in manifest["inputs"] if r["name"] == upstream)
                assert ref["uri"] == artifacts[upstream]
    assert all(
        record["stages"][s]["backend"] == "compose" and record["stages"][s]["status"] == "produced" for s in stages
    )

    again = coordinator(
        "run-all", "-c", str(config), "--data", str(data_root), "--backend", "compose", tmp_path=tmp_path
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("reusing") == len(stages)

    # issue 32: the same config run by the local backend into a local folder publishes the same ids
    raw = yaml.safe_load(config.read_text())
    raw["store"] = {"uri": str(tmp_path / "local-store")}
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    local = coordinator(
        "run-all", "-c", str(tmp_path / "local.yaml"), "--data", str(data_root), "--backend", "local", tmp_path=tmp_path
    )
    assert local.returncode == 0, local.stdout[-4000:] + local.stderr[-2000:]
    local_ids = [line.rsplit("/", 1)[1] for line in local.stdout.splitlines() if "] artifact: " in line]
    assert local_ids == [uri.rsplit("/", 1)[1] for uri in artifacts.values()]


def test_stage_failure_reason_comes_back(docker_ready, data_root, tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "az-tiny.yaml").read_text())["tokenizer"]
    # the file exists (the coordinator hashes it), but the column does not: only the stage finds out
    raw["validation"] = [{**raw["validation"][0], "text_field": "no_such_column"}]
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump({"run_id": f"bad-{uuid.uuid4().hex[:8]}", "store": {"uri": "unused"}, "tokenizer": raw})
    )
    proc = coordinator(
        "run", "tokenizer", "-c", str(path), "--data", str(data_root), "--backend", "compose", tmp_path=tmp_path
    )
    assert proc.returncode == 1
    assert "stage tokenizer failed" in proc.stderr and "no_such_column" in proc.stderr


def _consumes(stage: str) -> tuple[str, ...]:
    from dilforge_coordinator.config import STAGE_CONFIGS

    return STAGE_CONFIGS[stage].consumes
