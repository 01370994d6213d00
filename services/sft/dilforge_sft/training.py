"""TRL, PEFT and transformers as libraries: the base model (with Liger's layer kernels on CUDA), the LoRA config,
TRL's SFTConfig from the stage config (every knob from SftConfig, nothing from TRL's defaults by accident), the
SFTTrainer, and the callbacks (SIGTERM → checkpoint and stop; progress; TensorBoard where SageMaker uploads it;
checkpoints sealed with a digest marker after each save, resumed from the newest that verifies)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared import runtime_policy
from dilforge_shared.errors import ConfigError
from dilforge_shared.progress import Progress
from dilforge_shared.runtime_policy import DeviceFacts, RuntimePolicy
from dilforge_shared.training import seal, set_aside, training_bytes, verify

from .config import SftConfig
from .data import Example

log = logging.getLogger("dilforge.sft")


@dataclass(frozen=True)
class SftPlan(RuntimePolicy):
    attention: str  # transformers' attn_implementation
    attention_reason: str


def decide_runtime(config: SftConfig, model_type: str | None = None, facts: DeviceFacts | None = None) -> SftPlan:
    """Device, precision (never bf16 on CPU) and Liger by the shared policy; then the attention kernel. Packed rows
    hold several conversations told apart by position ids: flash-attention's varlen path and flex attention take
    those boundaries natively; SDPA gets a dense block-diagonal mask, which disables its flash kernel on CUDA."""
    facts = runtime_policy.probe_device() if facts is None else facts
    policy = runtime_policy.decide(
        "sft", precision=config.precision, liger=config.liger, model_type=model_type, cpu_bf16=False, facts=facts
    )
    cuda, requested = policy.device == "cuda", config.attention
    if requested == "flash_attention_2" and not (cuda and facts.flash_attn):
        raise ConfigError("sft.attention: flash_attention_2 needs CUDA and the flash-attn package; use auto")
    if requested != "auto":
        attention = requested, "set by sft.attention"
    elif not config.packing:
        attention = "sdpa", "no packing: padded rows, sdpa's own causal kernels"
    elif not cuda:
        attention = "sdpa", "packing on CPU: sdpa with a dense block-diagonal mask from the position ids (N^2 per row)"
    elif facts.flash_attn:
        attention = "flash_attention_2", "packing on CUDA: flash-attn varlen kernel on the collator's cu_seq_lens"
    else:
        attention = "flex_attention", "packing on CUDA without flash-attn: flex attention, block-sparse document mask"
    return SftPlan(**vars(policy), attention=attention[0], attention_reason=attention[1])


def activation_checkpointing(
    config: SftConfig, model_config, plan: SftPlan, memory: int | None = None
) -> tuple[bool, str]:
    """(recompute activations?, why): `auto` turns it on only when the memory estimate of LoRA training without
    it (`training.training_bytes`) exceeds memory_budget_fraction of `memory` (default: the device's)."""
    if config.activation_checkpointing != "auto":
        return config.activation_checkpointing == "on", "set by sft.activation_checkpointing"
    if memory is None and plan.device == "cuda":
        import torch

        memory = int(torch.cuda.get_device_properties(0).total_memory)
    elif memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = config.micro_batch_size * config.max_length
    estimate = sum(training_bytes(model_config, tokens, full=False, bf16=plan.bf16, fused_loss=plan.liger))
    budget = int(memory * config.memory_budget_fraction)
    gib = 2**30
    if estimate > budget:
        return True, f"estimated {estimate / gib:.1f} GiB > budget {budget / gib:.1f} GiB: recompute activations"
    return False, f"estimated {estimate / gib:.1f} GiB <= budget {budget / gib:.1f} GiB: no recomputation"


def load_model(model_dir: Path, plan: SftPlan):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=plan.torch_dtype(),
        attn_implementation=plan.attention,
        trust_remote_code=False,
    )
    if plan.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # layer kernels only: TRL replaces the LM head/loss with its own fused one
        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
        )
    return model


def sft_arguments(config: SftConfig, output_dir: Path, plan: SftPlan, checkpointing: bool = False):
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
        # an int is a count of steps, a float below 1 a share of them
        warmup_steps=config.num_warmup_steps
        if config.num_warmup_steps is not None
        else float(config.warmup_ratio or 0),
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
    plan: SftPlan,
    callbacks: list | None = None,
    checkpointing: bool = False,
):
    """TRL's SFTTrainer with LoRA on the stage's tokenised conversations (`prepare_data`): TRL builds the labels
    from their assistant masks, truncates or packs them; it does not apply the chat template again."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTTrainer

    return SFTTrainer(
        model=model,
        args=sft_arguments(config, output_dir, plan, checkpointing),
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(val),
        peft_config=LoraConfig(
            r=config.lora.r,
            lora_alpha=config.lora.alpha,
            lora_dropout=config.lora.dropout,
            target_modules=list(config.lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        ),
        callbacks=callbacks or [],
    )


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


def progress_callback():
    """The steps through the shared progress helper, as every stage shows them: a bar on a terminal, else a log
    line with an ETA every 25 s and a heartbeat when a step takes longer (the Trainer's own tqdm is off: its
    carriage returns make an unreadable job log)."""
    from transformers import TrainerCallback

    class StepProgress(TrainerCallback):
        progress: Progress | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            enabled = state.is_world_process_zero
            self.progress = Progress(
                "sft", state.max_steps, unit="steps", initial=state.global_step, log=log, enabled=enabled
            )

        def on_step_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.update(state.global_step - self.progress.n)

        def on_train_end(self, args, state, control, **kwargs):
            self.close()

        def close(self) -> None:
            """Also called by the stage when training raises: the Trainer then calls no callback, and the
            heartbeat would go on logging a pass that has ended."""
            if self.progress is not None:
                self.progress.close()
                self.progress = None

    return StepProgress()


def tensorboard_callback(log_dir: Path):
    """transformers' own TensorBoardCallback, writing where SageMaker uploads TensorBoard logs. Not `report_to=
    "tensorboard"`: transformers 5 dropped `logging_dir`, so that would log under output_dir/runs/ (or need
    TENSORBOARD_LOGGING_DIR set in os.environ while running)."""
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    return TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(log_dir)))


def latest_checkpoint(folder: Path) -> Path | None:
    """Newest Trainer checkpoint whose files match their digests. A cut-off one (trainer_state.json, written
    last, missing or unparsable) is removed; a damaged or unsealed one is set aside with a warning; then the
    previous one is tried."""
    from transformers.trainer_utils import get_last_checkpoint

    while folder.is_dir() and (found := get_last_checkpoint(folder)):
        path = Path(found)
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (ValueError, OSError):
            log.warning("removing incomplete checkpoint %s (no complete trainer_state.json)", path)
            shutil.rmtree(path)
            continue
        if (problem := verify(path)) is None:
            return path
        aside = set_aside(path, "damaged-" + path.name)
        log.warning(
            "checkpoint %s is damaged (%s); set aside as %s, trying the previous one",
            path,
            problem,
            aside.name if aside else "(already)",
        )
    return None


def seal_checkpoints_callback():
    """Digests of every file of a checkpoint, written right after Trainer saved it (rotation included)."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class SealCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if args.should_save and folder.is_dir():
                seal(folder, state.global_step)

    return SealCheckpoints()
