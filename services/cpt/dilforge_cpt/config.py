"""CPT stage config: continued pre-training of a Llama-family model on new-language text (no torch import: the
coordinator validates this config on machines without torch)."""

from __future__ import annotations

from typing import ClassVar, Literal

from dilforge_shared.configs import (
    MAX_STEPS,
    MAX_TOKENS,
    RUN_ONLY,
    DataSource,
    Precision,
    StageConfig,
    StrictModel,
    Switch,
    check_unique_labels,
)
from dilforge_shared.specials import control_token_in
from dilforge_shared.training import Batching, Checkpointing, SourceLimits, Warmup
from pydantic import Field, field_validator, model_validator

from .metrics import CptMetrics


class ScratchModel(StrictModel):
    """Architecture of a randomly initialised Llama (tests, demos, benchmarks). Vocab = the tokenizer's."""

    hidden_size: int = Field(le=65_536, default=64, ge=8, description="Model width.")
    intermediate_size: int = Field(le=262_144, default=128, ge=8, description="MLP width.")
    num_hidden_layers: int = Field(le=1_024, default=2, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(le=1_024, default=4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(le=1_024, default=2, ge=1, description="Key/value heads (GQA).")
    max_position_embeddings: int = Field(
        le=MAX_TOKENS, default=2048, ge=16, description="Longest sequence the model supports."
    )
    rope_theta: float = Field(default=500000.0, gt=0, description="RoPE base.")
    tie_word_embeddings: bool = Field(default=True, description="Share embedding and LM-head weights.")

    @model_validator(mode="after")
    def _check(self) -> ScratchModel:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class Phase(Warmup):
    """One training phase: its own steps, peak learning rate and warmup (`training.Warmup`: num_warmup_steps or
    warmup_ratio); cosine decay to min_lr_ratio × peak."""

    num_steps: int = Field(
        le=MAX_STEPS, default=0, ge=0, description="Optimizer steps in this phase; 0 skips the phase."
    )
    learning_rate: float = Field(default=1e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Cosine decays to learning_rate × min_lr_ratio.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay.")


class Phase1(Phase):
    """Phase 1 adapts the vocabulary: the backbone is frozen."""

    trainable: Literal["embeddings", "new_rows"] = Field(
        default="embeddings",
        description="What phase 1 trains: embeddings = the whole embedding and LM-head matrices; new_rows = only "
        "the rows of tokens the base model lacked (the rest stays bit-identical).",
    )


class Phase2(Phase):
    """Phase 2 trains every parameter."""

    embedding_learning_rate: float | None = Field(
        default=None,
        gt=0,
        description="Phase 2's peak learning rate of the embedding and LM-head matrices; None = learning_rate.",
    )
    kept_rows_learning_rate: float | None = Field(
        default=None,
        gt=0,
        description="Phase 2's peak learning rate of the vocabulary rows the base model already had (new rows keep "
        "embedding_learning_rate): a high rate there moves its other languages (docs/cpt.md, leakage). None = "
        "embedding_learning_rate for every row.",
    )


class ChatTurns(StrictModel):
    """How a record of a `chat` corpus becomes one conversation: templates over the record's fields (JSONL keys,
    TSV header columns), rendered in the tokenizer family's chat template."""

    user: str = Field(
        min_length=1,
        description="The user turn: a template over the record's fields, e.g. '{instruction}'.",
    )
    assistant: str = Field(min_length=1, description="The assistant turn, a template as `user`, e.g. '{response}'.")
    system_prompt: str | None = Field(default=None, description="System turn before the user's (none: no system turn).")

    @field_validator("user", "assistant", "system_prompt")
    @classmethod
    def _no_control_token(cls, value: str | None) -> str | None:
        """Rendered with the special tokens parsed: a control token here would be one in every conversation."""
        if value is not None and (token := control_token_in(value)) is not None:
            raise ValueError(f"holds the control token {token!r}, which would forge a turn in every conversation")
        return value


class CptDataSource(DataSource, SourceLimits):
    """A training corpus: a data source, its mixture `weight`, and how many documents of it to read (`max_docs`)."""

    chat: ChatTurns | None = Field(
        default=None,
        description="Read the records (JSONL objects or TSV rows) as conversations, one a document, in the "
        "tokenizer family's chat template: they keep the base's habit of answering in turns through phase 2 "
        "(docs/cpt.md). None: plain text.",
    )

    num_lines_per_document: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Join this many consecutive records (after max_docs) into one training document, separated "
        "by a space, so a sentence-per-line corpus does not teach ending after every sentence (docs/cpt.md).",
    )


class CptConfig(StageConfig, Batching, Checkpointing):
    """CPT: the shared training knobs (`training.Batching`, `training.Checkpointing`) plus what only CPT has."""

    stage: ClassVar[str] = "cpt"
    metrics_model: ClassVar[type[CptMetrics]] = CptMetrics
    artifact_kind: ClassVar[str] = "model"
    consumes: ClassVar[tuple[str, ...]] = ("model", "tokenizer")
    required_inputs: ClassVar[tuple[str, ...]] = ("tokenizer",)

    # ---- model -----------------------------------------------------------------------------
    base_model: str | None = Field(
        default=None,
        description="HF model folder (local path or s3:// prefix) or model artifact URI; None = the pipeline's "
        "`model` stage (input 'model'), or a random model shaped by scratch_model.",
    )
    scratch_model: ScratchModel | None = Field(
        default=None, description="Architecture of a random model; used only when base_model is None."
    )
    transplant: Literal["none", "mean_of_pieces"] = Field(
        default="mean_of_pieces",
        description="How vocabulary rows are initialised when the stage's tokenizer differs from the base "
        "model's: kept tokens keep their rows, a new token gets the mean of its base pieces' rows "
        "(mean_of_pieces); none = the tokenizers must be identical.",
    )
    measure_leakage: bool = Field(
        default=True,
        description="Also score the validation sets in the base model's tokenisation, at step 0 and each "
        "validation: the BPB the new rows take from text the base model handled (needs an extended vocabulary).",
    )

    # ---- data ------------------------------------------------------------------------------
    corpora: list[CptDataSource] = Field(
        default_factory=list,
        description="Training corpora; `weight` is each one's share of sampled windows (e.g. English replay).",
    )
    validation: list[DataSource] = Field(
        default_factory=list, description="Held-out text for validation loss and bits per byte (BPB)."
    )
    seq_len: int = Field(le=MAX_TOKENS, default=2048, ge=8, description="Tokens per packed training window.")
    num_validation_docs: int = Field(
        le=1_000_000, default=500, ge=1, description="Validation documents read (first N) per source."
    )
    validation_stride: int | None = Field(
        le=MAX_TOKENS,
        default=None,
        ge=1,
        description="Validation BPB slides windows of seq_len tokens by this many; None = seq_len // 2, as eval.",
    )
    tokenize_batch_size: int = Field(
        le=1_000_000, json_schema_extra=RUN_ONLY, default=1000, ge=1, description="Documents per encode_batch call."
    )
    tokenize_workers: int | None = Field(
        le=1_024,
        json_schema_extra=RUN_ONLY,
        default=None,
        ge=1,
        description="Processes tokenising the corpora into the token cache; None = every CPU this process may use "
        "(the cache's bytes do not depend on it).",
    )

    # ---- optimisation ----------------------------------------------------------------------
    phase1: Phase1 = Field(
        default_factory=lambda: Phase1(num_steps=0, learning_rate=1e-3),
        description="Embeddings + LM head only (all of them, or only the new rows: trainable).",
    )
    phase2: Phase2 = Field(
        default_factory=lambda: Phase2(num_steps=0, learning_rate=1e-4), description="All parameters."
    )
    max_grad_norm: float | None = Field(default=1.0, gt=0, description="Gradient clipping norm; None = off.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(default=0.95, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    precision: Precision = Field(
        default="auto",
        description="auto = bf16 on a CUDA GPU with bf16, bf16 autocast in a single process on a CPU with bf16 "
        "instructions, fp32 otherwise.",
    )

    # ---- distribution and kernels ----------------------------------------------------------
    num_processes_per_node: int | None = Field(
        le=1_024,
        json_schema_extra=RUN_ONLY,
        default=None,
        ge=1,
        description="Training processes per host; None = one per GPU (1 on CPU). More than one in total runs "
        "under torchrun.",
    )
    fsdp: Literal["auto", "on", "off"] = Field(
        json_schema_extra=RUN_ONLY,
        default="auto",
        description="FSDP2 fully_shard per decoder layer + root; auto = on with >1 process or on CUDA (one GPU "
        "runs the multi-GPU path in a one-rank group); off = plain module with autocast (single process only).",
    )
    distributed_backend: Literal["auto", "nccl", "gloo"] = Field(
        json_schema_extra=RUN_ONLY, default="auto", description="auto = nccl on CUDA, gloo on CPU."
    )
    master_port: int = Field(
        json_schema_extra=RUN_ONLY, default=29500, ge=1024, le=65535, description="Rendezvous port on multi-host runs."
    )
    compile: bool = Field(json_schema_extra=RUN_ONLY, default=False, description="torch.compile every decoder layer.")
    liger: Switch = Field(
        json_schema_extra=RUN_ONLY,
        default="auto",
        description="Liger layer kernels (RMSNorm, RoPE, SwiGLU): auto = on with CUDA, off on CPU; "
        "on = required (an error without CUDA).",
    )
    peak_tflops_per_device: float | None = Field(
        json_schema_extra=RUN_ONLY,
        default=None,
        gt=0,
        description="Peak dense TFLOP/s of one device for MFU; None = the known GPUs' bf16 peak, no MFU on CPU.",
    )

    # ---- logging, evaluation, checkpoints ------------------------------------------------
    log_every: int = Field(
        json_schema_extra=RUN_ONLY, default=10, ge=1, description="Log training metrics every this many steps."
    )
    eval_every: int = Field(
        json_schema_extra=RUN_ONLY, default=100, ge=1, description="Validation loss/BPB every N steps (and at the end)."
    )
    save_dtype: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="dtype of the published weights; auto = the training precision on CUDA, fp32 on CPU.",
    )

    @model_validator(mode="after")
    def _check(self) -> CptConfig:
        if self.base_model is not None and self.scratch_model is not None:
            raise ValueError("give base_model or scratch_model, not both")
        if not self.corpora:
            raise ValueError("corpora: at least one training corpus is needed")
        if not self.validation:
            raise ValueError("validation: at least one validation text set is needed (for loss and BPB)")
        check_unique_labels(self.corpora, "corpora")
        for source in self.corpora:
            if source.chat is not None and source.num_lines_per_document > 1:
                raise ValueError(
                    f"corpora[{source.label}]: a chat corpus is one conversation a document; "
                    "num_lines_per_document must be 1"
                )
        check_unique_labels(self.validation, "validation")
        if self.phase1.num_steps + self.phase2.num_steps == 0:
            raise ValueError("phase1.num_steps + phase2.num_steps is 0: nothing to train")
        if self.phase1.trainable == "new_rows" and self.phase1.weight_decay:
            raise ValueError(
                "phase1.weight_decay must be 0 with phase1.trainable: new_rows (decay would change the kept rows)"
            )
        for name in ("phase1", "phase2"):
            phase = getattr(self, name)
            if phase.num_steps and phase.warmup_steps(phase.num_steps) > phase.num_steps:
                raise ValueError(f"{name}.num_warmup_steps ({phase.num_warmup_steps}) exceeds {name}.num_steps")
        if self.micro_batch_size != "auto":
            self.grad_accum_steps(1, "")
        if self.scratch_model is not None and self.seq_len > self.scratch_model.max_position_embeddings:
            raise ValueError("seq_len exceeds scratch_model.max_position_embeddings")
        return self

    @property
    def num_steps(self) -> int:
        return self.phase1.num_steps + self.phase2.num_steps

    def model_uris(self) -> list[str]:
        return [self.base_model] if self.base_model else []

    def needed_inputs(self) -> tuple[str, ...]:
        if self.base_model is None and self.scratch_model is None:
            return (*super().needed_inputs(), "model")
        return super().needed_inputs()

    def data_sources(self) -> list[DataSource]:
        return [*self.corpora, *self.validation]
