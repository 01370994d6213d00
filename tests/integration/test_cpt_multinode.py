"""CPT as two simulated SageMaker hosts on 127.0.0.1 (CPU, gloo), through the container entrypoint.

Each host is `python -m dilforge_cpt train` with its own /opt/ml root and a resourceconfig.json naming
both hosts, as SageMaker lays them down; the same hyperparameters (one artifact_uri) go to both. The
stage must take node rank and master from the sorted host list (master = first), join one torchrun
job of world size 2, keep each host's checkpoint in its own /opt/ml/checkpoints with its own node
marker, and publish exactly once, from node 0. A 1-process run of the same config (started
alongside) is the reference: the global batch is only split differently (2 micro-batches
accumulated in one process vs. one per process with FSDP2's averaged reduce-scatter), so losses
agree to 1e-4 relative, the tolerance used for 1 vs 2 processes on one host in test_cpt_stage.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import factories
import pytest

pytestmark = pytest.mark.slow

HOSTS = ["localhost", "127.0.0.1"]  # both this machine; sorted → node 0 = 127.0.0.1 (the master), node 1 = localhost
SCRATCH = factories.TINY_SCRATCH
NUM_STEPS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(data_root: Path, master_port: int):
    from dilforge_cpt.config import CptConfig

    return CptConfig.model_validate(
        {
            "scratch_model": SCRATCH,
            "corpora": [{"uri": str(data_root / "az/train/azwiki_sentences_cv_extractor.txt"), "max_docs": 1000}],
            "validation": [
                {"uri": str(data_root / "az/dev/flores200.dev.partial_from_sib200.tsv"), "text_field": "azj_Latn"}
            ],
            "num_validation_docs": 20,
            "seq_len": 64,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "phase1": {"num_steps": 2, "learning_rate": 0.01},
            "phase2": {"num_steps": 4, "learning_rate": 0.003, "num_warmup_steps": 1},
            "log_every": 1,
            "eval_every": 100,
            "checkpoint_every": 3,
            "num_processes_per_node": 1,
            "master_port": master_port,
            # the single-process reference in fp32 too (auto is bf16 autocast there on a CPU with bf16 instructions)
            "precision": "fp32",
        }
    )


def start_host(opt: Path, hp: dict, resource: dict, log: Path) -> subprocess.Popen:
    """What SageMaker does for one host: lay down /opt/ml/input/config, then run `IMAGE train`."""
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_shared.contract import OPT_ML_ENV, OptMl

    write_inputs(OptMl(opt), hp, resource)
    env = {k: v for k, v in os.environ.items() if k != "DILFORGE_CACHE"}
    env.update({OPT_ML_ENV: str(opt), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dilforge_cpt", "train"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def wait_all(procs: dict[str, subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            proc.kill()
        raise


def manifests(store: Path) -> list[Path]:
    return sorted((store / "artifacts" / "cpt").rglob("manifest.json"))


def test_two_hosts_train_as_one_job_and_only_node_zero_publishes(tmp_path, data_root, tiny_tokenizer_dir):
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_shared.store import fetch

    store, ref_store = tmp_path / "store", tmp_path / "ref-store"
    tok_uri = factories.publish_tokenizer(store, tiny_tokenizer_dir)
    config = tiny_config(data_root, free_port())
    artifact_uri = f"{store}/artifacts/cpt/two-hosts"
    hp = build_hyperparameters(config, artifact_uri, "mn", {"tokenizer": tok_uri})
    procs, logs = {}, {}
    for host in HOSTS:
        logs[host] = tmp_path / f"{host}.log"
        procs[host] = start_host(
            tmp_path / host, hp, {"current_host": host, "hosts": HOSTS, "network_interface_name": "lo"}, logs[host]
        )
    # the reference: the same config on one host, one process (in-process training, no torchrun)
    ref_uri = f"{ref_store}/artifacts/cpt/one-process"
    logs["ref"] = tmp_path / "ref.log"
    procs["ref"] = start_host(
        tmp_path / "ref",
        build_hyperparameters(config, ref_uri, "ref", {"tokenizer": tok_uri}),
        {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"},
        logs["ref"],
    )
    wait_all(procs, timeout_s=180)
    text = {name: path.read_text() for name, path in logs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{text[name][-4000:]}"

    # node rank and master from the sorted hosts: 127.0.0.1 is node 0 and the master
    assert "node 0 of 2" in text["127.0.0.1"] and "node 1 of 2" in text["localhost"]
    for host in HOSTS:
        assert "--master_addr 127.0.0.1" in text[host]
    assert "torch.distributed.run" not in text["ref"]

    # exactly one artifact, published by node 0; node 1 wrote no model files and published nothing
    assert manifests(store) == [Path(artifact_uri) / "manifest.json"]
    assert "published" in text["127.0.0.1"] and "published" not in text["localhost"]
    assert (tmp_path / "127.0.0.1" / "model" / "model.safetensors").is_file()
    assert not [p for p in (tmp_path / "localhost" / "model").rglob("*") if p.is_file()]
    for host in HOSTS:
        assert not (tmp_path / host / "output" / "failure").exists()

    # each host checkpointed into its own /opt/ml/checkpoints, with its own node marker (per-host disks)
    for node, host in enumerate(HOSTS[::-1]):
        step_dir = tmp_path / host / "checkpoints" / "train" / f"step-{NUM_STEPS:08d}"
        markers = sorted(p.name for p in step_dir.glob("COMPLETE.node*"))
        assert markers == [f"COMPLETE.node{node:05d}-of-00002"], (host, markers)
        assert json.loads((step_dir / markers[0]).read_text())["num_nodes"] == 2

    art = fetch(artifact_uri)
    m2, m1 = art.manifest.metrics, fetch(ref_uri).manifest.metrics
    assert (m2["world_size"], m1["world_size"]) == (2, 1)
    assert m2["num_steps"] == m1["num_steps"] == NUM_STEPS
    assert [h["step"] for h in m2["history"]] == list(range(1, NUM_STEPS + 1))
    assert [h["loss"] for h in m2["history"]] == pytest.approx([h["loss"] for h in m1["history"]], rel=1e-4)
    assert m2["final_train_loss"] == pytest.approx(m1["final_train_loss"], rel=1e-4)
    assert m2["final_val_bpb"] == pytest.approx(m1["final_val_bpb"], rel=1e-4)
    assert m2["final_train_loss"] < m2["history"][0]["loss"]  # it trained
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {f.path for f in art.manifest.files}
