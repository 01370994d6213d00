"""SFT stage config: LoRA fine-tuning of a CPT model into a chat assistant, loss on assistant turns only."""

from __future__ import annotations

import copy
from typing import Annotated, Any, ClassVar, Literal

from dilforge_shared.configs import (
    MAX_BATCH,
    MAX_STEPS,
    MAX_TOKENS,
    RUN_ONLY,
    DataSource,
    Precision,
    StageConfig,
    StrictModel,
    Switch,
)
from dilforge_shared.configs.language import LinguaCode
from dilforge_shared.specials import control_token_in, system_prompt_problem
from dilforge_shared.training import Batching, Checkpointing, SourceLimits, Warmup
from pydantic import BaseModel, Field, field_validator, model_validator

from .metrics import SftMetrics


def knob(group: type[BaseModel], name: str, default: Any) -> Any:
    """The shared field `name` of `group` (dilforge_shared.training) with SFT's default, everything else as
    defined there."""
    info = copy.copy(group.model_fields[name])
    info.default = default
    return info


class SftDataSource(DataSource, SourceLimits):
    """A chat or instruction data set and how its records map to a conversation.

    `layout`: messages (JSONL, {role, content} list under `messages_field`), instruction (JSONL instruction / input
    / response / system fields) or translation (TSV; the source column inside `translation_prompt` is the user
    turn, the target column the assistant turn)."""

    layout: Literal["messages", "instruction", "translation"] = Field(
        default="messages", description="How a record maps to a conversation (see class doc)."
    )
    messages_field: str = Field(default="messages", description="messages: field with the list of turns.")
    instruction_field: str = Field(default="instruction", description="instruction: field with the user request.")
    input_field: str | None = Field(
        default="input", description="instruction: optional field appended to the request after a blank line."
    )
    response_field: str = Field(default="response", description="instruction: field with the assistant answer.")
    system_field: str | None = Field(default="system", description="instruction: optional field with a system prompt.")
    source_field: str = Field(default="aze", description="translation: TSV column of the text to translate.")
    target_field: str = Field(default="eng", description="translation: TSV column of the expected translation.")
    translation_prompt: str = Field(
        default="Bu cümləni ingilis dilinə tərcümə et:\n{source}",
        description="translation: user turn; '{source}' is replaced by the source text.",
    )

    @model_validator(mode="after")
    def _check(self) -> SftDataSource:
        if self.layout == "translation" and "{source}" not in self.translation_prompt:
            raise ValueError("translation_prompt must contain '{source}'")
        if (token := control_token_in(self.translation_prompt)) is not None:
            raise ValueError(
                f"translation_prompt contains the control token {token!r}, which would forge a turn in every "
                "conversation"
            )
        return self


