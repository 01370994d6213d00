"""The `torchrun` command and environment for one host from SageMaker's resourceconfig.json (torch-free): hosts
sorted, the first is the master; NCCL on the interface SageMaker names; EFA instances get the EFA provider."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.contract import ResourceConfig
from dilforge_shared.errors import DilforgeError

log = logging.getLogger("dilforge.launch")

EFA_INSTANCE_PREFIXES = ("ml.p4d", "ml.p4de", "ml.p5", "ml.p6", "ml.trn1", "ml.trn2", "ml.g6e.48", "ml.gr6")
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


@dataclass
class LaunchPlan:
    """Everything needed to start torchrun on this host."""

    command: list[str]
    env: dict[str, str]
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def build_launch(
    resources: ResourceConfig,
    module_args: Sequence[str],
    nproc_per_node: int,
    master_port: int = 29500,
    python: str | None = None,
    base_env: dict[str, str] | None = None,
) -> LaunchPlan:
    """torchrun command + env for this host: `--standalone` on one host, else static rendezvous on the first
    sorted host at `master_port`."""
    hosts = sorted(resources.hosts)
    if resources.current_host not in hosts:
        raise DilforgeError(f"resourceconfig.json: current_host {resources.current_host!r} is not in hosts {hosts}")
    if nproc_per_node < 1:
        raise DilforgeError(f"torchrun needs at least one process per host, not {nproc_per_node}")
    nnodes = len(hosts)
    node_rank = hosts.index(resources.current_host)
    master_addr = hosts[0]
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        cmd += [
            "--nnodes",
            str(nnodes),
            "--node_rank",
            str(node_rank),
            "--master_addr",
            master_addr,
            "--master_port",
            str(master_port),
        ]
    cmd += ["--nproc_per_node", str(nproc_per_node), *module_args]
    env = dict(base_env if base_env is not None else os.environ)
    # SageMaker names the host's interface (eth0); the SDK's local mode writes `ethwe`, which a Docker container
    # lacks: pointing NCCL/gloo at a missing interface fails the rendezvous, so it is only set when present
    net, nic = Path("/sys/class/net"), resources.network_interface_name
    if nic and nnodes > 1 and (not net.is_dir() or (net / nic).exists()):
        env.setdefault("NCCL_SOCKET_IFNAME", nic)
        env.setdefault("GLOO_SOCKET_IFNAME", nic)
    if (resources.instance_type or "").startswith(EFA_INSTANCE_PREFIXES):
        for key, value in EFA_ENV.items():
            env.setdefault(key, value)
    return LaunchPlan(cmd, env, nnodes, node_rank, nproc_per_node, master_addr)


def wait_for_hosts(
    hosts: Sequence[str],
    timeout_s: float = 300.0,
    interval_s: float = 2.0,
    resolve: Callable[[str], object] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Block until every host name resolves (SageMaker's DNS for algo-N appears a little after start)."""
    resolve = resolve or (lambda h: socket.getaddrinfo(h, None))

    def resolves(host: str) -> bool:
        try:
            resolve(host)
        except OSError:
            return False
        return True

    deadline = time.monotonic() + timeout_s
    while still := [h for h in hosts if not resolves(h)]:
        if time.monotonic() >= deadline:
            raise DilforgeError(f"hosts {still} did not resolve within {timeout_s:.0f} s; check the cluster's network")
        log.info("waiting for hosts to resolve: %s", still)
        sleep(interval_s)


def wait_for_artifact(uri: str, endpoint_url: str | None, timeout_s: float = 3600.0, interval_s: float = 2.0) -> None:
    """Block until the first host has published the artifact: the SDK's local mode ends a job when any host
    exits, which would stop the first host in the middle of publishing."""
    from dilforge_shared.store import artifact_exists

    deadline = time.monotonic() + timeout_s
    while not artifact_exists(uri, endpoint_url):
        if time.monotonic() >= deadline:
            raise DilforgeError(f"{uri}: not published by the first host within {timeout_s:.0f} s")
        time.sleep(interval_s)
