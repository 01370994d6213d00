"""Checkpoints: what a run needs to continue exactly where it stopped.

A checkpoint holds the `TrainState` (state.json, written by global rank 0), the model and optimizer
*state tensors* (DCP shards, one file per rank), every rank's RNG (JSON) and one completion marker
per node. Written into `step-N.tmp` and renamed; only complete checkpoints are ever resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from dilforge_shared.errors import InputError

from .runtime import Runtime

log = logging.getLogger("dilforge.cpt")


# ---- checkpoints ---------------------------------------------------------------------------
# Nothing in a checkpoint is unpickled as arbitrary objects (SageMaker restores /opt/ml/checkpoints
# from S3, so its files are untrusted input): tensors go through DCP and are read with
# weights_only=True, DCP's `.metadata` is read with an allow-listed unpickler (DCP's own metadata
# classes, torch.Size/dtype/layout, PosixPath; no byte blobs), RNG and loop state are JSON.
CKPT_PREFIX = "step-"
MARKER_PREFIX = "COMPLETE.node"


def marker_name(node: int, num_nodes: int) -> str:
    return f"{MARKER_PREFIX}{node:05d}-of-{num_nodes:05d}"


def checkpoint_complete(path: Path) -> bool:
    """Complete = a marker from every node, and every file a marker lists present with its size.

    Each node's local rank 0 writes its marker after its ranks wrote their files; on SageMaker each
    host syncs its own /opt/ml/checkpoints to the same S3 URI, so a checkpoint restored there is
    complete only when all hosts' files (and markers) made it to S3.
    """
    infos = []
    for marker in path.glob(f"{MARKER_PREFIX}*"):
        try:
            infos.append(json.loads(marker.read_text()))
        except (OSError, ValueError):
            return False
    if not infos:
        return False
    try:
        n = int(infos[0]["num_nodes"])
        if sorted(int(i["node"]) for i in infos) != list(range(n)) or any(int(i["num_nodes"]) != n for i in infos):
            return False
        for info in infos:
            for name, size in info["files"].items():
                f = path / name
                if not f.is_file() or f.stat().st_size != int(size):
                    return False
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    return True


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{CKPT_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")
                  and checkpoint_complete(p))


def latest_checkpoint(root: Path) -> Path | None:
    """Newest complete `step-N` folder; half-written `.tmp` folders and partial ones are ignored."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def rng_state() -> dict:
    """Every generator's state as plain JSON types (ints, lists, strings)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt), gauss],
             "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _tensor_state(model, optimizer) -> tuple[dict, dict]:
    """What DCP saves: model and optimizer *state* tensors only. param_groups (hyperparameters)
    come from the config on resume, so no non-tensor value has to be pickled into the checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optimizer)
    saved = {"model": msd, "optim": {"state": osd["state"]}}
    for key, value in _leaves(saved):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"checkpoint entry {key} is a {type(value).__name__}, not a tensor; it would be pickled")
    return saved, osd


def _leaves(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def save_checkpoint(root: Path, step: int, model, optimizer, state: dict, rt: Runtime, keep: int) -> Path:
    """DCP shards (rank-named files) + per-rank RNG (JSON) + state.json, written to `.tmp` then renamed.

    Every node's local rank 0 writes a marker listing the files it sees. Finalisation (rename to
    `step-N`, pruning) then happens once, from global rank 0, when `.tmp` is shared by all nodes
    (rank 0 sees every node's marker: one host, or a shared filesystem); with per-host local
    folders (SageMaker: each host's /opt/ml/checkpoints) each node finalises its own folder.
    """
    import torch.distributed.checkpoint as dcp
    final = root / f"{CKPT_PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    rt.barrier()
    if rt.local_rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    rt.barrier()
    saved, _ = _tensor_state(model, optimizer)
    dcp.save(saved, checkpoint_id=str(tmp))
    (tmp / f"rng-rank{rt.rank:05d}.json").write_text(json.dumps(rng_state()))
    if rt.is_main:
        (tmp / "state.json").write_text(json.dumps(state))
    rt.barrier()
    if rt.local_rank == 0:
        files = {p.name: p.stat().st_size for p in tmp.iterdir()
                 if p.is_file() and not p.name.startswith(MARKER_PREFIX)}
        (tmp / marker_name(rt.node, rt.num_nodes)).write_text(
            json.dumps({"step": step, "node": rt.node, "num_nodes": rt.num_nodes, "files": files}))
    rt.barrier()
    shared = rt.any(rt.is_main and all((tmp / marker_name(k, rt.num_nodes)).is_file() for k in range(rt.num_nodes)))
    if (rt.is_main if shared else rt.local_rank == 0):
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted(p for p in root.glob(f"{CKPT_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    rt.barrier()
    log.info("checkpoint saved: %s", final)
    return final


def read_checkpoint_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def _safe_reader(path: Path):
    """A DCP FileSystemReader whose `.metadata` unpickler only builds DCP's metadata types."""
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    allowed = {
        ("torch.distributed.checkpoint.metadata", name) for name in
        ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
         "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
         ("pathlib", "PurePosixPath")}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in allowed or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                if module == "pathlib":
                    return getattr(pathlib, name)
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = Unpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


def load_checkpoint(path: Path, model, optimizer, rt: Runtime) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    saved, osd = _tensor_state(model, optimizer)
    reader = _safe_reader(path)
    try:  # read once here so a rejected metadata file gives this error, not DCP's wrapped one
        reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise InputError(f"checkpoint metadata rejected ({exc}); delete this checkpoint folder",
                         path=str(path / ".metadata")) from None
    dcp.load(saved, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=saved["model"],
                   optim_state_dict={"state": saved["optim"]["state"], "param_groups": osd["param_groups"]})
    rng = path / f"rng-rank{rt.rank:05d}.json"
    if rng.is_file():
        set_rng_state(json.loads(rng.read_text()))
    log.info("resumed from checkpoint %s", path)


def common_checkpoint(root: Path, rt: Runtime) -> Path | None:
    """The newest checkpoint complete on every host (each checks its own /opt/ml/checkpoints)."""
    mine = [p.name for p in complete_checkpoints(root)]
    if not rt.distributed:
        return root / mine[-1] if mine else None
    import torch.distributed as dist
    everyone: list = [None] * rt.world
    dist.all_gather_object(everyone, mine)
    common = set(everyone[0]).intersection(*everyone[1:])
    if set(mine) - common and rt.local_rank == 0:
        log.warning("checkpoints %s are not complete on every host; ignored", sorted(set(mine) - common))
    return root / max(common) if common else None
