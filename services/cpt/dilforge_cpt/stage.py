"""CPT stage: adapt a Llama-family model to a new language and its new tokenizer.

`run` trains here or starts torchrun (`build_launch`) on `worker`; node 0 publishes. Each process: runtime → token
cache → packed data → validation → resume point → base model → transplant → Liger, compile, FSDP2 → `train_loop` →
HF folder."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from dilforge_shared.contract import (
    ResourceConfig,
    StageContext,
    StageResult,
    Terminated,
    install_sigterm_handler,
    log_config,
)
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.models import TOKENIZER_FILES, resolve
from dilforge_shared.settings import settings
from dilforge_shared.specials import describe_model_folder
from dilforge_shared.store import artifact_exists, open_backend
from dilforge_shared.workers import available_cpus, die_with_parent

from .checkpoints import Checkpointer, RngState
from .config import CptConfig
from .data import (
    PackedData,
    TokenFile,
    build_validation,
    cache_key,
    load_tokenizer,
    special_ids,
    tokenize_to_file,
    wait_ready,
    write_json,
    write_ready,
)
from .leakage import build_probe
from .loop import LoopSetup, TrainState, train_loop
from .metrics import CptMetrics
from .model_init import initialise, load_model, locate_base_model, row_masks
from .optim import TrainingModel
from .reporting import MetricsLog, flops_per_token, peak_flops
from .runtime import Runtime, init_runtime, shutdown
from .sharding import apply_liger, resolve_memory, save_hf_model, shard_model
from .validation import bpb_by_set, evaluate, window_and_stride

log = logging.getLogger("dilforge.cpt")

RESULT_FILE = "cpt-result.json"
STOP_FILE = "cpt-stop"  # in /opt/ml/output: the launcher's "checkpoint and exit" request to its workers
STOP_GRACE_S = 110.0  # SageMaker SIGKILLs 120 s after SIGTERM; torchrun is signalled only after this


# ---- torchrun on this host, from SageMaker's resourceconfig.json --------------------------------
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
    sorted host at `master_port`; NCCL on the interface SageMaker names, EFA instances get the EFA provider."""
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
    deadline = time.monotonic() + timeout_s
    while not artifact_exists(uri, endpoint_url):
        if time.monotonic() >= deadline:
            raise DilforgeError(f"{uri}: not published by the first host within {timeout_s:.0f} s")
        time.sleep(interval_s)


# ---- entry points --------------------------------------------------------------------------
def run(config: CptConfig, ctx: StageContext) -> StageResult:
    """`train`: one process trains here; more go through torchrun and this process waits."""
    stop_file(ctx).unlink(missing_ok=True)
    nproc = config.num_processes_per_node or max(1, torch.cuda.device_count())
    plan = build_launch(
        ctx.resources, ["-m", "dilforge_cpt", "worker"], nproc_per_node=nproc, master_port=config.master_port
    )
    if plan.world_size > 1:
        if plan.nnodes > 1:
            wait_for_hosts(ctx.resources.hosts)
        try:
            metrics = run_workers(plan, ctx)
        except Terminated:
            # the first host may publish and exit (local mode then stops this one) while this host's torchrun
            # is still shutting down: that SIGTERM is the job's normal end too
            if plan.node_rank > 0 and published_by_first_host(ctx):
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return StageResult(metrics={})
            raise
        if plan.node_rank > 0:
            stay_until_published(ctx)
    else:
        metrics = train(config, ctx)
    return StageResult(metrics=metrics)


def worker(config: CptConfig, ctx: StageContext) -> StageResult:
    """`worker`: one torchrun process; global rank 0 leaves the metrics for the launcher. Stopped by the stop
    file, it checkpoints and exits 0 (rank 0 leaves the reason): the launcher reports the stop, torchrun no
    ChildFailedError."""
    first = os.environ.get("RANK", "0") == "0"
    try:
        metrics = train(config, ctx)
    except Terminated as exc:
        if not stop_file(ctx).exists():
            raise
        if first:
            ctx.opt.failure_file.write_text(str(exc))
        return StageResult(metrics={})
    if first:
        write_json(ctx.opt.output_dir / RESULT_FILE, metrics)
    return StageResult(metrics=metrics)


