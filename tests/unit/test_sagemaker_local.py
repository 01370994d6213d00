"""`--backend sagemaker-local` without Docker: its one-line errors (region unset, SDK missing, Docker not running,
Compose missing, image not built), the local data upload, the failure reason it reports, the entrypoint's
checkpoint sync that stands in for SageMaker's CheckpointConfig, and the launcher on local mode's `ethwe`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from dilforge_coordinator.backends import sagemaker_local as sml
from dilforge_coordinator.backends.sagemaker import JobSpec, model_trainer
from dilforge_coordinator.backends.sagemaker_local import SageMakerLocalBackend, preflight, upload_local_data
from dilforge_coordinator.cli import app
from dilforge_coordinator.pipeline import StageFailed
from dilforge_cpt.stage import build_launch
from dilforge_shared.contract import ResourceConfig
from dilforge_shared.errors import ConfigError
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


def fake_run(fail: set[str]):
    """subprocess.run stand-in: the commands whose second word is in `fail` exit 1."""

    def run(cmd, **kwargs):
        word = cmd[1] if len(cmd) > 1 else ""
        return subprocess.CompletedProcess(cmd, 1 if word in fail else 0, stdout="sha256:abc\n", stderr="boom")

    return run


@pytest.fixture
def region(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr(sml.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "docker" else None)


def test_region_unset_is_one_line(monkeypatch):
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    with pytest.raises(ConfigError, match=r"^AWS region unset: .*export AWS_DEFAULT_REGION=us-east-1"):
        preflight("docker", fake_run(set()))


def test_docker_not_installed_or_not_running(region, monkeypatch):
    with pytest.raises(ConfigError, match=r"^Docker is not running \(docker info failed\)"):
        preflight("docker", fake_run({"info"}))
    monkeypatch.setattr(sml.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^Docker is not installed \(/no/docker not found\)"):
        preflight("/no/docker", fake_run(set()))


def test_compose_v2_missing(region):
    with pytest.raises(ConfigError, match=r"^Docker Compose v2 is missing"):
        preflight("docker", fake_run({"compose"}))
    assert preflight("docker", fake_run(set())) == "us-east-1"


def test_sdk_missing_is_one_line(region, monkeypatch):
    monkeypatch.setitem(sys.modules, "sagemaker.train.model_trainer", None)
    with pytest.raises(ConfigError, match=r"^the SageMaker Python SDK is not installed .*setup.sh --sagemaker"):
        preflight("docker", fake_run(set()))


def test_image_not_built_names_the_build_command(tmp_path, monkeypatch):
    from dilforge_coordinator import images
    from dilforge_shared.errors import DilforgeError

    def inspect(ref, docker):
        if ref.endswith(":sm"):
            raise DilforgeError(f"docker image inspect {ref}: no such image")
        return {"Id": "sha256:abc", "RepoDigests": []}

    monkeypatch.setattr(images, "inspect", inspect)
    backend = SageMakerLocalBackend(workdir=tmp_path, tag="sm", docker="docker")
    with pytest.raises(
        StageFailed,
        match=r"image dilforge-cpt:sm is not built: coordinator images build "
        r"--stage cpt --tag sm",
    ):
        backend.image("cpt")
    ok = SageMakerLocalBackend(workdir=tmp_path, tag="dev", docker="docker")
    assert ok.image("cpt") == ("dilforge-cpt:dev", "dilforge-cpt:dev@sha256:abc")


def test_cli_reports_the_setup_error_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("DILFORGE_WORKDIR", str(tmp_path))
    result = CliRunner().invoke(
        app,
        [
            "run-all",
            "-c",
            str(ROOT / "configs" / "az-tiny.yaml"),
            "--data",
            str(tmp_path),
            "--backend",
            "sagemaker-local",
        ],
    )
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "AWS region unset" in lines[0], result.output


def test_failure_reason_is_the_first_hosts_failure_file(tmp_path):
    (tmp_path / "algo-2" / "output").mkdir(parents=True)
    (tmp_path / "algo-2" / "output" / "failure").write_text("rendezvous timed out")
    assert SageMakerLocalBackend.failure_reason(tmp_path, 2) == "algo-2: rendezvous timed out"
    (tmp_path / "algo-1" / "output").mkdir(parents=True)
    (tmp_path / "algo-1" / "output" / "failure").write_text("resourceconfig.json: missing field 'hosts'")
    assert SageMakerLocalBackend.failure_reason(tmp_path, 2) == "algo-1: resourceconfig.json: missing field 'hosts'"
    assert SageMakerLocalBackend.failure_reason(tmp_path / "none", 1) is None


def test_local_data_is_uploaded_content_addressed_and_the_config_points_there(monkeypatch, tmp_path):
    import boto3
    import moto

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("DILFORGE_S3_ENDPOINT_URL", raising=False)
    corpus = tmp_path / "az" / "train.txt"
    corpus.parent.mkdir()
    corpus.write_text("Salam dünya.\n")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bkt")
        raw = {
            "tokenizer": {"corpora": [{"uri": str(corpus), "name": "wiki"}], "system_prompt": "Sən köməkçisən."},
            "eval": {"prompts": "builtin:az-generation", "morph": {"segmented": [str(corpus)]}},
            "sft": {"environment": {"HF_HOME": str(tmp_path)}},  # a path, but not a declared input: never uploaded
        }
        declared = {str(corpus)}
        out, moved = upload_local_data(raw, "s3://bkt/store", None, declared)
        assert out["sft"]["environment"]["HF_HOME"] == str(tmp_path)
        uri = out["tokenizer"]["corpora"][0]["uri"]
        assert uri.startswith("s3://bkt/data/") and uri.endswith("/train.txt") and moved == {str(corpus): uri}
        assert out["eval"]["morph"]["segmented"] == [uri]  # one upload per file
        assert (
            out["tokenizer"]["system_prompt"] == "Sən köməkçisən." and out["eval"]["prompts"] == raw["eval"]["prompts"]
        )
        key = uri.removeprefix("s3://bkt/")
        assert s3.get_object(Bucket="bkt", Key=key)["Body"].read() == corpus.read_bytes()
        assert upload_local_data(raw, "s3://bkt/store", None, declared)[0] == out  # same content, same URI: same ids
        corpus.write_text("Bakı.\n")
        assert upload_local_data(raw, "s3://bkt/store", None, declared)[0]["tokenizer"]["corpora"][0]["uri"] != uri


def _entrypoint():
    spec = importlib.util.spec_from_file_location("dilforge_entrypoint", ROOT / "docker" / "entrypoint.py")
    ep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep)
    return ep


def test_entrypoint_checkpoint_sync_saves_after_the_stage_and_restores_before_it(monkeypatch, tmp_path):
    ep = _entrypoint()
    opt, store = tmp_path / "opt", tmp_path / "s3-checkpoints"
    monkeypatch.setenv("DILFORGE_OPT_ML", str(opt))
    ckpt = opt / "checkpoints" / "train" / "step-15"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 15}')
    (ckpt / "COMPLETE.node00000-of-00001").write_text("{}")
    ep.sync_checkpoints(str(store), "save")
    assert (store / "train" / "step-15" / "state.json").read_text() == '{"step": 15}'
    # a new host (a spot restart): /opt/ml/checkpoints is empty until the restore
    new = tmp_path / "opt2"
    monkeypatch.setenv("DILFORGE_OPT_ML", str(new))
    ep.sync_checkpoints(str(store), "restore")
    assert (new / "checkpoints" / "train" / "step-15" / "COMPLETE.node00000-of-00001").is_file()
    # a sync that cannot reach its store logs and leaves the stage's exit status alone
    ep.sync_checkpoints(str(tmp_path / "missing" / "deeper"), "restore")


def test_local_modes_ethwe_interface_is_not_forced_on_gloo(monkeypatch):
    res = ResourceConfig(current_host="algo-2", hosts=["algo-1", "algo-2"], network_interface_name="ethwe-not-here")
    plan = build_launch(res, ["-m", "x"], nproc_per_node=1, base_env={})
    assert "GLOO_SOCKET_IFNAME" not in plan.env and "NCCL_SOCKET_IFNAME" not in plan.env
    assert plan.master_addr == "algo-1" and plan.node_rank == 1 and "--master_addr" in plan.command


def test_local_job_is_the_cloud_job_with_local_compute(monkeypatch, tmp_path):
    """model_trainer builds the local ModelTrainer from the same JobSpec: image, hyperparameters, environment,
    host count are the cloud job's; compute is `local` and the channels are folders."""
    pytest.importorskip("sagemaker.train.model_trainer")
    spec = JobSpec(
        stage="cpt",
        base_job_name="dilforge-cpt-abc",
        image="dilforge-cpt:dev",
        role_arn="arn:aws:iam::123456789012:role/r",
        instance_type="ml.c5.xlarge",
        num_instances=2,
        volume_size_gb=30,
        spot=False,
        max_runtime_s=3600,
        max_wait_s=None,
        input_mode="File",
        channels={"tokenizer": "s3://b/artifacts/tokenizer/t/"},
        output_path="s3://b/out/",
        checkpoint_uri="s3://b/ck/",
        tensorboard_uri="s3://b/tb/",
        environment={"A": "1"},
        hyperparameters={"run_id": "r"},
        tags={"k": "v"},
        metric_definitions=[],
    )
    (tmp_path / "tok").mkdir()
    local = model_trainer(spec, None, local_root=str(tmp_path), local_channels={"tokenizer": str(tmp_path / "tok")})
    assert (local.training_image, local.compute.instance_count, local.compute.instance_type) == (
        "dilforge-cpt:dev",
        2,
        "local",
    )
    assert local.hyperparameters == {"run_id": "r"} and local.environment == {"A": "1"}
    assert local.input_data_config[0].data_source == str(tmp_path / "tok")
    with pytest.raises(Exception, match="needs a folder for channels"):
        model_trainer(spec, None, local_root=str(tmp_path), local_channels={})


