"""The tiny pipeline through the SageMaker SDK's local container mode (`--backend sagemaker-local`), CPT on two
hosts from resourceconfig.json, a rerun that reuses every artifact, a one-host CPT reference, and a spot
interruption (SIGTERM to the CPT container mid-training) survived by a rerun.

Needs Docker + Compose v2 and the stage images (scripts/ci_containers.sh: ../shared/tools/container-env.sh,
`coordinator images build`), the SDK extra (scripts/setup.sh --sagemaker) and AWS_DEFAULT_REGION (set here;
no AWS account or credentials are used). Image tag: $DILFORGE_IMAGE_TAG (default dev).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from docker_stack import DOCKER, S3, TAG

# the module fixtures run whole local-mode jobs: several minutes each on 2 cores, more than the 900 s default
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("tokenizer", "cpt", "sft", "eval")
SIGTERM_BUDGET_S = 120  # SageMaker's time between SIGTERM and SIGKILL


@pytest.fixture(scope="module")
def ready():
    missing = pytest.fail if os.environ.get("DILFORGE_REQUIRE_DOCKER") else pytest.skip
    pytest.importorskip("sagemaker.train.model_trainer", reason="SDK extra: bash scripts/setup.sh --sagemaker")
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        missing("no Docker engine (run ../shared/tools/container-env.sh)")
    absent = [
        s
        for s in ("s3", *STAGES)
        if subprocess.run(
            [DOCKER, "image", "inspect", f"dilforge-{s}:{TAG if s != 's3' else 'dev'}"], capture_output=True
        ).returncode
        != 0
    ]
    if absent:
        missing(f"images not built: {absent} (coordinator images build)")


def config(tmp: Path, name: str, prefix: str, num_cpt_hosts: int, stages=STAGES) -> Path:
    """configs/az-tiny.yaml, plus the `sagemaker:` section a SageMaker run would have, in a fresh store prefix."""
    raw = yaml.safe_load((ROOT / "configs" / "az-tiny.yaml").read_text())
    raw = {k: v for k, v in raw.items() if k not in STAGES or k in stages}
    if "cpt" in raw:
        # 2 hosts (FSDP, fp32) are compared with 1 host, where auto would autocast to bf16 on a CPU with bf16
        # instructions: the same arithmetic on both
        raw["cpt"]["precision"] = "fp32"
    raw.update(
        run_id=prefix,
        store={"uri": f"s3://dilforge/{prefix}", "s3_endpoint_url": S3["endpoint_url"]},
        sagemaker={
            "role_arn": "arn:aws:iam::123456789012:role/dilforge-sagemaker",
            "spot": False,
            "stages": {"cpt": {"instance_type": "ml.c5.xlarge", "num_instances": num_cpt_hosts}},
        },
    )
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DILFORGE_WORKDIR": str(tmp / "work"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "DILFORGE_IMAGE_TAG": TAG,
    }


def coordinator(tmp: Path, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", *args, "--backend", "sagemaker-local"],
        cwd=ROOT,
        env=env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (tmp / f"log-{uuid.uuid4().hex[:6]}.txt").write_text(proc.stdout + proc.stderr)
    return proc


def artifacts(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^\[(\w+)\] artifact: (\S+)$", stdout, re.MULTILINE))


def s3():
    import boto3

    return boto3.client("s3", **S3)


def manifest(uri: str) -> dict:
    key = uri.removeprefix("s3://dilforge/") + "/manifest.json"
    return json.loads(s3().get_object(Bucket="dilforge", Key=key)["Body"].read())


def weights_sha(uri: str) -> str:
    return {f["path"]: f["sha256"] for f in manifest(uri)["files"]}["model.safetensors"]


def load_weights(uri: str, tmp: Path) -> dict:
    from safetensors.torch import load_file

    m = manifest(uri)
    path = tmp / f"{m['artifact_id']}-{uuid.uuid4().hex[:6]}.safetensors"
    s3().download_file("dilforge", f"{uri.removeprefix('s3://dilforge/')}/{m['data_dir']}/model.safetensors", str(path))
    return load_file(path)


@pytest.fixture(scope="module")
def pipeline(ready, data_root, tmp_path_factory):
    """az-tiny, every stage, CPT on 2 hosts; then the same command again."""
    tmp = tmp_path_factory.mktemp("smlocal")
    prefix = f"smlocal-{uuid.uuid4().hex[:8]}"
    cfg = config(tmp, "pipeline", prefix, num_cpt_hosts=2)
    start = time.monotonic()
    first = coordinator(tmp, "run-all", "-c", str(cfg), "--data", str(data_root))
    seconds = time.monotonic() - start
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr[-3000:]
    again = coordinator(tmp, "run-all", "-c", str(cfg), "--data", str(data_root))
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
    print(f"sagemaker-local az-tiny pipeline: {seconds:.0f} s")
    return {"tmp": tmp, "first": first, "again": again, "artifacts": artifacts(first.stdout), "prefix": prefix}


def test_every_stage_runs_as_a_local_sagemaker_job_and_publishes(pipeline):
    out, arts = pipeline["first"].stdout, pipeline["artifacts"]
    assert list(arts) == list(STAGES)
    for stage in STAGES:
        assert f"[{stage}] SageMaker local mode: " in out
        m = manifest(arts[stage])
        assert m["stage"] == stage and m["run_id"] == pipeline["prefix"]
        assert arts[stage].startswith(f"s3://dilforge/{pipeline['prefix']}/artifacts/{stage}/")
        assert m["producer"]  # published by the stage inside the container, as a cloud job does
    assert "[cpt] SageMaker local mode: 2 x dilforge-cpt:" in out
    # upstream artifacts arrived as channels: the eval stage verified three mounted channel folders
    assert [i["name"] for i in manifest(arts["eval"])["inputs"]][:3] == ["cpt", "sft", "tokenizer"]
    # data the config names locally was uploaded to the store, content-addressed, and the config points there
    assert re.search(
        r"\[sagemaker-local\] data \S*azwiki_sentences_cv_extractor.txt → s3://\S+/data/[0-9a-f]{16}/", out
    )


def assert_cpt_on_two_hosts(proc: subprocess.CompletedProcess) -> str:
    """The image contract for multi-host CPT, with a message that says which part broke."""
    if proc.returncode != 0:
        reason = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "failed" in line][-1:]
        raise AssertionError(
            f"CPT on 2 hosts failed ({reason}): every host must start torchrun from "
            "/opt/ml/input/config/resourceconfig.json (master = the first host)"
        )
    uri = artifacts(proc.stdout)["cpt"]
    size = manifest(uri)["metrics"]["world_size"]
    if size != 2:
        raise AssertionError(
            f"CPT trained with world size {size} on a 2-host job: the image did not start torchrun "
            "across the hosts of /opt/ml/input/config/resourceconfig.json"
        )
    return uri


def test_cpt_ran_on_two_hosts_from_resourceconfig(pipeline):
    assert_cpt_on_two_hosts(pipeline["first"])
    out = pipeline["first"].stdout
    assert re.search(r"algo-2.*host 2 of 2", out) and re.search(r"algo-1.*host 1 of 2", out)
    assert "--master_addr algo-1" in out  # master = the first host
    assert not re.search(r"algo-\d\S* exited with code 143", out), "a host of a successful job reported SIGTERM"


def test_rerun_reuses_every_artifact(pipeline):
    again = pipeline["again"].stdout
    assert "SageMaker local mode" not in again and "running on" not in again
    assert artifacts(again) == pipeline["artifacts"]


def test_the_ids_are_the_local_runs(pipeline, data_root):
    """Issue 32: the same config and data run by `--backend local` into a local folder publish the same ids (the
    local data sagemaker-local uploaded are identified as the local files: manifest.declared_uri)."""
    tmp = pipeline["tmp"]
    raw = yaml.safe_load((tmp / "pipeline.yaml").read_text())
    raw["store"] = {"uri": str(tmp / "local-store")}
    (tmp / "local.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    local = subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", "run-all", "-c", str(tmp / "local.yaml")]
        + ["--data", str(data_root), "--backend", "local"],
        cwd=ROOT,
        env=env(tmp),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert local.returncode == 0, local.stdout[-4000:] + local.stderr[-2000:]
    ids = {stage: uri.rsplit("/", 1)[1] for stage, uri in artifacts(local.stdout).items()}
    assert ids == {stage: uri.rsplit("/", 1)[1] for stage, uri in pipeline["artifacts"].items()}


@pytest.fixture(scope="module")
def one_host(pipeline, data_root):
    """The same CPT on one host (its own store prefix), the reference for 2 hosts and for the spot run."""
    tmp = pipeline["tmp"]
    prefix = f"smlocal-1host-{uuid.uuid4().hex[:8]}"
    cfg = config(tmp, "one-host", prefix, num_cpt_hosts=1, stages=("tokenizer", "cpt"))
    proc = coordinator(
        tmp,
        "run",
        "cpt",
        "-c",
        str(cfg),
        "--data",
        str(data_root),
        "--input",
        f"tokenizer={pipeline['artifacts']['tokenizer']}",
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return artifacts(proc.stdout)["cpt"]


def test_two_hosts_equal_one_host_within_the_world_size_tolerance(pipeline, one_host):
    import torch

    two, one = manifest(pipeline["artifacts"]["cpt"])["metrics"], manifest(one_host)["metrics"]
    assert one["world_size"] == 1
    # the tolerance of tests/integration/test_cpt_multinode.py (1 vs 2 processes): losses to 1e-4 relative
    assert [h["loss"] for h in two["history"]] == pytest.approx([h["loss"] for h in one["history"]], rel=1e-4)
    assert two["final_val_bpb"] == pytest.approx(one["final_val_bpb"], rel=1e-4)
    w2, w1 = load_weights(pipeline["artifacts"]["cpt"], pipeline["tmp"]), load_weights(one_host, pipeline["tmp"])
    assert w2.keys() == w1.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-3, atol=1e-4, msg=name)


def _container(project: str) -> str | None:
    out = subprocess.run(
        [
            DOCKER,
            "ps",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={project}",
            "--filter",
            "label=com.docker.compose.service=algo-1",
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None


def test_spot_interruption_checkpoints_and_the_rerun_resumes_to_the_same_weights(pipeline, one_host, data_root):
    tmp = pipeline["tmp"]
    prefix = f"smlocal-spot-{uuid.uuid4().hex[:8]}"
    cfg = config(tmp, "spot", prefix, num_cpt_hosts=1, stages=("tokenizer", "cpt"))
    args = [
        sys.executable,
        "-m",
        "dilforge_coordinator.cli",
        "run",
        "cpt",
        "-c",
        str(cfg),
        "--data",
        str(data_root),
        "--input",
        f"tokenizer={pipeline['artifacts']['tokenizer']}",
        "--backend",
        "sagemaker-local",
    ]
    proc = subprocess.Popen(args, cwd=ROOT, env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed_at: list[float] = []
    project, saved_s = None, None
    timer = threading.Timer(1200, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"\[cpt\] running on sagemaker-local → (\S+)", line):
                project = f"cpt-{m.group(1).rsplit('/', 1)[1]}"
            if not killed_at and project and re.search(r"step=1[05] phase=2 loss=", line):
                container = _container(project)
                assert container, f"no running container of compose project {project}"
                subprocess.run([DOCKER, "kill", "--signal", "TERM", container], check=True, capture_output=True)
                killed_at.append(time.monotonic())
            if killed_at and saved_s is None and "entrypoint: saved" in line:
                saved_s = time.monotonic() - killed_at[0]
        proc.wait()
    finally:
        timer.cancel()
    out = "".join(lines)
    (tmp / "spot-first.txt").write_text(out)
    assert killed_at, "training never reached phase 2:\n" + out[-4000:]
    assert proc.returncode != 0 and "stopped by SIGTERM" in out, out[-4000:]
    assert saved_s is not None and saved_s < SIGTERM_BUDGET_S, (
        f"checkpoint reached the store {saved_s:.0f} s after SIGTERM"
    )
    ckpt_prefix = f"{prefix}/sagemaker/checkpoints/cpt/"
    keys = [o["Key"] for o in s3().list_objects_v2(Bucket="dilforge", Prefix=ckpt_prefix).get("Contents", [])]
    assert any("/train/step-" in k and "COMPLETE.node" in k for k in keys), keys
    print(f"spot: SIGTERM → checkpoint in the store in {saved_s:.1f} s")

    again = subprocess.run(args, cwd=ROOT, env=env(tmp), capture_output=True, text=True, timeout=1200)
    (tmp / "spot-again.txt").write_text(again.stdout + again.stderr)
    assert again.returncode == 0, again.stdout[-6000:] + again.stderr[-2000:]
    assert "entrypoint: restored" in again.stdout and re.search(r"resumed from checkpoint \S*step-\d+", again.stdout)
    resumed = artifacts(again.stdout)["cpt"]
    # resume is exact on CPU: the weights are the uninterrupted one-host run's, byte for byte
    assert weights_sha(resumed) == weights_sha(one_host)
    # and so is the id, in a fresh store: identity comes from what the inputs are, not where or when they were
    assert resumed.rsplit("/", 1)[1] == one_host.rsplit("/", 1)[1] == pipeline["artifacts"]["cpt"].rsplit("/", 1)[1]


BROKEN = """FROM dilforge-cpt:{tag}
# a broken image contract: each host overwrites SageMaker's resourceconfig.json with a one-host view of itself
ENTRYPOINT ["sh", "-c", "h=$(python3 -c 'import json; print(json.load(open(\\"/opt/ml/input/config/resourceconfig.json\\"))[\\"current_host\\"])'); printf '{{\\"current_host\\": \\"%s\\", \\"hosts\\": [\\"%s\\"]}}' $h $h > /opt/ml/input/config/resourceconfig.json; exec python3 /usr/local/bin/dilforge-entrypoint train"]
"""


def test_an_image_that_ignores_resourceconfig_fails_the_two_host_check_clearly(pipeline, data_root):
    tmp = pipeline["tmp"]
    tag = f"broken-{uuid.uuid4().hex[:6]}"
    build = tmp / "broken"
    build.mkdir()
    (build / "Dockerfile").write_text(BROKEN.format(tag=TAG))
    subprocess.run([DOCKER, "build", "-q", "-t", f"dilforge-cpt:{tag}", str(build)], check=True, capture_output=True)
    try:
        cfg = config(
            tmp, "broken", f"smlocal-broken-{uuid.uuid4().hex[:8]}", num_cpt_hosts=2, stages=("tokenizer", "cpt")
        )
        raw = yaml.safe_load(cfg.read_text())
        raw["cpt"].update(
            phase1={"num_steps": 2, "learning_rate": 0.01},
            phase2={"num_steps": 2, "learning_rate": 0.003, "num_warmup_steps": 1},
        )
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dilforge_coordinator.cli",
                "run",
                "cpt",
                "-c",
                str(cfg),
                "--data",
                str(data_root),
                "--input",
                f"tokenizer={pipeline['artifacts']['tokenizer']}",
                "--backend",
                "sagemaker-local",
            ],
            cwd=ROOT,
            env={**env(tmp), "DILFORGE_IMAGE_TAG": tag},
            capture_output=True,
            text=True,
            timeout=1500,
        )
        (tmp / "broken.txt").write_text(proc.stdout + proc.stderr)
        with pytest.raises(AssertionError, match=r"resourceconfig\.json"):
            assert_cpt_on_two_hosts(proc)
    finally:
        subprocess.run([DOCKER, "image", "rm", "-f", f"dilforge-cpt:{tag}"], capture_output=True)