def stay_until_published(ctx: StageContext) -> None:
    """A later host stays up until the first host has published, then ignores SIGTERM: local mode stops it when
    the first host exits, the job's normal end, not a failure (exit 143)."""

    def end_once_published(signum, frame):
        if published_by_first_host(ctx):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise SystemExit(0)
        raise Terminated("stopped by SIGTERM while waiting for the first host to publish")

    previous = signal.signal(signal.SIGTERM, end_once_published)
    try:
        wait_for_artifact(ctx.request.artifact_uri, ctx.endpoint_url)
    except Exception:
        signal.signal(signal.SIGTERM, previous)
        raise
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kept through interpreter exit (CPython restores only handlers)


def published_by_first_host(ctx: StageContext) -> bool:
    """True (and says so) when the artifact this job makes is published: a later host's work is then done."""
    if artifact_exists(ctx.request.artifact_uri, ctx.endpoint_url):
        log.info("the first host published %s; this host is done", ctx.request.artifact_uri)
        return True
    return False


def stop_file(ctx: StageContext) -> Path:
    return ctx.opt.output_dir / STOP_FILE


def run_workers(plan, ctx: StageContext, grace_s: float = STOP_GRACE_S) -> dict:
    """Run torchrun and surface a worker's failure message.

    SIGTERM is not forwarded (torchrun SIGKILLs its workers too soon to checkpoint): this process creates the stop
    file, which the workers poll each step, checkpoint and exit; torchrun is signalled only `grace_s` later."""
    result = ctx.opt.output_dir / RESULT_FILE
    ctx.opt.output_dir.mkdir(parents=True, exist_ok=True)
    for stale in (result, ctx.opt.failure_file, stop_file(ctx)):
        stale.unlink(missing_ok=True)
    log.info(
        "launching %d processes on this host (node %d of %d): %s",
        plan.nproc_per_node,
        plan.node_rank,
        plan.nnodes,
        " ".join(plan.command),
    )
    # torchrun dies with this process, even by `kill -9` (its workers die with torchrun: __main__), so no orphan
    # keeps training into the work folder that a rerun resumes from
    proc = subprocess.Popen(
        plan.command,
        env=plan.env,
        preexec_fn=functools.partial(die_with_parent, os.getpid()),  # noqa: PLW1509 - prctl only
    )
    stopped_at: list[float] = []

    def request_stop(signum, frame):
        if not stopped_at:
            stopped_at.append(time.monotonic())
            stop_file(ctx).write_text("SIGTERM")
            log.warning("SIGTERM received: asked the workers to checkpoint and exit (stop file %s)", stop_file(ctx))

    previous = signal.signal(signal.SIGTERM, request_stop)
    try:
        signalled = False
        while (rc := proc.poll()) is None:
            if stopped_at and not signalled and time.monotonic() - stopped_at[0] > grace_s:
                log.warning("workers still running %.0f s after SIGTERM: sending SIGTERM to torchrun", grace_s)
                proc.send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_file(ctx).unlink(missing_ok=True)
    reason = ctx.opt.failure_file.read_text() if ctx.opt.failure_file.exists() else ""
    if stopped_at and (rc != 0 or not result.exists()):  # the workers checkpointed and exited on the stop file
        raise Terminated(reason or "stopped by SIGTERM after checkpointing; rerun to resume")
    if rc != 0:
        raise DilforgeError(reason or f"training workers failed (torchrun exit code {rc}); see the log above")
    if plan.node_rank != 0:
        return {}
    return json.loads(result.read_text())