def test_checkpoint_metadata_pickled_by_the_images_python_is_read_and_nothing_else(tmp_path):
    """The stage images run Debian's CPython 3.11.2, which pickles enum members as getattr(cls, name): a spot
    rerun must read that DCP `.metadata`, and the getattr must not reach any other attribute."""
    import io
    import pathlib
    import pickle

    import torch
    from dilforge_shared.compat.dcp import safe_dcp_reader as _safe_reader
    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def dump(obj, reduce) -> bytes:
        class Pickler(pickle.Pickler):
            def reducer_override(self, o):
                return reduce(o)

        buf = io.BytesIO()
        Pickler(buf, protocol=4).dump(obj)
        return buf.getvalue()

    def as_3_11_2(obj):
        return (getattr, (type(obj), obj.name)) if isinstance(obj, _MEM_FORMAT_ENCODING) else NotImplemented

    meta = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32), size=torch.Size([2]), chunks=[]
            )
        }
    )
    (tmp_path / ".metadata").write_bytes(dump(meta, as_3_11_2))
    read = _safe_reader(tmp_path).read_metadata()
    assert (
        read.state_dict_metadata["w"].properties.memory_format == meta.state_dict_metadata["w"].properties.memory_format
    )

    def escape(obj):  # getattr used to reach a method of an allowed class: refused
        return (getattr, (pathlib.PosixPath, "write_text")) if isinstance(obj, _MEM_FORMAT_ENCODING) else NotImplemented

    (tmp_path / ".metadata").write_bytes(dump(meta, escape))
    with pytest.raises(pickle.UnpicklingError, match="getattr"):
        _safe_reader(tmp_path).read_metadata()


