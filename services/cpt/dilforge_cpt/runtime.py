"""Where training runs: process group, device, precision and whether FSDP2 shards the model; built once per
process by `init_runtime` and frozen."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from dilforge_shared import runtime_policy
from dilforge_shared.errors import ConfigError

from .config import CptConfig

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass(frozen=True)
class Runtime:
    """This process's place in the run. `fsdp` is decided here, before the model exists."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    distributed: bool = False
    fsdp: bool = False
    node: int = 0
    num_nodes: int = 1

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:  # also a one-rank group (FSDP2 on one GPU): no collective, no sync
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any; over a gloo group, so the per-step stop check does not
        wait behind the step's GPU kernels."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], dtype=torch.float64)
        dist.all_reduce(t, group=_control_group())
        return bool(t.item() > 0)

    def broadcast(self, value):
        """Global rank 0's `value` (a small picklable object) on every rank, over the host-side gloo group."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=_control_group())
        return box[0]

    def autocast(self):
        """The forward's context: bf16 autocast without FSDP (under FSDP2 its MixedPrecisionPolicy casts
        instead)."""
        if self.dtype == torch.bfloat16 and not self.fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()


@functools.cache
def _control_group():
    """The gloo group for host-side flags, made on first use (every rank reaches `Runtime.any` at the
    same points, so they create it together)."""
    return dist.new_group(backend="gloo")


def init_runtime(config: CptConfig) -> Runtime:
    """One process per device, joining the process group under torchrun; device and precision from the shared
    policy (dilforge_shared.runtime_policy)."""
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # bf16 autocast on a CPU with bf16 instructions: the single-process path only (FSDP's mixed precision
    # over gloo is not what CPU runs exercise)
    policy = runtime_policy.decide(
        "cpt", precision=config.precision, liger=config.liger, auto_cpu_bf16=world == 1 and config.fsdp != "on"
    )
    cuda = policy.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) or 1
    node = int(os.environ.get("GROUP_RANK", str(rank // local_world)))
    if world > 1 and config.fsdp == "off":
        raise ConfigError(f"fsdp: 'off' needs a single process; this run has {world} (num_processes_per_node × hosts)")
    fsdp = config.fsdp == "on" or (config.fsdp == "auto" and (world > 1 or cuda))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = config.distributed_backend if config.distributed_backend != "auto" else ("nccl" if cuda else "gloo")
    if distributed or fsdp:
        # one process with FSDP2 gets a one-rank group (an in-memory store), so a single GPU computes in bf16
        # with fp32 master weights (MixedPrecisionPolicy) through the same code path as many GPUs
        alone = {} if distributed else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        device_id = device if backend == "nccl" else None
        dist.init_process_group(backend, timeout=timedelta(minutes=30), device_id=device_id, **alone)
        distributed = True
    dtype = policy.torch_dtype()
    torch.manual_seed(config.seed)
    if rank == 0 and policy.bf16 and not cuda:
        logging.getLogger("dilforge.cpt").info(
            "precision: bf16 autocast over fp32 weights on CPU (cpt.precision %s)", config.precision
        )
    return Runtime(rank, world, local_rank, device, dtype, distributed, fsdp, node, max(1, world // local_world))


def shutdown(rt: Runtime) -> None:
    _control_group.cache_clear()
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()