def build_cache(config: CptConfig, ctx: StageContext) -> StageResult:
    """`build-cache`: only the token cache, into the checkpoint folder, on every CPU (e.g. a Processing job before
    the GPU training job); nothing is published. An earlier build at $DILFORGE_TOKEN_CACHE_URI is restored first,
    so a rerun verifies and reuses it."""
    if uri := settings().token_cache_uri:
        restore_token_cache(uri, ctx)
    tok_dir = resolve(ctx.input("tokenizer"), "tokenizer").path
    tok = load_tokenizer(tok_dir)
    files = tokenize_corpora(config, ctx, Runtime(), tok, special_ids(tok, str(tok_dir)), tok_dir)
    return StageResult(
        metrics={"token_cache": {tf.label: {"num_tokens": tf.num_tokens, "num_docs": tf.num_docs} for tf in files}}
    )


def restore_token_cache(uri: str, ctx: StageContext) -> None:
    """Add an earlier build's cache files to this job's cache folder (each is verified before use); not
    `models.mirror_prefix`, which replaces the whole folder."""
    backend = open_backend(uri.rstrip("/"), ctx.endpoint_url)
    local = ctx.opt.checkpoint_dir / "tokens"
    keys = [k for k in backend.list("") if not k.rsplit("/", 1)[-1].startswith(".")]  # not another job's markers
    for key in keys:
        backend.download_file(key, local / key)
    log.info("restored %d token cache files from %s", len(keys), uri)


# ---- the training story ----------------------------------------------------------------------
def train(config: CptConfig, ctx: StageContext) -> dict:
    rt = init_runtime(config)
    try:
        return train_in_process(config, ctx, rt)
    finally:
        shutdown(rt)


