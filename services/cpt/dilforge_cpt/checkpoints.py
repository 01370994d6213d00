"""The CPT checkpointer: every resumable object is registered with one `Checkpointer` (`load()`, `save(step)`).

`step-N` is written as `step-N.tmp`, sealed with a digest marker per node and renamed; resuming verifies every
file and sets a damaged checkpoint aside. Checkpoints are untrusted (restored from S3): tensors via DCP with an
allow-listed `.metadata` unpickler, the rest JSON."""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from dilforge_shared.compat.dcp import safe_dcp_reader
from dilforge_shared.errors import InputError
from dilforge_shared.training import (
    MARKER_PREFIX,
    digest,
    marker_name,
    read_markers,
    set_aside,
    verify,
    write_marker,
)

from .runtime import Runtime

log = logging.getLogger("dilforge.cpt")

CKPT_PREFIX = "step-"
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|.+-rank(\d+)\.json)$")  # DCP's shard names; our per-rank JSON


Kind = Literal["json", "rank_json", "tensors"]


@dataclass
class Component:
    name: str
    obj: Any  # state_dict() and load_state_dict(state)
    kind: Kind

    def file(self, rank: int) -> str:
        if self.kind == "rank_json":
            return f"{self.name}-rank{rank:05d}.json"
        return "state.json" if self.name == "train_state" else f"{self.name}.json"


def checkpoint_folders(root: Path) -> list[Path]:
    """Finalised `step-N` folders, oldest first (half-written `.tmp` and set-aside ones excluded)."""
    return sorted(p for p in root.glob(f"{CKPT_PREFIX}*") if p.is_dir() and re.fullmatch(r"step-\d+", p.name))


