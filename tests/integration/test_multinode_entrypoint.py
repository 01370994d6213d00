"""Two simulated SageMaker hosts on 127.0.0.1 (CPU, gloo): each runs the image entrypoint with its own
/opt/ml root and a resourceconfig.json naming both hosts; torchrun joins them into one process group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.py"

PROBE = '''
import json, os, pathlib, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
out = pathlib.Path(os.environ["DILFORGE_OPT_ML"]) / "model"
out.mkdir(parents=True, exist_ok=True)
keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
(out / f"rank-{dist.get_rank()}.json").write_text(json.dumps({"sum": value.item(), **{k: os.environ.get(k) for k in keys}}))
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_hosts_form_one_process_group(tmp_path):
    (tmp_path / "mnprobe.py").write_text(PROBE)
    hosts = ["localhost", "127.0.0.1"]            # both resolve to this machine; sorted → master 127.0.0.1
    port = str(free_port())
    procs = {}
    for host in hosts:
        opt = tmp_path / host
        (opt / "input" / "config").mkdir(parents=True)
        (opt / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
            {"current_host": host, "hosts": hosts, "network_interface_name": "lo"}))
        env = {**os.environ, "DILFORGE_STAGE": "sft", "DILFORGE_STAGE_MODULE": "mnprobe", "DILFORGE_OPT_ML": str(opt),
               "DILFORGE_LAUNCHER": "torchrun", "DILFORGE_NPROC_PER_NODE": "1", "DILFORGE_MASTER_PORT": port,
               "DILFORGE_HOST_WAIT_S": "30", "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
        procs[host] = subprocess.Popen([sys.executable, str(ENTRYPOINT), "train"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = {}
    for host, proc in procs.items():
        try:
            outputs[host] = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert proc.returncode == 0, f"{host}:\n{outputs[host][-3000:]}"
    master = json.loads((tmp_path / "127.0.0.1" / "model" / "rank-0.json").read_text())
    worker = json.loads((tmp_path / "localhost" / "model" / "rank-1.json").read_text())
    assert master["sum"] == worker["sum"] == 3.0             # 1 + 2 across the two hosts
    assert (master["GROUP_RANK"], worker["GROUP_RANK"]) == ("0", "1")
    assert master["WORLD_SIZE"] == worker["WORLD_SIZE"] == "2"
    assert master["MASTER_ADDR"] == worker["MASTER_ADDR"] == "127.0.0.1"
    assert master["NCCL_SOCKET_IFNAME"] == worker["NCCL_SOCKET_IFNAME"] == "lo"
    assert "node 1/2" in outputs["localhost"] and "node 0/2" in outputs["127.0.0.1"]
