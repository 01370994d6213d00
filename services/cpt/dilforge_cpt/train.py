"""The machinery of training: runtime (devices, process group), model build, kernels, FSDP2,
optimizer and schedule, the step, evaluation, checkpoints, metrics. stage.py composes these.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import resource
import shutil
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dilforge_shared.configs.cpt import CptConfig, Phase
from dilforge_shared.errors import ConfigError, InputError

from .data import ValidationSet, validation_batches

log = logging.getLogger("dilforge.cpt")
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Peak dense bf16 tensor-core TFLOP/s per device, for MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "L4": 121.0, "B200": 2250.0, "GH200": 989.0}


# ---- runtime -------------------------------------------------------------------------------
@dataclass
class Runtime:
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
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return self.all_sum([1.0 if flag else 0.0])[0] > 0

    def autocast(self):
        if self.dtype == torch.bfloat16 and not self.fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()


def init_runtime(config: CptConfig) -> Runtime:
    """One process per device; under torchrun (RANK/WORLD_SIZE set) join the process group."""
    cuda = torch.cuda.is_available()
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) or 1
    node = int(os.environ.get("GROUP_RANK", str(rank // local_world)))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        backend = config.distributed_backend if config.distributed_backend != "auto" else ("nccl" if cuda else "gloo")
        dist.init_process_group(backend, timeout=timedelta(minutes=30),
                                device_id=device if backend == "nccl" else None)
    if config.precision == "bf16" or (config.precision == "auto" and cuda):
        dtype = torch.bfloat16
    else:
        dtype = torch.float32
    if world > 1 and config.fsdp == "off":
        raise ConfigError("fsdp: 'off' needs a single process; this run has "
                          f"{world} (num_processes_per_node × hosts)")
    torch.manual_seed(config.seed)
    return Runtime(rank, world, local_rank, device, dtype, distributed, node=node,
                   num_nodes=max(1, world // local_world))


def shutdown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()


# ---- kernels and sharding --------------------------------------------------------------
def apply_liger(model, config: CptConfig, rt: Runtime) -> list[str]:
    """Liger kernels on CUDA only (Triton); returns the kernels applied, for the log and manifest."""
    if not config.liger or not rt.cuda:
        return []
    if model.config.model_type != "llama":
        log.warning("liger: no kernels for model_type %s", model.config.model_type)
        return []
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    kernels = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True}
    apply_liger_kernel_to_llama(cross_entropy=False, model=model, **kernels)
    return sorted(kernels)


def prepare_model(model, config: CptConfig, rt: Runtime) -> Any:
    """Activation checkpointing → torch.compile per layer → FSDP2 (per layer, then root), in that order."""
    model.config.use_cache = False
    if config.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.model.layers
    if config.compile:
        for layer in layers:
            layer.compile()
    use_fsdp = config.fsdp == "on" or (config.fsdp == "auto" and rt.world > 1)
    if use_fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if not rt.distributed:
            raise ConfigError("fsdp: 'on' needs torchrun (set num_processes_per_node) or fsdp: auto")
        model.to(rt.device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if rt.dtype == torch.bfloat16 else MixedPrecisionPolicy()
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        rt.fsdp = True
    else:
        model.to(rt.device)
    model.train()
    return model


# ---- optimisation --------------------------------------------------------------------------
def set_trainable(model, phase: int) -> list[torch.nn.Parameter]:
    """Phase 1: embeddings + LM head only. Phase 2: everything."""
    keep = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = []
    for p in model.parameters():
        p.requires_grad_(phase == 2 or id(p) in keep)
        if p.requires_grad:
            params.append(p)
    return params


def make_optimizer(params: list[torch.nn.Parameter], config: CptConfig, phase: Phase) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": phase.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=phase.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)


def lr_at(phase: Phase, step: int) -> float:
    """Linear warmup to phase.lr, then cosine to phase.lr × min_lr_ratio at the phase's last step."""
    if step < phase.num_warmup_steps:
        return phase.lr * (step + 1) / phase.num_warmup_steps
    span = max(1, phase.num_steps - phase.num_warmup_steps - 1)
    progress = min(1.0, (step - phase.num_warmup_steps) / span)
    return phase.lr * (phase.min_lr_ratio + (1 - phase.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def grad_norm(model, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def train_step(model, optimizer, batches: list[np.ndarray], rt: Runtime, max_grad_norm: float | None) -> tuple[float, float]:
    """Forward/backward over this rank's micro-batches, clip, and (if loss and grad norm are finite) step.

    Returns (mean loss over the global batch, grad norm). On a non-finite loss or gradient norm (a
    finite bf16 loss can still come with inf/NaN gradients) the gradients are dropped and the
    optimizer does not step, so the caller can checkpoint the last good state; every rank sees the
    same reduced loss and norm, so all ranks take the same decision.
    """
    total = torch.zeros((), device=rt.device, dtype=torch.float32)
    for mb in batches:
        x = torch.from_numpy(mb).to(rt.device, non_blocking=True)
        with rt.autocast():
            loss = model(input_ids=x, labels=x).loss / len(batches)
        loss.backward()
        total += loss.detach().float()
    loss_value = rt.all_sum([float(total)])[0] / rt.world
    if not math.isfinite(loss_value):
        optimizer.zero_grad(set_to_none=True)
        return loss_value, float("nan")
    norm = grad_norm(model, max_grad_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return loss_value, norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm


@torch.no_grad()
def evaluate(model, val: ValidationSet, batch_size: int, rt: Runtime) -> dict[str, float]:
    """Validation loss per token and bits per byte: total NLL (nats) / ln 2 / UTF-8 bytes."""
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0.0
    for x, y in validation_batches(val, batch_size, rt.rank, rt.world):
        xt = torch.from_numpy(x).to(rt.device)
        yt = torch.from_numpy(y).to(rt.device)
        with rt.autocast():
            logits = model(input_ids=xt).logits
        nll += float(F.cross_entropy(logits.float().flatten(0, 1), yt.flatten(), ignore_index=-100, reduction="sum"))
        count += float((yt != -100).sum())
    nll, count = rt.all_sum([nll, count])
    reshard(model)
    if was_training:
        model.train()
    return {"val_loss": nll / max(count, 1.0), "val_bpb": nll / math.log(2) / max(val.num_bytes, 1)}


def reshard(model) -> None:
    """After a no_grad forward FSDP2 leaves the root's parameters gathered; a later training forward
    would then use those stale copies after the optimizer updated the shards. Free them explicitly."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# ---- throughput numbers --------------------------------------------------------------------
def flops_per_token(model_config, num_params: int, seq_len: int) -> float:
    """6·N + 12·L·d·T (PaLM appendix B): N = unique parameters − embedding + LM-head matmul."""
    d, layers, vocab = model_config.hidden_size, model_config.num_hidden_layers, model_config.vocab_size
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    matmul_params = num_params if tied else num_params - vocab * d
    return 6.0 * matmul_params + 12.0 * layers * d * seq_len


def peak_flops(config: CptConfig, rt: Runtime) -> float | None:
    if config.peak_tflops_per_device:
        return config.peak_tflops_per_device * 1e12
    if not rt.cuda:
        return None
    name = torch.cuda.get_device_name(rt.device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None


def peak_memory_gb(rt: Runtime) -> float:
    if rt.cuda:
        return torch.cuda.max_memory_allocated(rt.device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


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


# ---- output --------------------------------------------------------------------------------
def save_hf_model(model, out_dir: Path, save_dtype: torch.dtype, rt: Runtime) -> None:
    """Gather the full state dict (collective) and save a plain HF model from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not rt.is_main:
        return
    cfg = model.config
    cfg.use_cache = True
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(full, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch saving the model: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        fresh.tie_weights()
    fresh.to(save_dtype)
    fresh.save_pretrained(str(out_dir), safe_serialization=True)


# ---- metrics -------------------------------------------------------------------------------
class Metrics:
    """TensorBoard (rank 0), parseable stdout lines `key=value`, a tty progress bar, and history."""

    def __init__(self, tb_dir: Path | None, total_steps: int, rt: Runtime, start_step: int):
        self.rt = rt
        self.history: list[dict] = []
        self.validation: list[dict] = []
        self.writer = None
        self.bar = None
        if rt.is_main and tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(tb_dir))
            except ImportError:
                log.warning("tensorboard not installed: no TensorBoard logs")
        if rt.is_main and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="cpt", unit="step")

    def record(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        if not self.rt.is_main:
            return
        row = {"step": step, **values}
        (self.history if kind == "train" else self.validation).append(row)
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and value is not None and math.isfinite(value):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
        text = " ".join(f"{k}={_fmt(v)}" for k, v in row.items())
        if self.bar is not None:
            self.bar.write(text)
        else:
            log.info("%s", text)

    def tick(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.bar is not None:
            self.bar.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