class Checkpointer:
    """Saves and restores every registered component, in registration order: the TrainState first (the model
    component reads its phase to build that phase's optimizer), the RNG last."""

    def __init__(self, root: Path, rt: Runtime, keep: int):
        self.root, self.rt, self.keep = root, rt, keep
        self.components: list[Component] = []

    def register(self, name: str, obj: Any, kind: Kind = "json") -> None:
        self.components.append(Component(name, obj, kind))

    # ---- choosing what to resume --------------------------------------------------------------
    @functools.cache  # noqa: B019 - one Checkpointer per run: decided once, every rank at the same point
    def resume_point(self) -> Path | None:
        """The newest checkpoint complete on every host whose files all verify; damaged ones are set aside on the
        way with a warning."""
        rt = self.rt
        mine = [p.name for p in checkpoint_folders(self.root) if read_markers(p) is not None]
        everyone = self._gather(mine)
        common = set(everyone[0]).intersection(*everyone[1:])
        if set(mine) - common and rt.local_rank == 0:
            log.warning("checkpoints %s are not complete on every host; ignored", sorted(set(mine) - common))
        local_world = max(1, rt.world // rt.num_nodes)
        for name in sorted(common, reverse=True):
            path = self.root / name
            problem = verify(path, slice(rt.local_rank, None, local_world))
            problems = [p for p in self._gather(problem) if p]
            if not problems:
                return path
            if rt.local_rank == 0:
                aside = set_aside(path)
                log.warning(
                    "checkpoint %s is damaged (%s); set aside as %s, trying the previous one",
                    path,
                    problems[0],
                    aside.name if aside else "(already)",
                )
            rt.barrier()
        return None

    @property
    def resume_step(self) -> int:
        path = self.resume_point()
        return int(path.name.removeprefix(CKPT_PREFIX)) if path is not None else 0

    def _gather(self, value) -> list:
        if self.rt.world == 1:
            return [value]
        import torch.distributed as dist

        out: list = [None] * self.rt.world
        dist.all_gather_object(out, value)
        return out

    # ---- load and save ------------------------------------------------------------------------
    def load(self) -> bool:
        """Restore every component from `resume_point()`; False (nothing touched) when there is none."""
        path = self.resume_point()
        if path is None:
            return False
        for comp in self.components:
            if comp.kind == "tensors":
                _load_tensors(path, comp)
            else:
                f = path / comp.file(self.rt.rank)
                if comp.kind == "rank_json" and not f.is_file():  # more ranks now than when it was saved
                    continue
                try:
                    comp.obj.load_state_dict(json.loads(f.read_text()))
                except (OSError, ValueError) as exc:
                    raise InputError(f"checkpoint component {comp.name} unreadable ({exc})", path=str(f)) from None
        log.info("resumed from checkpoint %s", path)
        return True

    def save(self, step: int) -> Path:
        """Every component into `step-N.tmp`, digests in each node's marker, then renamed to `step-N` and pruned
        to `keep`: by global rank 0 when all nodes share the folder, else by each node (SageMaker's per-host
        /opt/ml/checkpoints)."""
        import torch.distributed.checkpoint as dcp

        rt = self.rt
        final = self.root / f"{CKPT_PREFIX}{step:08d}"
        tmp = self.root / f"{final.name}.tmp"
        if rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        rt.barrier()
        if rt.local_rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        rt.barrier()
        tensors = {c.name: c.obj.state_dict() for c in self.components if c.kind == "tensors"}
        if tensors:
            for key, value in _leaves(tensors):  # nothing else may be pickled into the checkpoint
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"checkpoint entry {key} is a {type(value).__name__}, not a tensor; it would be pickled"
                    )
            dcp.save(tensors, checkpoint_id=str(tmp))
        for comp in self.components:
            if comp.kind == "rank_json" or (comp.kind == "json" and rt.is_main):
                (tmp / comp.file(rt.rank)).write_text(json.dumps(comp.obj.state_dict()))
        rt.barrier()
        mine = {}
        for f in sorted(p for p in tmp.iterdir() if p.is_file() and not p.name.startswith(MARKER_PREFIX)):
            owner = _RANK_FILE.match(f.name)  # other files are global rank 0's
            if (int(owner[1] or owner[2]) if owner else 0) == rt.rank:
                mine[f.name] = digest(f)
        by_rank = self._gather((rt.node, mine))
        if rt.local_rank == 0:
            files = {name: entry for node, entries in by_rank if node == rt.node for name, entry in entries.items()}
            write_marker(tmp, files, step, rt.node, rt.num_nodes)
        rt.barrier()
        shared = rt.any(rt.is_main and all((tmp / marker_name(k, rt.num_nodes)).is_file() for k in range(rt.num_nodes)))
        if rt.is_main if shared else rt.local_rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in checkpoint_folders(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        rt.barrier()
        log.info("checkpoint saved: %s", final)
        return final


def _load_tensors(path: Path, comp: Component) -> None:
    """DCP load into the component's state_dict (its layout and shapes, so FSDP2 shards reshard), handed back."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    template = {comp.name: comp.obj.state_dict()}
    reader = safe_dcp_reader(path)
    try:  # read once here so a rejected metadata file gives this error, not DCP's wrapped one
        reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise InputError(
            f"checkpoint metadata rejected ({exc}); delete this checkpoint folder", path=str(path / ".metadata")
        ) from None
    try:
        dcp.load(template, storage_reader=reader)
    except CheckpointException as exc:  # a BaseException: would end the process without a failure file
        first = next(iter(getattr(exc, "failures", {}).values()), exc)
        raise InputError(
            f"checkpoint shards unreadable ({str(first).strip().splitlines()[-1][:300]})", path=str(path)
        ) from None
    comp.obj.load_state_dict(template[comp.name])


# ---- the components the CPT stage registers -----------------------------------------------------
class RngState:
    """This rank's Python, NumPy, torch (and CUDA) generators, as plain JSON types."""

    def state_dict(self) -> dict:
        version, mt, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {
            "python": [version, list(mt), gauss],
            "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist(),
        }
        if torch.cuda.is_available():
            state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict) -> None:
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _leaves(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree
