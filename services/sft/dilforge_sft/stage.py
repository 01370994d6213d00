"""The SFT stage, top to bottom: data → base model → LoRA via TRL's SFTTrainer → adapter (+ merged) → metrics.

The loss falls on assistant content and the end-of-turn token of the base model's family only
(`<|eot_id|>` for Llama 3, `<|im_end|>` for ChatML): the family's chat template carries
{% generation %} markers; the conversations are tokenised once with that template's assistant mask
(`data.apply_length_rule`) and TRL's SFTTrainer turns everything outside the mask into label -100. Packing is padding-free, with an attention kernel that keeps documents apart (see
`attention_plan`). TRL, PEFT and transformers are used as libraries; the only
extension is a TrainerCallback that turns SIGTERM into "checkpoint and stop".
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilforge_shared import runtime_policy
from dilforge_shared.configs.sft import SftConfig
from dilforge_shared.contract import StageContext, StageResult, Terminated, install_sigterm_handler, log_config
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.families import Family, describe_model_folder, detect_family
from dilforge_shared.models import ADAPTER_DIR, MERGED_DIR, choose, resolve
from dilforge_shared.runtime_policy import DeviceFacts

from .checkpoints import latest_checkpoint, seal_checkpoints_callback
from .data import DataCounts, Example, apply_length_rule, load_splits

log = logging.getLogger("dilforge.sft")

TRAINER_DIR = "trainer"  # under ctx.checkpoint_dir: Trainer's checkpoint-<step>/ folders
EVAL_BEFORE_FILE = "eval_before.json"  # under ctx.checkpoint_dir: the base model's validation loss, kept across resumes
LABEL_PREVIEW_FILE = "label_preview.jsonl"  # under ctx.model_dir: the first training examples with their loss mask


# ---- where the base model comes from ---------------------------------------------------------------


def resolve_base(config: SftConfig, ctx: StageContext) -> tuple[Path, str]:
    """(HF folder, URI for reports) by the shared precedence rule (`models.choose`): `base_model` when set,
    else the upstream `cpt` artifact, else `model`. Lineage is what the coordinator fingerprinted: the input
    as upstream, base_model by its `identity.config_refs` ref."""
    choice = choose("base_model", config.base_model, ctx.request.inputs)
    if choice is None:
        raise ConfigError(
            "sft: no base model: run the cpt stage in the same pipeline, pass --input cpt=URI, "
            "or set sft.base_model to an HF folder, s3:// prefix or model artifact"
        )
    source = ctx.input(choice.input) if choice.input else choice.uri
    try:
        found = resolve(source, "model", endpoint_url=ctx.endpoint_url, cache_dir=ctx.opt.root / "cache")
    except ConfigError as exc:
        raise InputError(f"base_model: {str(exc).removeprefix(f'{choice.uri}: ')}", path=choice.uri) from None
    return found.path, found.uri


# ---- device, tokenizer, model --------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePlan:
    device: str
    bf16: bool
    liger: bool


def device_plan(config: SftConfig, model_type: str | None = None, facts: DeviceFacts | None = None) -> DevicePlan:
    """bf16 + Liger on CUDA, fp32 without Liger on CPU, unless the config says otherwise: the shared
    policy (dilforge_shared.runtime_policy) decides; SFT does not train in bf16 on CPU."""
    policy = runtime_policy.decide(
        "sft", precision=config.precision, liger=config.liger, model_type=model_type, cpu_bf16=False, facts=facts
    )
    return DevicePlan(device=policy.device, bf16=policy.bf16, liger=policy.liger)


def load_tokenizer(model_dir: Path) -> tuple[Any, Family, str]:
    """(tokenizer, its family, where the chat template came from).

    The family (Llama 3 or ChatML) decides the turn-end token the loss must cover and the pad token.
    A tokenizer whose own template already has {% generation %} markers keeps it; otherwise the
    family's training template replaces it (SmolLM2's shipped template, for one, has none and injects
    a default system prompt), so the assistant mask covers exactly assistant content + the family's eot.
    """
    from transformers import AutoTokenizer
    from trl.chat_template_utils import has_generation_markers

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    vocab = tok.get_vocab()
    family = detect_family(vocab, str(model_dir))
    template_source = "tokenizer"
    if not tok.chat_template or not has_generation_markers(tok.chat_template):
        tok.chat_template = family.chat_template
        template_source = f"family:{family.name}"
        log.info(
            "tokenizer has no chat template with {%% generation %%} markers: using the %s family's training template",
            family.name,
        )
    if tok.pad_token is None or tok.pad_token == family.eot:
        # SmolLM2 ships pad = <|im_end|>: padding with the token the loss must teach invites masking it
        tok.pad_token = family.pad if family.pad in vocab else tok.eos_token
    return tok, family, template_source


# ---- attention kernel and activation checkpointing ---------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    implementation: str  # transformers' attn_implementation
    reason: str  # logged and published: why this kernel


def attention_plan(config: SftConfig, device: str, has_flash_attn: bool | None = None) -> AttentionPlan:
    """Which attention kernel trains this config, and why: the shared policy's rule
    (runtime_policy.choose_attention; packing on CUDA wants a varlen or flex kernel)."""
    facts = DeviceFacts(
        cuda=device == "cuda",
        flash_attn=runtime_policy.probe_device().flash_attn if has_flash_attn is None else has_flash_attn,
    )
    implementation, reason = runtime_policy.choose_attention(
        config.attention, device, facts, config.packing, "sft.attention"
    )
    return AttentionPlan(implementation, reason)


def estimate_training_bytes(model_config, tokens_per_micro_batch: int, bf16: bool) -> int:
    """Rough peak memory of LoRA training WITHOUT activation checkpointing, in bytes.

    Frozen weights + saved activations + logits. Activations per token and layer follow Korthikanti
    et al. (2022) for a flash-style attention kernel, with the MLP width taken from the config:
    about 10 hidden-sized and 3 MLP-sized tensors. Logits are counted in the compute dtype, in fp32 for
    the loss and once more for their gradient. Deliberately pessimistic: it only decides whether
    recomputation (25-30 % slower) is worth turning on.
    """
    elem = 2 if bf16 else 4
    hidden, layers = model_config.hidden_size, model_config.num_hidden_layers
    inter, vocab = model_config.intermediate_size, model_config.vocab_size
    params = vocab * hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2) + layers * (
        4 * hidden * hidden + 3 * hidden * inter
    )
    activations = tokens_per_micro_batch * layers * elem * (10 * hidden + 3 * inter)
    logits = tokens_per_micro_batch * vocab * (elem + 4 + 4)
    return params * elem + activations + logits


def device_memory_bytes(device: str) -> int:
    """Total memory of the training device: the GPU's, or the host's RAM on CPU."""
    import os

    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpointing_decision(config: SftConfig, estimate: int, memory: int) -> tuple[bool, str]:
    """(use activation checkpointing?, why): auto turns it on only when memory would not allow training without."""
    if config.activation_checkpointing != "auto":
        return config.activation_checkpointing == "on", "set by sft.activation_checkpointing"
    budget = int(memory * config.memory_budget_fraction)
    gib = 2**30
    if estimate > budget:
        return True, f"estimated {estimate / gib:.1f} GiB > budget {budget / gib:.1f} GiB: recompute activations"
    return False, f"estimated {estimate / gib:.1f} GiB <= budget {budget / gib:.1f} GiB: no recomputation"


def load_model(model_dir: Path, plan: DevicePlan, attn_implementation: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch.bfloat16 if plan.bf16 else torch.float32,
        attn_implementation=attn_implementation,
        trust_remote_code=False,
    )
    if plan.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # layer kernels only: TRL replaces the LM head/loss with its own fused one
        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
        )
    return model


def lora_config(config: SftConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=list(config.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def warmup_arg(config: SftConfig) -> int | float:
    """TrainingArguments.warmup_steps: an int is a count of steps, a float below 1 a share of them."""
    return config.num_warmup_steps if config.num_warmup_steps is not None else float(config.warmup_ratio or 0.0)


def sft_arguments(config: SftConfig, output_dir: Path, plan: DevicePlan, checkpointing: bool = False):
    """The TRL SFTConfig of this stage: every knob comes from SftConfig, nothing from TRL's own defaults by accident."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(output_dir),
        seed=config.seed,
        data_seed=config.seed,
        # the datasets arrive tokenised with their `assistant_masks` (prepare_data), which TRL turns into the labels
        # itself; assistant_only_loss only asks TRL to tokenise messages with that mask, and refuses tokenised data
        assistant_only_loss=False,
        max_length=config.max_length,
        truncation_mode="keep_start",
        packing=config.packing,
        packing_strategy="bfd",
        eval_packing=False,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=warmup_arg(config),
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        num_train_epochs=config.num_epochs,
        max_steps=config.num_steps or -1,
        per_device_train_batch_size=config.micro_batch_size,
        per_device_eval_batch_size=config.eval_micro_batch_size or config.micro_batch_size,
        gradient_accumulation_steps=config.grad_accum_steps(1, "sft."),
        activation_checkpointing=checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        bf16=plan.bf16,
        fp16=False,
        use_cpu=plan.device == "cpu",
        logging_steps=config.log_every,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=config.checkpoint_every,
        save_total_limit=config.num_checkpoints_kept,
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=plan.device == "cuda",
    )