def train_in_process(config: CptConfig, ctx: StageContext, rt: Runtime) -> dict:
    if rt.is_main:
        log_config(config)  # before any work: the derived numbers follow once the model is built
    stop = install_sigterm_handler()
    stop_path = stop_file(ctx)  # created by the launcher (multi-process runs) on SIGTERM
    if config.micro_batch_size != "auto":
        grad_accum_steps(config, rt.world)  # a bad batch split fails before any data is read

    # data: tokenizer → token cache → packed windows + sampler; validation set
    tok_dir = resolve(ctx.input("tokenizer"), "tokenizer").path
    tok = load_tokenizer(tok_dir)
    ids = special_ids(tok, str(tok_dir))
    files = tokenize_corpora(config, ctx, rt, tok, ids, tok_dir)
    data = PackedData(files, [c.weight for c in config.corpora], config.seq_len, config.seed)
    val = build_validation(config.validation, tok, ids, config.num_validation_docs, ctx.endpoint_url)

    # where the loop starts: a fresh state, or the newest checkpoint complete on every host that verifies
    checkpointer = Checkpointer(ctx.opt.checkpoint_dir / "train", rt, config.num_checkpoints_kept)
    resume = checkpointer.resume_point()
    state = TrainState()

    # the model: base (or scratch) → transplant → step-0 BPB and leakage
    base = locate_base_model(config, ctx, rt)
    model, pending, transplant_report = load_model(config, base, tok, ids, rt)
    micro_batch, checkpointing, memory_reason = resolve_memory(config, rt, model.config)
    if rt.is_main:
        log.info("micro_batch_size %d, activation checkpointing %s (%s)", micro_batch, checkpointing, memory_reason)
    config = config.model_copy(
        update={"micro_batch_size": micro_batch, "activation_checkpointing": "on" if checkpointing else "off"}
    )
    grad_accum = grad_accum_steps(config, rt.world)
    probe = None
    if pending is not None and config.measure_leakage:
        probe, why = build_probe(config, pending.base_tok, pending.mapping, tok, ids, ctx.endpoint_url)
        if probe is None:
            transplant_report["leakage_not_measured"] = why
            log.info("leakage not measured: %s", why)
    step0 = step0_leakage = None
    if pending is not None and resume is None:
        step0, step0_leakage = initialise(model, pending, val, config, rt, probe)
    elif pending is not None:
        log.info(
            "resuming from %s: transplant and step-0 scoring skipped (the checkpoint holds the model)", resume.name
        )
    if resume is None:
        state.transplant = transplant_report
    vocab = tok.get_vocab_size(with_added_tokens=True)
    new_rows, kept_rows = row_masks(config, pending, vocab, scratch=base is None)

    kernels = apply_liger(model, config, rt)
    log.info("liger kernels applied: %s", ", ".join(kernels) if kernels else "none (CPU or liger: off)")
    num_params = sum(p.numel() for p in model.parameters())
    model = shard_model(model, config, rt)

    fpt = {phase: flops_per_token(model.config, num_params, config.seq_len, phase) for phase in (1, 2)}
    window, stride = window_and_stride(config)
    tokens_per_step = config.global_batch_size * config.seq_len
    derived = {
        "world_size": rt.world,
        "micro_batch_size": micro_batch,
        "activation_checkpointing": checkpointing,
        "grad_accum_steps": grad_accum,
        "global_batch_sequences": config.global_batch_size,
        "global_batch_tokens": tokens_per_step,
        "total_tokens": tokens_per_step * config.num_steps,
        "num_params": num_params,
        "vocab_size": model.config.vocab_size,
        "flops_per_token": fpt[2],
        "flops_per_token_phase1": fpt[1],
        "device": str(rt.device),
        "dtype": str(rt.dtype).removeprefix("torch."),
        "fsdp": rt.fsdp,
        "liger_kernels": kernels,
        "train_windows": {tf.label: tf.windows(config.seq_len) for tf in files},
        "tokenizer_family": ids.family,
        "phase1_trainable_rows": int(new_rows.sum()) if new_rows is not None else None,
        "validation_sets": {
            vs.name: {
                "docs": vs.stream.num_docs,
                "bytes": vs.stream.num_bytes,
                "text_tokens": vs.stream.num_text_tokens,
            }
            for vs in val
        },
        "validation_window": window,
        "validation_stride": stride,
        "resume_from": resume.name if resume is not None else None,
    }
    if rt.is_main:
        log.info("derived: %s", json.dumps(derived, sort_keys=True, default=str))

    metrics = MetricsLog(ctx.opt.tensorboard_dir, config.num_steps, rt, checkpointer.resume_step)
    if resume is None:
        step0 = step0 if step0 is not None else evaluate(model, val, config, rt)
        state.add_validation(metrics.record(0, step0, kind="validation"))
        if probe is not None:
            state.leakage.append({"step": 0, "sets": step0_leakage})

    training = TrainingModel(model, config, rt, state, new_rows, kept_rows)
    checkpointer.register("train_state", state)  # first: the model component builds the optimizer of its phase
    checkpointer.register("model", training, kind="tensors")
    checkpointer.register("rng", RngState(), kind="rank_json")
    setup = LoopSetup(
        config=config,
        rt=rt,
        checkpointer=checkpointer,
        metrics=metrics,
        stop_requested=lambda: stop["stop"] or stop_path.exists(),
        flops_per_token=fpt,
        peak_flops=peak_flops(config, rt),
        leakage_probe=probe,
    )
    try:
        state = train_loop(training, data, val, state, setup)
    finally:
        metrics.close()  # also on a stop or an error: the progress heartbeat ends with the loop

    publish_files(config, ctx, rt, model, tok_dir, state)
    return summarize(state, derived).model_dump()


def publish_files(config: CptConfig, ctx: StageContext, rt: Runtime, model, tok_dir: Path, state: TrainState) -> None:
    """The HF folder: weights (gathered from every rank), the tokenizer files, cpt_metrics.json."""
    if rt.is_main:
        ctx.opt.model_dir.mkdir(parents=True, exist_ok=True)
    # auto on CPU keeps fp32 weights: bf16 there is autocast arithmetic, and CPU consumers compute in fp32
    auto = rt.dtype if rt.cuda else torch.float32
    save_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "auto": auto}[config.save_dtype]
    save_hf_model(model, ctx.opt.model_dir, save_dtype, rt)
    if rt.is_main:
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy2(tok_dir / name, ctx.opt.model_dir / name)
        family, ids = describe_model_folder(ctx.opt.model_dir)
        log.info("model folder describes the %s family: %s", family.name, ids)
        record = dict(
            train=state.history, validation=state.validation, transplant=state.transplant, leakage=state.leakage
        )
        (ctx.opt.model_dir / "cpt_metrics.json").write_text(json.dumps(record, indent=1))
    rt.barrier()