def test_only_the_containers_a_job_left_are_removed(tmp_path):
    """The SDK's `docker compose up` leaves one exited container per host: after the job those that appeared
    while it ran are removed, never an older one (another run's, kept for inspection)."""
    calls, listings = [], [["old1", "old2"], ["old1", "old2", "algo1", "algo2"]]

    def run(cmd, **kwargs):
        calls.append(cmd)
        out = " ".join(listings.pop(0)) if cmd[1] == "ps" else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    backend = SageMakerLocalBackend(workdir=tmp_path, tag="dev", docker="docker", run=run)
    before = backend.job_containers("dilforge-cpt:dev")
    backend.remove_containers(backend.job_containers("dilforge-cpt:dev") - before)
    assert calls[-1] == ["docker", "rm", "algo1", "algo2"]
    assert "ancestor=dilforge-cpt:dev" in calls[0] and "status=exited" in calls[0]


def test_only_declared_inputs_are_uploaded(tmp_path):
    from dilforge_coordinator.backends.sagemaker_local import declared_inputs
    from dilforge_coordinator.config import PipelineConfig

    corpus = tmp_path / "c.txt"
    corpus.write_text("Salam.\n")
    pipeline = PipelineConfig.model_validate(
        {
            "run_id": "r",
            "store": {"uri": "s3://b/s"},
            "tokenizer": {"corpora": [{"uri": str(corpus)}, {"uri": "s3://b/x.txt"}], "base_tokenizer": "./tok"},
            "sft": {"base_model": "./m", "train": [{"uri": str(corpus)}], "system_prompt": str(tmp_path)},
        }
    )
    assert declared_inputs(pipeline) == {str(corpus), "./tok", "./m"}