def build_trainer(
    config: SftConfig,
    model,
    tokenizer,
    train: list[Example],
    val: list[Example],
    output_dir: Path,
    plan: DevicePlan,
    callbacks: list | None = None,
    checkpointing: bool = False,
):
    """TRL's SFTTrainer with LoRA on the stage's tokenised conversations (`prepare_data`): TRL builds the labels
    from their assistant masks, truncates or packs them; it does not apply the chat template again."""
    from datasets import Dataset
    from trl import SFTTrainer

    return SFTTrainer(
        model=model,
        args=sft_arguments(config, output_dir, plan, checkpointing),
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(val),
        peft_config=lora_config(config),
        callbacks=callbacks or [],
    )


# ---- checkpoints ------------------------------------------------------------------------------------


def stop_on_sigterm_callback(flag: dict[str, bool]):
    """Checkpoint at the end of the current step and stop, when SIGTERM arrives (spot interruption, stop job)."""
    from transformers import TrainerCallback

    class StopOnSigterm(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if flag.get("stop"):
                control.should_save = True
                control.should_training_stop = True
            return control

    return StopOnSigterm()


def tensorboard_callback(log_dir: Path):
    """transformers' own TensorBoardCallback, writing where SageMaker uploads TensorBoard logs. Not `report_to=
    "tensorboard"`: transformers 5 dropped `logging_dir`, so that would log under output_dir/runs/ (or need
    TENSORBOARD_LOGGING_DIR set in os.environ while running)."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    log_dir.mkdir(parents=True, exist_ok=True)
    return TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(log_dir)))


# ---- outputs ------------------------------------------------------------------------------------------


def save_adapter(trainer, tokenizer, out_dir: Path, base_uri: str) -> None:
    """PEFT adapter (safetensors) + tokenizer; adapter_config names the base by its URI, not a local path."""
    trainer.model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_uri
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    describe_model_folder(out_dir)


def save_merged(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """Merge in fp32 on CPU from the saved files (what a user would do), then store in the base's own dtype."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, trust_remote_code=False)
    target_dtype = getattr(base.config, "dtype", None) or torch.float32
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if isinstance(target_dtype, str):
        target_dtype = getattr(torch, target_dtype)
    merged.to(target_dtype).save_pretrained(str(out_dir), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(adapter_dir), trust_remote_code=False).save_pretrained(str(out_dir))
    describe_model_folder(out_dir)


def write_label_preview(dataset, tokenizer, path: Path, num_examples: int) -> int:
    """The first training rows as the trainer sees them (template, TRL tokenisation, truncation, packing done):
    one JSON line each with the ids, a 0/1 `trained` flag per token (label != -100), and both decoded.

    So a user can read, in the artifact, exactly which tokens the loss falls on. Returns the rows written.
    """
    n = min(num_examples, len(dataset))
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            row = dataset[i]
            ids = list(row["input_ids"])
            trained = [0 if label == -100 else 1 for label in row["labels"]]
            f.write(
                json.dumps(
                    {
                        "index": i,
                        "input_ids": ids,
                        "trained": trained,
                        "text": tokenizer.decode(ids, skip_special_tokens=False),
                        "trained_text": tokenizer.decode(
                            [t for t, on in zip(ids, trained, strict=False) if on], skip_special_tokens=False
                        ),
                    },
                    ensure_ascii=False,
                )
                + "\n"
            )
    return n


def loss_history(log_history: list[dict[str, Any]]) -> list[dict[str, float]]:
    return [{"step": e["step"], "loss": round(float(e["loss"]), 6)} for e in log_history if "loss" in e]


# ---- the stage ---------------------------------------------------------------------------------------------


def prepare_data(
    config: SftConfig, tokenizer, endpoint_url: str | None, splits: tuple | None = None
) -> tuple[list[Example], list[Example], DataCounts, DataCounts]:
    """Read both splits with the counted record rules, then tokenise them once (the chat template) and apply the
    max-length rule with the real tokenizer."""
    train, val, train_counts, val_counts = splits or load_splits(config, endpoint_url)
    train = apply_length_rule(train, tokenizer, config.max_length, config.long_conversations, train_counts)
    val = apply_length_rule(val, tokenizer, config.max_length, config.long_conversations, val_counts)
    if not train or not val:
        raise InputError(
            f"no conversation left after the long_conversations={config.long_conversations!r} rule "
            f"(max_length {config.max_length}); raise max_length",
            path=config.train[0].uri,
        )
    return train, val, train_counts, val_counts


def run(config: SftConfig, ctx: StageContext) -> StageResult:
    if len(ctx.resources.hosts) > 1:
        raise ConfigError(f"sft runs on one host; resourceconfig lists {len(ctx.resources.hosts)}")
    stop_flag = install_sigterm_handler()
    splits = load_splits(config, ctx.endpoint_url)  # bad data fails here, before torch is even imported
    base_dir, base_uri = resolve_base(config, ctx)
    import torch
    from transformers import AutoConfig

    torch.manual_seed(config.seed)
    model_config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
    plan = device_plan(config, model_config.model_type)
    tokenizer, family, template_source = load_tokenizer(base_dir)
    train, val, train_counts, val_counts = prepare_data(config, tokenizer, ctx.endpoint_url, splits)
    attention = attention_plan(config, plan.device)
    estimate = estimate_training_bytes(model_config, config.micro_batch_size * config.max_length, plan.bf16)
    checkpointing, checkpointing_reason = checkpointing_decision(config, estimate, device_memory_bytes(plan.device))

    global_batch = config.global_batch_size
    steps_per_epoch = math.ceil(len(train) / global_batch)
    total_steps = config.num_steps or math.ceil(steps_per_epoch * config.num_epochs)
    log_config(
        config,
        {
            "base_model": base_uri,
            "device": plan.device,
            "bf16": plan.bf16,
            "liger": plan.liger,
            "chat_template": template_source,
            "family": family.name,
            "eot": family.eot,
            "attention": attention.implementation,
            "attention_reason": attention.reason,
            "activation_checkpointing": checkpointing,
            "activation_checkpointing_reason": checkpointing_reason,
            "global_batch": global_batch,
            "tokens_per_step_max": global_batch * config.max_length,
            "num_train_conversations": len(train),
            "num_validation_conversations": len(val),
            "optimizer_steps": total_steps,
            "train_tokens": train_counts.num_tokens,
            "train_assistant_tokens": train_counts.num_assistant_tokens,
        },
    )

    model = load_model(base_dir, plan, attention.implementation)
    trainer_dir = ctx.checkpoint_dir / TRAINER_DIR
    trainer_dir.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(
        config,
        model,
        tokenizer,
        train,
        val,
        trainer_dir,
        plan,
        callbacks=[
            stop_on_sigterm_callback(stop_flag),
            seal_checkpoints_callback(),
            tensorboard_callback(ctx.tensorboard_dir),
        ],
        checkpointing=checkpointing,
    )
    trainable, total = trainer.model.get_nb_trainable_parameters()
    num_previewed = 0
    if config.num_label_preview_examples:
        num_previewed = write_label_preview(
            trainer.train_dataset, tokenizer, ctx.model_dir / LABEL_PREVIEW_FILE, config.num_label_preview_examples
        )
        log.info("wrote %s: %d training example(s) with their loss mask", LABEL_PREVIEW_FILE, num_previewed)

    resume = latest_checkpoint(trainer_dir)
    before_file = ctx.checkpoint_dir / EVAL_BEFORE_FILE
    if before_file.exists() and resume is not None:
        eval_before = json.loads(before_file.read_text())["eval_loss"]
    else:
        eval_before = trainer.evaluate()["eval_loss"]
        before_file.write_text(json.dumps({"eval_loss": eval_before}))
    log.info(
        "validation loss before: %.4f; %s",
        eval_before,
        f"resuming from {resume.name}" if resume else "training from the start",
    )

    start = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    train_seconds = time.perf_counter() - start
    if stop_flag["stop"]:
        raise Terminated(
            f"stopped by SIGTERM at step {trainer.state.global_step}; checkpoint saved in "
            f"{trainer_dir}; rerun the stage to resume"
        )
    eval_after = trainer.evaluate()["eval_loss"]
    history = loss_history(trainer.state.log_history)  # includes steps logged before a resume
    log.info("validation loss after: %.4f (before %.4f)", eval_after, eval_before)

    adapter_dir = ctx.model_dir / ADAPTER_DIR
    save_adapter(trainer, tokenizer, adapter_dir, base_uri)
    del trainer, model
    if config.save_merged:
        save_merged(base_dir, adapter_dir, ctx.model_dir / MERGED_DIR)
    shutil.rmtree(ctx.model_dir / "runs", ignore_errors=True)

    metrics = {
        "base_model": base_uri,
        "chat_template": template_source,
        "family": family.name,
        "attention": attention.implementation,
        "activation_checkpointing": checkpointing,
        "device": plan.device,
        "bf16": plan.bf16,
        "liger": plan.liger,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "train_loss": out.training_loss,
        "train_loss_history": history,
        "optimizer_steps": out.global_step,
        "resumed_from_step": int(resume.name.split("-")[1]) if resume else 0,
        "train_runtime_s": round(train_seconds, 3),
        "train_steps_per_second": out.metrics.get("train_steps_per_second"),
        "data": {"train": train_counts.as_dict(), "validation": val_counts.as_dict()},
        "outputs": [ADAPTER_DIR, *([MERGED_DIR] if config.save_merged else [])],
        "num_label_preview_examples": num_previewed,
    }
    return StageResult(metrics=metrics)
