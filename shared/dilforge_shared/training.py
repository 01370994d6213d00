"""What the two training stages (CPT, SFT) share: the knob groups their configs inherit fields from (the YAML stays
flat; one name, one meaning, one description per idea), the one training memory estimate (`training_bytes`, which
the `auto` micro-batch and activation checkpointing come from), and the content digests of their checkpoints.

A checkpoint folder is complete with one marker per node (`COMPLETE.nodeNNNNN-of-MMMMM`: the size and sha256
of every file that node wrote), written after its files. Before a resume `verify` recomputes them; a damaged
folder is set aside and the previous checkpoint tried, so damage never reaches published weights. Torch-free."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from .configs import MAX_BATCH, MAX_STEPS, RUN_ONLY, StrictModel, Switch
from .manifest import sha256_file


class Batching(StrictModel):
    """How many sequences make an optimizer step and a forward pass (gradient accumulation is derived)."""

    global_batch_size: int = Field(
        le=MAX_BATCH,
        default=8,
        ge=1,
        description="Sequences per optimizer step across all processes (= micro_batch_size × processes × "
        "gradient accumulation steps, which is derived; must divide evenly).",
    )
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | Literal["auto"] = Field(
        json_schema_extra=RUN_ONLY,
        default="auto",
        description="Sequences per forward pass per process (memory, not results). auto (CPT only) = the largest "
        "divisor of global_batch_size / processes that the memory estimate says fits (CPU: at most 8), logged.",
    )
    eval_micro_batch_size: int | None = Field(
        le=MAX_BATCH,
        json_schema_extra=RUN_ONLY,
        default=None,
        ge=1,
        description="Sequences per validation forward pass per process; None = micro_batch_size.",
    )

    def grad_accum_steps(self, num_processes: int, where: str) -> int:
        """Forward passes per optimizer step per process; ValueError naming the fields when it does not divide."""
        if self.micro_batch_size == "auto":
            raise ValueError(f"{where}micro_batch_size is auto: resolve it before deriving gradient accumulation")
        per_step = self.micro_batch_size * num_processes
        if self.global_batch_size % per_step:
            raise ValueError(
                f"{where}global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"{where}micro_batch_size ({self.micro_batch_size}) × processes ({num_processes})"
            )
        return self.global_batch_size // per_step


class Warmup(StrictModel):
    """Linear warmup from 0 to the peak learning rate: a count of steps, or a share of the steps."""

    num_warmup_steps: int | None = Field(
        le=MAX_STEPS, default=None, ge=0, description="Warmup optimizer steps; None = warmup_ratio (or no warmup)."
    )
    warmup_ratio: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Warmup as a share of the optimizer steps (rounded up); used only when num_warmup_steps is None.",
    )

    def warmup_steps(self, num_steps: int) -> int:
        """The warmup length in optimizer steps for a run of num_steps."""
        if self.num_warmup_steps is not None:
            return self.num_warmup_steps
        return math.ceil(self.warmup_ratio * num_steps) if self.warmup_ratio else 0


class Checkpointing(StrictModel):
    """Resumable checkpoints (cadence, retention) and activation recomputation."""

    checkpoint_every: int = Field(
        json_schema_extra=RUN_ONLY,
        default=200,
        ge=1,
        description="Write a resumable checkpoint every this many optimizer steps (and on SIGTERM).",
    )
    num_checkpoints_kept: int = Field(
        le=100, json_schema_extra=RUN_ONLY, default=2, ge=1, description="Newest complete checkpoints kept on disk."
    )
    activation_checkpointing: Switch = Field(
        json_schema_extra=RUN_ONLY,
        default="off",
        description="Recompute layer activations in backward to save memory at the cost of speed. auto: on where the "
        "memory estimate says training does not fit without it (off on CPU). YAML true/false mean on/off.",
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _bool_is_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads `on`/`off`/`true`/`false` as booleans; a bool switch means on/off."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class SourceLimits(StrictModel):
    """How much of one data source a stage reads (demos, smoke runs)."""

    max_docs: int | None = Field(
        default=None, ge=1, description="Read at most this many documents (records) of this source; None = all."
    )


def training_bytes(
    model_config,
    tokens: int,
    *,
    full: bool,
    bf16: bool,
    world: int = 1,
    checkpointing: bool = False,
    fused_loss: bool = False,
) -> tuple[float, float]:
    """(weight/optimizer bytes per rank, activation bytes for `tokens` tokens per micro-batch): the one training
    memory estimate, for choosing CPT's micro-batch and SFT's activation checkpointing.

    Parameters are counted from the HF config. Full training: 16 B/param sharded over `world` (fp32 weights,
    gradients, AdamW moments) + a 2 B/param bf16 copy; LoRA: the frozen weights in the compute dtype. Activations
    per layer and token: 17·h·dtype bytes with a flash kernel (Korthikanti et al. 2022), h·dtype with
    checkpointing (plus one layer recomputed); the loss (dtype + 8)·V per token (logits, fp32 loss and gradient)
    unless the fused linear cross entropy runs."""
    c = model_config
    h, layers, vocab, inter = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    kv = h * getattr(c, "num_key_value_heads", c.num_attention_heads) // c.num_attention_heads
    embeddings = vocab * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    params = embeddings + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    elem = 2 if bf16 else 4
    state = 16.0 * params / world + 2.0 * params if full else float(elem * params)
    per_layer = (1 if checkpointing else 17) * elem * h
    activations = tokens * (layers * per_layer + (17 * elem * h if checkpointing else 0))
    loss = 0.0 if fused_loss else float(tokens * vocab * (elem + 8))
    return state, activations + loss


MARKER_PREFIX = "COMPLETE.node"


def marker_name(node: int, num_nodes: int) -> str:
    return f"{MARKER_PREFIX}{node:05d}-of-{num_nodes:05d}"


def checkpoint_files(path: Path) -> list[str]:
    """Every regular file under the folder (relative posix paths, sorted), completion markers excluded."""
    return sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*")
        if p.is_file() and not (p.parent == path and p.name.startswith(MARKER_PREFIX))
    )


def digest(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_marker(path: Path, files: dict[str, dict], step: int, node: int = 0, num_nodes: int = 1) -> Path:
    """This node's completion marker (written to a temporary name and renamed: a marker is whole or absent)."""
    marker = path / marker_name(node, num_nodes)
    tmp = path / f".{marker.name}.tmp"
    tmp.write_text(json.dumps({"step": step, "node": node, "num_nodes": num_nodes, "files": files}))
    os.replace(tmp, marker)
    return marker