def test_an_uploaded_copy_gets_the_local_inputs_artifact_id(monkeypatch, tmp_path, tiny_tokenizer_dir):
    """Issue 32: the same config and data give the same id whether a stage reads them locally or, under
    --backend sagemaker-local, as the copies uploaded to the store (manifest.declared_uri, sha256 metadata)."""
    import boto3
    import moto
    from dilforge_shared.configs import validate_model
    from dilforge_shared.identity import artifact_id, config_refs
    from dilforge_tokenizer.config import TokenizerConfig

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DILFORGE_S3_ENDPOINT_URL", raising=False)
    (tmp_path / "az").mkdir()
    (tmp_path / "az" / "wiki.txt").write_text("Salam dünya.\n" * 50)
    (tmp_path / "az" / "legal.txt").write_text("Maddə 1.\n" * 50)
    raw = {
        "strategy": "extend",
        "base_tokenizer": str(tiny_tokenizer_dir),
        "corpora": [
            {"uri": str(tmp_path / "az" / "wiki.txt"), "weight": 2},
            {"uri": str(tmp_path / "az" / "legal.txt")},
        ],
        "num_new_tokens": [16],
    }

    def planned(doc):
        config = validate_model(TokenizerConfig, doc, "test")
        return artifact_id(config, config_refs(config), version="test")

    local_id = planned(raw)
    with moto.mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="bkt")
        declared = {c["uri"] for c in raw["corpora"]} | {raw["base_tokenizer"]}
        copied, moved = upload_local_data(raw, "s3://bkt/store", None, declared)
        assert all(uri.startswith("s3://bkt/data/") for uri in moved.values()) and len(moved) == 3
        assert planned(copied) == local_id
        # the copy's content is what counts: an object replaced without its digest is another input
        s3 = boto3.client("s3", region_name="us-east-1")
        key = copied["corpora"][0]["uri"].removeprefix("s3://bkt/")
        s3.put_object(Bucket="bkt", Key=key, Body="Bambaşqa.\n".encode())
        assert planned(copied) != local_id
