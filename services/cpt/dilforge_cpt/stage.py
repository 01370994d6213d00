"""CPT stage, top to bottom: adapt a Llama-family model to a new language and its new tokenizer.

`train` (the container entry) either trains in this process or, when more than one process is
asked for (num_processes_per_node, or several hosts in resourceconfig.json), starts torchrun on
`worker` and waits; only node 0's `train` process publishes. Each training process:

  tokenizer artifact → token cache (streamed, once) → packed windows + mixture sampler
  base model (HF folder / s3 / scratch) → vocabulary transplant → step-0 BPB per initialisation
  → Liger (CUDA) → activation checkpointing / compile / FSDP2 → resume from the latest checkpoint
  → phase 1 (embeddings + LM head) → phase 2 (all) → final validation → HF folder in /opt/ml/model
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch
from dilforge_shared.configs.cpt import CptConfig
from dilforge_shared.contract import StageContext, StageResult, Terminated, install_sigterm_handler, log_config
from dilforge_shared.errors import ConfigError, DilforgeError, InputError
from dilforge_shared.launch import build_launch, wait_for_hosts
from dilforge_shared.manifest import InputRef
from dilforge_shared.models import find_hf_dir, open_model

from . import data as D
from . import train as T
from . import transplant as X

log = logging.getLogger("dilforge.cpt")

RESULT_FILE = "cpt-result.json"
STOP_FILE = "cpt-stop"  # in /opt/ml/output: the launcher's "checkpoint and exit" request to its workers
STOP_GRACE_S = 110.0  # SageMaker SIGKILLs 120 s after SIGTERM; torchrun is signalled only after this
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "added_tokens.json")


# ---- entry points --------------------------------------------------------------------------
def run(config: CptConfig, ctx: StageContext) -> StageResult:
    """`train`: one process trains here; more go through torchrun and this process waits."""
    stop_file(ctx).unlink(missing_ok=True)
    nproc = config.num_processes_per_node or max(1, torch.cuda.device_count())
    plan = build_launch(ctx.resources, ["-m", "dilforge_cpt", "worker"], nproc_per_node=nproc,
                        master_port=config.master_port)
    if plan.world_size > 1:
        if plan.nnodes > 1:
            wait_for_hosts(ctx.resources.hosts)
        metrics = run_workers(plan, ctx)
    else:
        metrics = train(config, ctx)
    return StageResult(metrics=metrics, extra_inputs=base_model_refs(config, ctx))


def worker(config: CptConfig, ctx: StageContext) -> StageResult:
    """`worker`: one torchrun process. Global rank 0 leaves the metrics for the launcher."""
    metrics = train(config, ctx)
    if int(os.environ.get("RANK", "0")) == 0:
        tmp = ctx.opt.output_dir / f"{RESULT_FILE}.tmp"
        tmp.write_text(json.dumps(metrics))
        os.replace(tmp, ctx.opt.output_dir / RESULT_FILE)
    return StageResult(metrics=metrics)


def stop_file(ctx: StageContext) -> Path:
    return ctx.opt.output_dir / STOP_FILE


def run_workers(plan, ctx: StageContext, grace_s: float | None = None) -> dict:
    """Run torchrun and surface a worker's failure message.

    SIGTERM is not forwarded: torchrun's elastic agent would SIGTERM the workers and SIGKILL them
    30 s later, too short to checkpoint a 1B FSDP model. Instead this process creates the stop
    file, which every worker polls each step (all ranks agree through an all-reduce), checkpoints
    and exits; torchrun is signalled only if workers are still running `grace_s` later.
    """
    grace_s = STOP_GRACE_S if grace_s is None else grace_s
    result = ctx.opt.output_dir / RESULT_FILE
    ctx.opt.output_dir.mkdir(parents=True, exist_ok=True)
    for stale in (result, ctx.opt.failure_file, stop_file(ctx)):
        stale.unlink(missing_ok=True)
    log.info("launching %d processes on this host (node %d of %d): %s", plan.nproc_per_node, plan.node_rank,
             plan.nnodes, " ".join(plan.command))
    proc = subprocess.Popen(plan.command, env=plan.env)
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
    if rc != 0:
        reason = ctx.opt.failure_file.read_text() if ctx.opt.failure_file.exists() else ""
        if stopped_at:
            raise Terminated(reason or "stopped by SIGTERM after checkpointing; rerun to resume")
        raise DilforgeError(reason or f"training workers failed (torchrun exit code {rc}); see the log above")
    if plan.node_rank != 0:
        return {}
    return json.loads(result.read_text())


# ---- the training story ----------------------------------------------------------------------
def train(config: CptConfig, ctx: StageContext) -> dict:
    rt = T.init_runtime(config)
    try:
        return _train(config, ctx, rt)
    finally:
        T.shutdown(rt)


def _train(config: CptConfig, ctx: StageContext, rt: T.Runtime) -> dict:
    stop = install_sigterm_handler()
    stop_path = stop_file(ctx)  # created by the launcher (multi-process runs) on SIGTERM
    grad_accum = derive_grad_accum(config, rt.world)

    tok_dir = D.find_tokenizer_dir(ctx.input("tokenizer").path)
    tok = D.load_tokenizer(tok_dir)
    ids = D.special_ids(tok, str(tok_dir))

    files = tokenize_corpora(config, ctx, rt, tok, ids, tok_dir)
    data = D.PackedData(files, [c.weight for c in config.corpora], config.seq_len, config.seed)
    val = D.build_validation(config.validation, tok, ids, config.seq_len, config.num_validation_docs,
                             ctx.endpoint_url)

    ckpt_root = ctx.checkpoint_dir / "train"
    resume = common_checkpoint(ckpt_root, rt)
    model, init_report = build_model(config, ctx, tok, tok_dir, ids, rt, val if resume is None else None)
    kernels = T.apply_liger(model, config, rt)
    log.info("liger kernels applied: %s", ", ".join(kernels) if kernels else "none (CPU or liger: false)")
    num_params = sum(p.numel() for p in model.parameters())
    model = T.prepare_model(model, config, rt)

    fpt = T.flops_per_token(model.config, num_params, config.seq_len)
    peak = T.peak_flops(config, rt)
    tokens_per_step = config.global_batch_size * config.seq_len
    derived = {
        "world_size": rt.world, "grad_accum_steps": grad_accum, "global_batch_sequences": config.global_batch_size,
        "global_batch_tokens": tokens_per_step, "total_tokens": tokens_per_step * config.num_steps,
        "num_params": num_params, "vocab_size": model.config.vocab_size, "flops_per_token": fpt,
        "device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."), "fsdp": rt.fsdp,
        "liger_kernels": kernels, "train_windows": {tf.label: tf.windows(config.seq_len) for tf in files},
        "validation_docs": val.num_docs, "validation_bytes": val.num_bytes,
    }
    if rt.is_main:
        log_config(config, derived)

    state = {"phase": 1, "step_in_phase": 0, "step": 0, "sampler": data.sampler.state_dict(),
             "transplant": init_report, "history": [], "validation": [], "last_loss": None}
    if resume is not None:
        state = T.read_checkpoint_state(resume)
        data.sampler.load_state_dict(state["sampler"])
    metrics = T.Metrics(ctx.tensorboard_dir, config.num_steps, rt, state["step"])
    metrics.history, metrics.validation = state["history"], state["validation"]

    def checkpoint() -> None:
        state.update(sampler=data.sampler.state_dict(), history=metrics.history, validation=metrics.validation)
        T.save_checkpoint(ckpt_root, state["step"], model, optimizer, state, rt, config.num_checkpoints_kept)

    if resume is None:
        metrics.record(0, T.evaluate(model, val, config.micro_batch_size, rt), kind="validation")
    phases = [(1, config.phase1), (2, config.phase2)]
    optimizer = None
    for index, phase in phases:
        if phase.num_steps == 0 or index < state["phase"]:
            continue
        if index > state["phase"]:
            state.update(phase=index, step_in_phase=0)
        optimizer = T.make_optimizer(T.set_trainable(model, index), config, phase)
        if resume is not None:
            T.load_checkpoint(resume, model, optimizer, rt)
            resume = None
        log.info("phase %d: %d steps at lr %g (%s)", index, phase.num_steps, phase.lr,
                 "embeddings + LM head" if index == 1 else "all parameters")
        step_time, step_tokens = 0.0, 0
        while state["step_in_phase"] < phase.num_steps:
            lr = T.lr_at(phase, state["step_in_phase"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            sampler_before = data.sampler.state_dict()
            t0 = time.perf_counter()
            batches = data.next_step(config.global_batch_size, config.micro_batch_size, rt.rank, rt.world)
            loss, norm = T.train_step(model, optimizer, batches, rt, config.max_grad_norm)
            step_time += time.perf_counter() - t0
            step_tokens += tokens_per_step
            if not (math.isfinite(loss) and math.isfinite(norm)):
                data.sampler.load_state_dict(sampler_before)
                checkpoint()
                what = (f"non-finite training loss ({loss})" if not math.isfinite(loss)
                        else f"non-finite gradient norm ({norm}; training loss {loss:.6g})")
                raise DilforgeError(f"{what} at step {state['step'] + 1} (phase {index}, lr {lr:g}); the optimizer "
                                    f"did not step; checkpoint saved at step {state['step']}. Lower the phase's lr, "
                                    "raise num_warmup_steps, set max_grad_norm, or check the data")
            state["step_in_phase"] += 1
            state["step"] += 1
            state["last_loss"] = loss
            step = state["step"]
            metrics.tick(loss)
            if step % config.log_every == 0 or step == config.num_steps or state["step_in_phase"] == phase.num_steps:
                tps = step_tokens / step_time if step_time else 0.0
                metrics.record(step, {
                    "phase": index, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps,
                    "tokens_per_s_per_device": tps / rt.world,
                    "mfu": (tps / rt.world) * fpt / peak if peak else None, "peak_memory_gb": T.peak_memory_gb(rt),
                })
                step_time, step_tokens = 0.0, 0
            if step % config.eval_every == 0 or step == config.num_steps:
                metrics.record(step, T.evaluate(model, val, config.micro_batch_size, rt), kind="validation")
            stopping = rt.any(stop["stop"] or stop_path.exists())
            if step % config.checkpoint_every == 0 or stopping:
                checkpoint()
            if stopping:
                raise Terminated(f"stopped by SIGTERM at step {step}; checkpoint saved, rerun to resume")
    metrics.close()

    if rt.is_main:
        ctx.model_dir.mkdir(parents=True, exist_ok=True)
    save_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "auto": rt.dtype}[config.save_dtype]
    T.save_hf_model(model, ctx.model_dir, save_dtype, rt)
    if rt.is_main:
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy2(tok_dir / name, ctx.model_dir / name)
        (ctx.model_dir / "cpt_metrics.json").write_text(json.dumps(
            {"train": metrics.history, "validation": metrics.validation, "transplant": state["transplant"]}, indent=1))
    rt.barrier()
    return summarize(state, metrics, derived)


def summarize(state: dict, metrics: T.Metrics, derived: dict) -> dict:
    last_val = metrics.validation[-1] if metrics.validation else {}
    first_val = metrics.validation[0] if metrics.validation else {}
    timed = [h for h in metrics.history if h.get("tokens_per_s")]
    return {
        "num_steps": state["step"], "final_train_loss": state["last_loss"],
        "final_val_loss": last_val.get("val_loss"), "final_val_bpb": last_val.get("val_bpb"),
        "step0_val_loss": first_val.get("val_loss"), "step0_val_bpb": first_val.get("val_bpb"),
        "transplant": state["transplant"],
        "tokens_per_s": timed[-1]["tokens_per_s"] if timed else None,
        "mfu": timed[-1]["mfu"] if timed else None,
        "peak_memory_gb": max((h["peak_memory_gb"] for h in metrics.history), default=None),
        **{k: derived[k] for k in ("world_size", "global_batch_sequences", "global_batch_tokens", "total_tokens",
                                   "num_params", "liger_kernels", "dtype")},
        "history": metrics.history, "validation": metrics.validation,
    }


# ---- pieces ----------------------------------------------------------------------------------
def derive_grad_accum(config: CptConfig, world: int) -> int:
    per_step = config.micro_batch_size * world
    if config.global_batch_size % per_step:
        raise ConfigError(f"global_batch_size ({config.global_batch_size}) must be a multiple of micro_batch_size "
                          f"({config.micro_batch_size}) × processes ({world})")
    return config.global_batch_size // per_step


def common_checkpoint(root: Path, rt: T.Runtime) -> Path | None:
    """The newest checkpoint complete on every host (each checks its own /opt/ml/checkpoints)."""
    mine = [p.name for p in T.complete_checkpoints(root)]
    if not rt.distributed:
        return root / mine[-1] if mine else None
    import torch.distributed as dist
    everyone: list = [None] * rt.world
    dist.all_gather_object(everyone, mine)
    common = set(everyone[0]).intersection(*everyone[1:])
    if set(mine) - common and rt.local_rank == 0:
        log.warning("checkpoints %s are not complete on every host; ignored", sorted(set(mine) - common))
    return root / max(common) if common else None


def tokenize_corpora(config: CptConfig, ctx: StageContext, rt: T.Runtime, tok, ids, tok_dir: Path) -> list[D.TokenFile]:
    """Local rank 0 of each host fills the token cache; the others then read it."""
    cache = ctx.checkpoint_dir / "tokens"

    def build() -> list[D.TokenFile]:
        out = []
        for source in config.corpora:
            key = D.cache_key(source, tok_dir / "tokenizer.json", config.max_docs_per_corpus, ctx.endpoint_url)
            out.append(D.tokenize_to_file(source, tok, ids, cache, key, config.max_docs_per_corpus,
                                          config.tokenize_batch_size, ctx.endpoint_url))
        return out
    files = build() if rt.local_rank == 0 else None
    rt.barrier()
    return files if files is not None else build()


def local_base_model(config: CptConfig, ctx: StageContext, rt: T.Runtime) -> Path:
    """The base model's HF folder: the pipeline's `model` artifact, else config.base_model through the shared
    resolver (an artifact, a local folder, or an s3:// prefix downloaded once per host)."""
    if ctx.has_input("model"):
        art = ctx.input("model")
        return find_hf_dir(art.path, art.uri)
    uri = config.base_model
    assert uri is not None
    cache = ctx.opt.root / "base_model"
    if rt.local_rank == 0:
        src = open_model(uri, endpoint_url=ctx.endpoint_url, cache_dir=cache)
    rt.barrier()
    if rt.local_rank != 0:
        src = open_model(uri, endpoint_url=ctx.endpoint_url, cache_dir=cache)
    try:
        return find_hf_dir(src.path, uri)
    except ConfigError as exc:
        raise InputError(f"base_model: {exc}", path=uri) from None


def build_model(config: CptConfig, ctx: StageContext, tok, tok_dir: Path, ids: D.TokenIds, rt: T.Runtime,
                val: D.ValidationSet | None):
    """The model on the stage's tokenizer, plus a report of the transplant (step-0 BPB per init)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    pad = tok.token_to_id("<|finetune_right_pad_id|>")
    if config.base_model is None and not ctx.has_input("model"):
        from transformers import LlamaConfig, LlamaForCausalLM
        s = config.scratch_model
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                          num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                          num_key_value_heads=s.num_key_value_heads, max_position_embeddings=s.max_position_embeddings,
                          rope_theta=s.rope_theta, tie_word_embeddings=s.tie_word_embeddings,
                          bos_token_id=ids.bos, eos_token_id=ids.eos, pad_token_id=pad)
        torch.manual_seed(config.seed)
        return LlamaForCausalLM(cfg), {"method": "none", "reason": "scratch model on the stage's tokenizer"}
    base_dir = local_base_model(config, ctx, rt)
    if not (base_dir / "tokenizer.json").is_file():
        raise InputError("base_model: no tokenizer.json beside the weights (needed to compare vocabularies)",
                         path=config.base_model)
    base_tok = D.load_tokenizer(base_dir)
    same = X.same_vocab(base_tok, tok)
    if not same and config.transplant == "none":
        raise InputError(
            f"the tokenizer artifact ({vocab} tokens) differs from the base model's tokenizer "
            f"({base_tok.get_vocab_size(with_added_tokens=True)} tokens) and transplant is 'none'; set transplant "
            "to mean_of_pieces (or mean_of_all / random) or use the base model's tokenizer", path=config.base_model)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, trust_remote_code=False)
    if same:
        if model.get_input_embeddings().weight.shape[0] < vocab:
            raise InputError(f"base_model: embedding has {model.get_input_embeddings().weight.shape[0]} rows, "
                             f"fewer than the tokenizer's {vocab} tokens", path=config.base_model)
        return model, {"method": "none", "reason": "same tokenizer as the base model"}
    mapping = X.build_mapping(base_tok, tok)
    rows = X.prepare(model, vocab)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = ids.bos, ids.eos, pad
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.bos_token_id, model.generation_config.eos_token_id = ids.bos, ids.eos
        model.generation_config.pad_token_id = pad
    report = {"method": config.transplant, "num_kept": mapping.num_kept, "num_new": vocab - mapping.num_kept,
              "base_vocab_size": base_tok.get_vocab_size(with_added_tokens=True), "new_vocab_size": vocab}
    methods = [config.transplant]
    if val is not None and config.compare_transplant_inits:
        methods = [m for m in X.METHODS if m != config.transplant] + [config.transplant]
    model.to(rt.device)
    for method in methods:  # the trained method goes last, so the model ends with its rows
        X.transplant(model, rows, mapping, method, config.seed)
        if val is not None:
            result = T.evaluate(model, val, config.micro_batch_size, rt)
            report[f"step0_val_bpb_{method}"] = result["val_bpb"]
            log.info("transplant %s: step-0 val_bpb=%.4f val_loss=%.4f", method, result["val_bpb"], result["val_loss"])
    return model, report


def base_model_refs(config: CptConfig, ctx: StageContext) -> list[InputRef]:
    """Nothing extra: the contract records the base model (input 'model', or `models.config_refs` for
    config.base_model) by exactly the ref the coordinator fingerprinted."""
    return []