def seal(path: Path, step: int) -> Path:
    """One process wrote the whole folder: digest every file in it and write the single marker."""
    return write_marker(path, {name: digest(path / name) for name in checkpoint_files(path)}, step)


def read_markers(path: Path) -> list[dict] | None:
    """Every node's marker, if there is one from each node of the same run; None otherwise: not complete yet (e.g.
    a host's files have not reached this folder); a file missing or of another size after that is damage."""
    infos = []
    for marker in sorted(path.glob(f"{MARKER_PREFIX}*")):
        try:
            infos.append(json.loads(marker.read_text()))
        except (OSError, ValueError):
            return None
    try:
        n = int(infos[0]["num_nodes"])
        if sorted(int(i["node"]) for i in infos) != list(range(n)) or any(int(i["num_nodes"]) != n for i in infos):
            return None
        return infos if all(isinstance(i["files"], dict) for i in infos) else None
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        return None


def verify(path: Path, share: slice = slice(None)) -> str | None:
    """None if the files in `share` of this checkpoint's sorted file list match their digests, else what is wrong.
    Every file in the folder must be listed by a marker: an unlisted file is not verified, so it is refused."""
    infos = read_markers(path)
    if infos is None:
        return f"{path.name}: markers missing or unreadable"
    files = {name: entry for info in infos for name, entry in info["files"].items()}
    if unlisted := sorted(set(checkpoint_files(path)) - set(files)):
        return f"{path.name}: files {unlisted} are not listed by any marker"
    for name in sorted(files)[share]:
        entry = files[name]
        if not isinstance(entry, dict) or "sha256" not in entry:
            return f"{path.name}: {name} has no content digest in its marker"
        f = path / name
        if not f.is_file():
            return f"{path.name}: {name} is missing"
        if f.stat().st_size != int(entry["size"]) or sha256_file(f) != entry["sha256"]:
            return f"{path.name}: {name} does not match its sha256 (damaged)"
    return None


def set_aside(path: Path, name: str | None = None) -> Path | None:
    """Rename a damaged checkpoint (default `<name>.damaged`; kept for inspection, never resumed again); None if
    another process set it aside first."""
    base = name or path.name + ".damaged"
    target, n = path.with_name(base), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{base}-{n}")
    try:
        os.replace(path, target)
    except FileNotFoundError:  # another host's rank set aside the same (shared) folder first
        return None
    return target