def summarize(state: TrainState, derived: dict) -> CptMetrics:
    """The manifest's metrics, built as the typed model (a misnamed or missing figure fails here, in the stage)."""
    first_val = state.validation[0] if state.validation else {}
    timed = [h for h in state.history if h.get("tokens_per_s")]
    return CptMetrics(
        num_steps=state.step,
        tokens_seen=state.tokens_seen,
        final_train_loss=state.last_loss,
        final_val_loss=state.last_val.get("val_loss"),
        final_val_bpb=state.last_val.get("val_bpb"),
        final_val_bpb_by_set=bpb_by_set(state.last_val),
        best_val_bpb=state.best_val_bpb,
        step0_val_loss=first_val.get("val_loss"),
        step0_val_bpb=first_val.get("val_bpb"),
        step0_val_bpb_by_set=bpb_by_set(first_val),
        transplant=state.transplant,
        leakage=state.leakage,
        tokens_per_s=timed[-1]["tokens_per_s"] if timed else None,
        mfu=timed[-1]["mfu"] if timed else None,
        peak_memory_gb=max((h["peak_memory_gb"] for h in state.history), default=None),
        eval_peak_memory_gb=max(
            (v["eval_peak_memory_gb"] for v in state.validation if v.get("eval_peak_memory_gb") is not None),
            default=None,
        ),
        history=state.history,
        validation=state.validation,
        **{k: derived[k] for k in CptMetrics.model_fields if k in derived},
    )


# ---- pieces ----------------------------------------------------------------------------------
def grad_accum_steps(config: CptConfig, world: int) -> int:
    try:
        return config.grad_accum_steps(world, "cpt.")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def tokenize_corpora(config: CptConfig, ctx: StageContext, rt: Runtime, tok, ids, tok_dir: Path) -> list[TokenFile]:
    """The token cache, built once per cache folder (global rank 0 on a shared folder, else local rank 0 per
    host) while the others wait for its ready marker, which carries this job's id."""
    cache = ctx.opt.checkpoint_dir / "tokens"
    workers = config.tokenize_workers or available_cpus()

    def build() -> list[TokenFile]:
        if rt.is_main:
            log.info("token cache: %d tokenizer workers", workers)
        url, batch = ctx.endpoint_url, config.tokenize_batch_size
        keys = [cache_key(s, tok_dir / "tokenizer.json", s.max_docs, url) for s in config.corpora]
        return [
            tokenize_to_file(s, tok, ids, cache, key, s.max_docs, batch, url, workers=workers)
            for s, key in zip(config.corpora, keys, strict=True)
        ]

    if rt.world == 1:
        return build()
    cache.mkdir(parents=True, exist_ok=True)
    job = rt.broadcast(uuid.uuid4().hex if rt.is_main else None)
    probe = cache / f".job-{job}"
    if rt.is_main:
        probe.touch()
    rt.barrier()
    shared = probe.exists()  # this host sees global rank 0's folder
    builder = rt.is_main if shared else rt.local_rank == 0
    ready = cache / f".job-{job}.ready-node{0 if shared else rt.node}"
    if builder:
        for stale in cache.glob(".job-*"):  # markers of earlier jobs (a crash, or restored from S3)
            if not stale.name.startswith(f".job-{job}"):
                stale.unlink(missing_ok=True)
        try:
            files = build()
        except BaseException as exc:
            write_ready(ready, None, str(exc) or type(exc).__name__)
            raise
        write_ready(ready, files)
    else:
        files = wait_ready(ready)
    rt.barrier()
    if builder:
        ready.unlink(missing_ok=True)
    if rt.is_main:
        probe.unlink(missing_ok=True)
    return files
