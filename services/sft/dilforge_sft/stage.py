"""The SFT stage: data → base model → LoRA via TRL's SFTTrainer → adapter (+ merged) → metrics. The loss covers
assistant content and the family's end-of-turn token only (the template's assistant mask)."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dilforge_shared.contract import StageContext, StageResult, Terminated, install_sigterm_handler, log_config
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.families import Family, detect_family
from dilforge_shared.models import ADAPTER_DIR, MERGED_DIR, choose, resolve

from .config import SftConfig
from .data import (
    Conversation,
    DataCounts,
    Example,
    apply_length_rule,
    count_answer_languages,
    load_splits,
    refuse_special_tokens,
)
from .metrics import SftMetrics
from .outputs import save_adapter, save_merged, write_generation_defaults, write_label_preview
from .training import (
    activation_checkpointing,
    build_trainer,
    decide_runtime,
    latest_checkpoint,
    load_model,
    progress_callback,
    seal_checkpoints_callback,
    stop_on_sigterm_callback,
    tensorboard_callback,
)

log = logging.getLogger("dilforge.sft")
# a chat template that marks assistant turns for the assistant-only loss ({% generation %} ... {% endgeneration %})
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

LABEL_PREVIEW_FILE = "label_preview.jsonl"  # under ctx.opt.model_dir: the first training examples with their loss mask


def run(config: SftConfig, ctx: StageContext) -> StageResult:
    """Data → base model, tokenizer and policy → TRL's trainer (resumed from the newest sound checkpoint) →
    adapter (+ merged model) → metrics."""
    if len(ctx.resources.hosts) > 1:
        raise ConfigError(f"sft runs on one host; resourceconfig lists {len(ctx.resources.hosts)}")
    stop_flag = install_sigterm_handler()
    splits = load_splits(config, ctx.endpoint_url)  # bad data fails here, before torch is even imported
    if config.target_language:
        check_answer_languages(splits[0], config.target_language, splits[2])
    base_dir, base_uri = resolve_base(config, ctx)
    import torch
    from transformers import AutoConfig

    torch.manual_seed(config.seed)
    model_config = AutoConfig.from_pretrained(str(base_dir), trust_remote_code=False)
    plan = decide_runtime(config, model_config.model_type)
    tokenizer, family, template_source = load_tokenizer(base_dir)
    train_set, val, train_counts, val_counts = prepare_data(config, tokenizer, ctx.endpoint_url, splits)
    checkpointing, checkpointing_reason = activation_checkpointing(config, model_config, plan)
    global_batch = config.global_batch_size
    steps = config.num_steps or math.ceil(math.ceil(len(train_set) / global_batch) * config.num_epochs)
    setup = {  # logged now, and kept in the metrics
        "base_model": base_uri,
        "chat_template": template_source,
        "family": family.name,
        "attention": plan.attention,
        "activation_checkpointing": checkpointing,
        "device": plan.device,
        "bf16": plan.bf16,
        "liger": plan.liger,
    }
    log_config(
        config,
        {
            **setup,
            "eot": family.eot,
            "attention_reason": plan.attention_reason,
            "activation_checkpointing_reason": checkpointing_reason,
            "global_batch": global_batch,
            "tokens_per_step_max": global_batch * config.max_length,
            "num_train_conversations": len(train_set),
            "num_validation_conversations": len(val),
            "optimizer_steps": steps,
            "train_tokens": train_counts.num_tokens,
            "train_assistant_tokens": train_counts.num_assistant_tokens,
        },
    )

    trainer_dir = ctx.opt.checkpoint_dir / "trainer"  # Trainer's checkpoint-<step>/ folders
    trainer_dir.mkdir(parents=True, exist_ok=True)
    progress = progress_callback()
    trainer = build_trainer(
        config,
        load_model(base_dir, plan),  # held by the trainer only: the merge after training needs the memory back
        tokenizer,
        train_set,
        val,
        trainer_dir,
        plan,
        callbacks=[
            stop_on_sigterm_callback(stop_flag),
            seal_checkpoints_callback(),
            progress,
            tensorboard_callback(ctx.opt.tensorboard_dir),
        ],
        checkpointing=checkpointing,
    )
    trainable, total = trainer.model.get_nb_trainable_parameters()
    num_previewed = 0
    if config.num_label_preview_examples:
        num_previewed = write_label_preview(
            trainer.train_dataset, tokenizer, ctx.opt.model_dir / LABEL_PREVIEW_FILE, config.num_label_preview_examples
        )
        log.info("wrote %s: %d training example(s) with their loss mask", LABEL_PREVIEW_FILE, num_previewed)

    resume = latest_checkpoint(trainer_dir)
    before_file = ctx.opt.checkpoint_dir / "eval_before.json"  # the base model's loss, kept across resumes
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
    out = train(trainer, resume, progress)
    seconds = time.perf_counter() - start
    if stop_flag["stop"]:
        raise Terminated(
            f"stopped by SIGTERM at step {trainer.state.global_step}; checkpoint saved in "
            f"{trainer_dir}; rerun the stage to resume"
        )
    eval_after = trainer.evaluate()["eval_loss"]
    # the logged losses, including steps logged before a resume
    history = [
        {"step": e["step"], "loss": round(float(e["loss"]), 6)} for e in trainer.state.log_history if "loss" in e
    ]
    log.info("validation loss after: %.4f (before %.4f)", eval_after, eval_before)

    adapter_dir = ctx.opt.model_dir / ADAPTER_DIR
    save_adapter(trainer, tokenizer, adapter_dir, base_uri)
    trainer = None  # released before merging
    write_generation_defaults(adapter_dir, config.generation)
    if config.save_merged:
        save_merged(base_dir, adapter_dir, ctx.opt.model_dir / MERGED_DIR)
        write_generation_defaults(ctx.opt.model_dir / MERGED_DIR, config.generation)
    shutil.rmtree(ctx.opt.model_dir / "runs", ignore_errors=True)
    metrics = SftMetrics(
        **setup,
        trainable_parameters=trainable,
        total_parameters=total,
        eval_loss_before=eval_before,
        eval_loss_after=eval_after,
        train_loss=out.training_loss,
        train_loss_history=history,
        optimizer_steps=out.global_step,
        resumed_from_step=int(resume.name.split("-")[1]) if resume else 0,
        train_runtime_s=round(seconds, 3),
        train_steps_per_second=out.metrics.get("train_steps_per_second"),
        data={"train": asdict(train_counts), "validation": asdict(val_counts)},
        outputs=[ADAPTER_DIR, *([MERGED_DIR] if config.save_merged else [])],
        num_label_preview_examples=num_previewed,
    )
    return StageResult(metrics=metrics.model_dump())


def train(trainer, resume: Path | None, progress):
    """TRL's training loop, resumed from `resume`; the step progress closed however it ends (when training
    raises, the Trainer calls no callback)."""
    try:
        return trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        progress.close()


def check_answer_languages(train: list[Conversation], target: str, counts: DataCounts) -> None:
    """Log the language mix of the training answers (kept in the metrics); warn when most are not in `target`."""
    share = count_answer_languages(train, target, counts)
    mix = ", ".join(f"{k} {v}" for k, v in counts.answer_languages.items())
    if share >= 0.5:
        log.info("training answers: %.0f%% in %s (%s)", 100 * share, target, mix)
        return
    log.warning(
        f"only {share:.0%} of the training answers are in {target} ({mix}): the assistant learns to answer in the "
        f"language of its answers, not of the question; add answers in {target} (e.g. translation into it)"
    )


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
        found = resolve(source, "model", endpoint_url=ctx.endpoint_url, cache_dir=ctx.cache_dir)
    except ConfigError as exc:
        raise InputError(f"base_model: {str(exc).removeprefix(f'{choice.uri}: ')}", path=choice.uri) from None
    return found.path, found.uri


def load_tokenizer(model_dir: Path) -> tuple[Any, Family, str]:
    """(tokenizer, its family, where the chat template came from). A template without {% generation %} markers
    is replaced by the family's training template, so the assistant mask covers exactly assistant content + eot."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    vocab = tok.get_vocab()
    family = detect_family(vocab, str(model_dir))
    template_source = "tokenizer"
    if not tok.chat_template or not GENERATION_MARKER.search(tok.chat_template):
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


def prepare_data(
    config: SftConfig, tokenizer, endpoint_url: str | None, splits: tuple | None = None
) -> tuple[list[Example], list[Example], DataCounts, DataCounts]:
    """Read both splits with the counted record rules, then tokenise them once (the chat template) and apply the
    max-length rule with the real tokenizer."""
    train, val, train_counts, val_counts = splits or load_splits(config, endpoint_url)
    path, examples = config.train[0].uri, []
    for split, convs, counts in (("train", train, train_counts), ("validation", val, val_counts)):
        convs = refuse_special_tokens(convs, tokenizer, split, config.on_bad_record, counts, path)
        examples.append(apply_length_rule(convs, tokenizer, config.max_length, config.long_conversations, counts))
        if not examples[-1]:
            raise InputError(
                f"no conversation left after the long_conversations={config.long_conversations!r} rule "
                f"(max_length {config.max_length}); raise max_length",
                path=path,
            )
    return *examples, train_counts, val_counts
