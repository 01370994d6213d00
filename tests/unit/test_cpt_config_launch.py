"""CptConfig validation and the torchrun launch plan built from SageMaker's resourceconfig.json."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dilforge_cpt.config import CptConfig
from dilforge_cpt.stage import build_launch, wait_for_hosts
from dilforge_shared.configs import validate_model
from dilforge_shared.contract import ResourceConfig
from dilforge_shared.errors import ConfigError, DilforgeError

BASE = {
    "scratch_model": {},
    "corpora": [{"uri": "a.txt", "weight": 3}, {"uri": "en.txt", "weight": 1}],
    "validation": [{"uri": "dev.txt"}],
    "phase1": {"num_steps": 2},
    "phase2": {"num_steps": 3},
}


def cfg(**overrides) -> dict:
    return {**BASE, **overrides}


def test_config_wiring_and_data_sources():
    c = validate_model(CptConfig, cfg(), "t")
    assert (CptConfig.stage, CptConfig.artifact_kind, CptConfig.consumes) == ("cpt", "model", ("model", "tokenizer"))
    assert [s.uri for s in c.data_sources()] == ["a.txt", "en.txt", "dev.txt"]
    assert c.num_steps == 5


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lr": 1e-4}, "lr: Extra inputs are not permitted"),
        ({"phase1": {"num_steps": 1, "peak_lr": 1}}, "phase1.peak_lr: Extra inputs"),
        ({"base_model": "/m"}, "not both"),
        ({"corpora": []}, "corpora: at least one"),
        ({"validation": []}, "validation: at least one"),
        ({"validation": [{"uri": "a/dev.txt"}, {"uri": "b/dev.txt"}]}, "validation: two sources are named"),
        ({"phase1": {"num_steps": 0}, "phase2": {"num_steps": 0}}, "nothing to train"),
        ({"global_batch_size": 6, "micro_batch_size": 4}, "multiple of micro_batch_size"),
        ({"phase2": {"num_steps": 2, "num_warmup_steps": 5}}, "phase2.num_warmup_steps"),
        ({"transplant": "copy"}, "transplant"),
        ({"scratch_model": {"hidden_size": 60, "num_attention_heads": 7}}, "multiple of num_attention_heads"),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(CptConfig, cfg(**overrides), "cpt.yaml")


def test_without_base_model_or_scratch_model_the_model_input_is_needed():
    assert validate_model(CptConfig, cfg(), "t").needed_inputs() == ("tokenizer",)
    assert validate_model(CptConfig, cfg(scratch_model=None), "t").needed_inputs() == ("tokenizer", "model")


def test_launch_multi_host_uses_sorted_hosts_and_efa():
    res = ResourceConfig(
        current_host="algo-2",
        hosts=["algo-3", "algo-1", "algo-2"],
        network_interface_name="eth0",
        instance_type="ml.p5.48xlarge",
    )
    plan = build_launch(
        res, ["-m", "dilforge_cpt", "worker"], nproc_per_node=8, master_port=29400, python="py", base_env={}
    )
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.nproc_per_node, plan.world_size) == (
        3,
        1,
        "algo-1",
        8,
        24,
    )
    assert plan.command == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "3",
        "--node_rank",
        "1",
        "--master_addr",
        "algo-1",
        "--master_port",
        "29400",
        "--nproc_per_node",
        "8",
        "-m",
        "dilforge_cpt",
        "worker",
    ]
    assert plan.env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert plan.env["FI_PROVIDER"] == "efa" and plan.env["FI_EFA_USE_DEVICE_RDMA"] == "1"


def test_launch_single_host_is_standalone_without_efa():
    res = ResourceConfig(current_host="algo-1", hosts=["algo-1"], instance_type="ml.g5.xlarge")
    plan = build_launch(res, ["-m", "x"], nproc_per_node=2, python="py", base_env={})
    assert plan.command[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nnodes"]
    assert plan.world_size == 2 and "FI_PROVIDER" not in plan.env
    with pytest.raises(DilforgeError, match="at least one process per host"):
        build_launch(res, ["-m", "x"], nproc_per_node=0, python="py", base_env={})


def test_launch_rejects_a_host_outside_the_cluster():
    with pytest.raises(DilforgeError, match="not in hosts"):
        build_launch(ResourceConfig(current_host="algo-9", hosts=["algo-1"]), ["-m", "x"], nproc_per_node=1)


def test_wait_for_hosts_retries_until_names_resolve():
    calls = {"algo-2": 0}

    def resolve(host):
        if host == "algo-2":
            calls[host] += 1
            if calls[host] < 3:
                raise OSError("not yet")

    wait_for_hosts(["algo-1", "algo-2"], timeout_s=60, interval_s=0, resolve=resolve, sleep=lambda s: None)
    assert calls["algo-2"] == 3
    with pytest.raises(DilforgeError, match=r"\['algo-9'\] did not resolve"):
        wait_for_hosts(
            ["algo-9"],
            timeout_s=0,
            interval_s=0,
            resolve=lambda h: (_ for _ in ()).throw(OSError()),
            sleep=lambda s: None,
        )


def test_liger_on_without_cuda_is_a_config_error_naming_the_field(monkeypatch):
    import torch
    from dilforge_cpt.runtime import init_runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="cpt.liger: the Liger kernels need CUDA"):
        init_runtime(validate_model(CptConfig, cfg(liger="on"), "t"))


@pytest.mark.parametrize(("published", "ends"), [(True, "exit 0"), (False, "Terminated")])
def test_a_later_host_stopped_while_its_torchrun_ends_is_done_once_the_first_host_published(
    tmp_path, monkeypatch, published, ends
):
    """Local mode stops the other hosts as soon as the first exits; a later host whose torchrun was still shutting
    down then gets SIGTERM inside `run_workers`. Once the artifact is published that is the job's normal end (it
    was a flaky `algo-2 exited with code 143`); before, it is a real stop."""
    from types import SimpleNamespace

    import dilforge_cpt.stage as stage
    from dilforge_shared.contract import Terminated

    def interrupted(plan, ctx):
        raise Terminated("stopped by SIGTERM after checkpointing; rerun to resume")

    plan = SimpleNamespace(world_size=2, nnodes=2, node_rank=1)
    monkeypatch.setattr(stage, "build_launch", lambda *a, **k: plan)
    monkeypatch.setattr(stage, "wait_for_hosts", lambda hosts: None)
    monkeypatch.setattr(stage, "run_workers", interrupted)
    monkeypatch.setattr(stage, "artifact_exists", lambda uri, endpoint: published)
    ctx = SimpleNamespace(
        resources=SimpleNamespace(hosts=["algo-1", "algo-2"]),
        request=SimpleNamespace(artifact_uri="s3://b/store/artifacts/cpt/0123456789abcdef"),
        endpoint_url=None,
        opt=SimpleNamespace(output_dir=tmp_path),
    )
    config = CptConfig.model_validate({**BASE, "num_processes_per_node": 1})
    if ends == "exit 0":
        assert stage.run(config, ctx).metrics == {}
    else:
        with pytest.raises(Terminated):
            stage.run(config, ctx)


@pytest.mark.slow  # two processes import torch
def test_kill_9_of_the_launcher_takes_torchrun_and_its_workers_with_it(tmp_path):
    """`kill -9` of the CPT stage while torchrun runs: torchrun (here a stand-in) dies with it and the workers
    (`python -m dilforge_cpt worker`) die with torchrun, so none keeps training into the work folder a rerun
    resumes from."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    worker = textwrap.dedent("""
        import sys, time
        import dilforge_cpt.__main__ as entry
        entry.stage_main = lambda *a, **k: (print("worker up", flush=True), time.sleep(120))
        entry.main(["worker"])
    """)
    torchrun = textwrap.dedent(f"""
        import subprocess, sys, time
        w = subprocess.Popen([sys.executable, "-c", {worker!r}], stdout=subprocess.PIPE, text=True)
        assert w.stdout.readline().strip() == "worker up"
        print(w.pid, flush=True)
        time.sleep(120)
    """)
    launcher = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from types import SimpleNamespace
        from dilforge_cpt import stage
        out = Path(sys.argv[1])
        plan = SimpleNamespace(command=[sys.executable, "-c", {torchrun!r}], env=dict(os.environ), nproc_per_node=2,
                               node_rank=0, nnodes=1)
        stage.run_workers(plan, SimpleNamespace(opt=SimpleNamespace(output_dir=out, failure_file=out / "failure")))
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(proc.stdout.readline())
        (torchrun_pid,) = [int(p) for p in Path(f"/proc/{worker_pid}/stat").read_text().split()[3:4]]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in (torchrun_pid, worker_pid)):
            assert time.monotonic() < deadline, "torchrun or its worker outlived the killed stage"
            time.sleep(0.1)
    finally:
        proc.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


LATER_HOST = """
import os, signal, sys, time, types
import dilforge_cpt.stage as stage

