"""The curate stage as SageMaker Processing jobs on 2 instances, in the SDK's local container mode
(`--backend sagemaker-local`), gives the same output, byte for byte, as the local run of the same config.

Needs Docker + Compose v2, the curate and s3 images (scripts/ci_containers.sh) and the SDK extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
import yaml
from docker_stack import DOCKER, S3, TAG

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from dirty_corpus import build  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

COORDINATOR = str(Path(sys.executable).parent / "coordinator")


def test_two_instances_in_local_mode_give_the_local_output(tmp_path, data_root):
    missing = pytest.fail if os.environ.get("DILFORGE_REQUIRE_DOCKER") else pytest.skip
    pytest.importorskip("sagemaker.core.processing", reason="SDK extra: bash scripts/setup.sh --sagemaker")
    if subprocess.run([DOCKER, "image", "inspect", f"dilforge-curate:{TAG}"], capture_output=True).returncode:
        missing(f"dilforge-curate:{TAG} is not built (coordinator images build --stage curate)")
    # a fresh corpus (its shuffle), so a fresh artifact id: the compose S3 outlives test runs
    build(data_root, tmp_path / "dirty", seed=uuid.uuid4().int % 2**31)
    section = {
        "corpora": [{"uri": str(tmp_path / "dirty" / "web.jsonl"), "name": "web"}],
        "output": {"num_shards": 4},
    }
    sagemaker = {
        "role_arn": "arn:aws:iam::000000000000:role/dilforge-local",
        "spot": False,
        "stages": {"curate": {"instance_type": "ml.m5.xlarge", "num_instances": 2}},
    }
    manifests = {}
    for backend in ("local", "sagemaker-local"):
        raw = {"run_id": f"curate-{backend}", "store": {"uri": str(tmp_path / "store")}, "curate": section}
        if backend == "sagemaker-local":
            raw["sagemaker"] = sagemaker
        (tmp_path / f"{backend}.yaml").write_text(yaml.safe_dump(raw))
        env = {**os.environ, "DILFORGE_WORKDIR": str(tmp_path / "work"), "AWS_DEFAULT_REGION": "us-east-1"}
        proc = subprocess.run(
            [COORDINATOR, "run-all", "-c", str(tmp_path / f"{backend}.yaml"), "--backend", backend],
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        uri = proc.stdout.strip().splitlines()[-1].split("artifact: ")[1]
        if uri.startswith("s3://"):
            bucket, key = uri.removeprefix("s3://").split("/", 1)
            body = boto3.client("s3", **S3).get_object(Bucket=bucket, Key=f"{key}/manifest.json")["Body"].read()
            manifests[backend] = json.loads(body)
            assert "on host 1 of 2" in proc.stdout and "on host 2 of 2" in proc.stdout
        else:
            manifests[backend] = json.loads((Path(uri.removeprefix("file://")) / "manifest.json").read_text())
    files = {b: [(f["path"], f["sha256"]) for f in m["files"]] for b, m in manifests.items()}
    assert files["local"] == files["sagemaker-local"] and len(files["local"]) == 6  # 4 shards, report, card