class LoraSettings(StrictModel):
    r: int = Field(le=4_096, default=64, ge=1, description="LoRA rank.")
    alpha: float = Field(default=28, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(default=0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names that get a LoRA adapter (never lm_head).",
    )

    @field_validator("target_modules")
    @classmethod
    def _no_lm_head(cls, modules: list[str]) -> list[str]:
        if "lm_head" in modules:
            raise ValueError("lm_head cannot carry an adapter (TRL computes logits from its weight)")
        return modules


class GenerationDefaults(StrictModel):
    """Repetition control a stock consumer of the model applies without being told: transformers reads both keys
    from generation_config.json; llama.cpp and Ollama honour only the penalty (`repeat_penalty`)."""

    repetition_penalty: float | None = Field(
        default=None,
        ge=1.0,
        le=2.0,
        description="Divides the logit of every token already in the context (transformers, llama.cpp "
        "repeat_penalty); None = not written (1.0, none).",
    )
    no_repeat_ngram_size: int | None = Field(
        default=None,
        ge=2,
        le=32,
        description="Never repeat a token n-gram of this size (transformers only); None = not written.",
    )


class SftConfig(StageConfig, Batching, Warmup, Checkpointing):
    """SFT: the shared training knobs (`training.Batching`, `training.Warmup`, `training.Checkpointing`; other defaults
    where SFT needs them) plus what only SFT has."""

    stage: ClassVar[str] = "sft"
    metrics_model: ClassVar[type[SftMetrics]] = SftMetrics
    artifact_kind: ClassVar[str] = "adapter"
    consumes: ClassVar[tuple[str, ...]] = ("cpt", "model")

    base_model: str | None = Field(
        default=None,
        description="Model to fine-tune: an HF model folder, an s3:// prefix of one, or a dilforge model artifact URI. "
        "None = the upstream 'cpt' artifact, else 'model' (the shared precedence rule, models.choose); a pipeline "
        "that also runs cpt or a model stage is refused.",
    )

    # ---- data -----------------------------------------------------------------------------
    train: list[SftDataSource] = Field(default_factory=list, description="Training sets (chat, instruction or TSV).")
    validation: list[SftDataSource] = Field(
        default_factory=list,
        description="Validation sets. When empty, validation_fraction of the training conversations is held out.",
    )
    validation_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="Share of training conversations held out when no validation set is given."
    )
    system_prompt: str | None = Field(
        default=None, description="System turn prepended to every conversation that has none."
    )
    target_language: LinguaCode | None = Field(
        default=None,
        description="ISO 639-1 code of the language the assistant should answer in: SFT reports the language mix "
        "of its training answers (lingua, among this language, en, tr and ru) in its metrics and warns when most "
        "are not in it. None = not measured.",
    )
    folded_user_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Share of the training conversations (seeded) whose user turns are typed without Azerbaijani's "
        "own letters (ə→e, ı→i, ş→s, ç→c, ğ→g, ö→o, ü→u), as many customers type; the answers keep them. Needs "
        "target_language az.",
    )
    on_bad_record: Literal["fail", "skip"] = Field(
        default="fail", description="A malformed record: stop with file:line (fail) or skip it and count it (skip)."
    )
    unknown_roles: Literal["bad_record", "drop_message"] = Field(
        default="bad_record",
        description="A role other than system/user/assistant: treat the record as bad, or drop that message (counted).",
    )
    empty_assistant_turns: Literal["drop_conversation", "drop_turn", "bad_record"] = Field(
        default="drop_conversation",
        description="An assistant turn with blank content: drop the conversation, drop that turn and the turns it "
        "answers, or treat the record as bad. Every case is counted.",
    )
    long_conversations: Literal["truncate", "drop"] = Field(
        default="truncate",
        description="A conversation longer than max_length tokens: keep its first max_length tokens (conversations "
        "with no assistant token left are dropped), or drop it. Both counted.",
    )

    # ---- model and training -----------------------------------------------------------------
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapter settings.")
    max_length: int = Field(
        le=MAX_TOKENS, default=1024, ge=16, description="Tokens per sequence (and per packed block)."
    )
    packing: bool = Field(
        default=False,
        description="Pack several conversations per sequence (best-fit decreasing, padding-free: documents are "
        "told apart by their position ids, never attend to each other).",
    )
    attention: Literal["auto", "sdpa", "flex_attention", "flash_attention_2", "eager"] = Field(
        json_schema_extra=RUN_ONLY,
        default="auto",
        description="Attention kernel. auto: with packing on CUDA, flash_attention_2 if the flash-attn package is "
        "installed, else flex_attention (a block-sparse mask of document boundaries, no N^2 mask); sdpa otherwise "
        "(on CPU, packed rows get a dense block-diagonal mask; the reason is logged).",
    )
    learning_rate: float = Field(default=1e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant_with_warmup"] = Field(
        default="cosine", description="Learning-rate schedule after warmup."
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay on the adapter.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    num_epochs: float = Field(le=1_000, default=2.0, gt=0, description="Passes over the training conversations.")
    num_steps: int | None = Field(
        le=MAX_STEPS,
        default=None,
        ge=1,
        description="Optimizer steps; None = num_epochs passes over the training conversations.",
    )
    global_batch_size: int = knob(Batching, "global_batch_size", 16)
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | Literal["auto"] = knob(
        Batching, "micro_batch_size", 8
    )
    warmup_ratio: float | None = knob(Warmup, "warmup_ratio", 0.03)
    activation_checkpointing: Switch = knob(Checkpointing, "activation_checkpointing", "auto")
    memory_budget_fraction: float = Field(
        json_schema_extra=RUN_ONLY,
        default=0.7,
        gt=0,
        le=1,
        description="activation_checkpointing auto: share of device memory the estimate may use before checkpointing "
        "is turned on.",
    )
    precision: Precision = Field(default="auto", description="auto: bf16 on CUDA, fp32 on CPU.")
    liger: Switch = Field(
        json_schema_extra=RUN_ONLY,
        default="auto",
        description="Liger layer kernels (RMSNorm, RoPE, SwiGLU): auto = on with CUDA, off on CPU; "
        "on = required (an error without CUDA).",
    )
    log_every: int = Field(
        json_schema_extra=RUN_ONLY, default=10, ge=1, description="Log the training loss every this many steps."
    )

    # ---- outputs --------------------------------------------------------------------------------
    generation: GenerationDefaults = Field(
        default_factory=GenerationDefaults,
        description="Decoding defaults written into the published generation_config.json (and read by serve, HF "
        "generate and the GGUF export's Modelfile).",
    )
    save_merged: bool = Field(
        default=True, description="Also publish merged/: base + adapter merged into plain safetensors weights."
    )
    num_label_preview_examples: int = Field(
        le=1_000,
        default=3,
        ge=0,
        description="Publish label_preview.jsonl: the first this many training examples exactly as the trainer "
        "sees them (token ids, per-token 'trained' flag, decoded text and decoded trained tokens), to audit where "
        "the loss falls. 0 disables.",
    )

    @field_validator("system_prompt")
    @classmethod
    def _system_prompt(cls, value: str | None) -> str | None:
        if value is not None and (problem := system_prompt_problem(value)) is not None:
            raise ValueError(f"system_prompt {problem}")
        return value

    @model_validator(mode="after")
    def _check(self) -> SftConfig:
        if not self.train:
            raise ValueError("train: give at least one training set")
        if self.folded_user_share and self.target_language != "az":
            raise ValueError("folded_user_share folds Azerbaijani letters: set target_language: az")
        if self.micro_batch_size == "auto":
            raise ValueError("micro_batch_size: auto is CPT's memory estimate; give sft.micro_batch_size a number")
        self.grad_accum_steps(1, "")
        return self

    def model_uris(self) -> list[str]:
        return [self.base_model] if self.base_model else []

    def data_sources(self) -> list[DataSource]:
        return [*self.train, *self.validation]