published = sys.argv[1] == "published"
stage.published_by_first_host = lambda ctx: published
ctx = types.SimpleNamespace(request=types.SimpleNamespace(artifact_uri="file:///x"), endpoint_url=None)
if sys.argv[2] == "during-wait":  # local mode's stop arrives while the host waits for the publish
    stage.wait_for_artifact = lambda uri, endpoint_url: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5))
else:  # the publish was seen; the stop arrives while this process exits
    stage.wait_for_artifact = lambda uri, endpoint_url: None
try:
    stage.stay_until_published(ctx)
except stage.Terminated as exc:
    print(exc)
    sys.exit(3)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("exited normally")
"""


@pytest.mark.parametrize(
    "published, when, code, said",
    [
        ("published", "after-wait", 0, "exited normally"),
        ("published", "during-wait", 0, ""),
        ("unpublished", "during-wait", 3, "stopped by SIGTERM while waiting for the first host to publish"),
    ],
)
def test_a_later_host_stopped_after_the_publish_exits_0(tmp_path, published, when, code, said):
    """SageMaker's local mode SIGTERMs the other hosts as soon as the first exits; once the artifact is published
    that stop, wherever it falls in a later host's exit, is the job's normal end (0, not 143); before, a failure."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", LATER_HOST, published, when],
        env={"PYTHONPATH": os.pathsep.join(sys.path), "PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stderr[-2000:]
    assert said in proc.stdout
