"""One pydantic metrics model per stage: what it publishes in its manifest's `metrics` and what eval reads.

Validated on publish and parsed again on read with `extra="forbid"`, so a metric renamed on one side fails
the producer's publish or the consumer's tests. To add a metric: a typed field here, then write it in the stage."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import DilforgeError, InputError


class Metrics(BaseModel):
    """Base: unknown keys are an error, so a renamed metric cannot slip through."""

    model_config = ConfigDict(extra="forbid")


# ---- model --------------------------------------------------------------------------------------------


class ModelMetrics(Metrics):
    """The model stage's provenance (architecture.md "Base models are artifacts")."""

    source: str
    source_kind: str
    sha256: str
    package: str | None = None
    version: str | None = None
    file: str | None = None
    license: str | None = None
    description: str | None = None
    dequantized_from: str | None = None
    gguf_file: str | None = None
    gguf_sha256: str | None = None
    gguf_architecture: str | None = None
    gguf_tensors_skipped: list[str] = Field(default_factory=list)
    num_parameters: int
    dtype: str
    architecture: str | None = None
    vocab_size: int | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    tie_word_embeddings: bool | None = None
    family: str | None = None


# ---- curate -------------------------------------------------------------------------------------------


class CurateStep(Metrics):
    step: str
    removed: int
    reasons: dict[str, int] = Field(default_factory=dict)
    examples: list[str] = Field(default_factory=list)


class SourceCount(Metrics):
    read: int
    kept: int


class Redacted(Metrics):
    documents: int
    replaced: int


class CurateMetrics(Metrics):
    """The curate stage's counts (services/curate report.py); report.md and README.md carry the same."""

    language: str
    documents_read: int
    documents_kept: int
    chars_read: int
    chars_kept: int
    words_kept: int
    tokens_kept: int | None = None
    per_source: dict[str, SourceCount]
    empty_sources: list[str] = Field(default_factory=list)
    steps: list[CurateStep]
    repairs: dict[str, int]
    redacted: dict[str, Redacted]
    num_shards: int
    seconds: dict[str, float]
    bytes_read: int | None = None  # UTF-8 bytes of the documents read
    cpu_seconds: dict[str, float] = Field(default_factory=dict)  # per phase, summed over its tasks, and total
    mb_per_cpu_second: float | None = None  # throughput per core: MB read per CPU-second of every task
    documents_per_cpu_second: float | None = None


# ---- tokenizer ----------------------------------------------------------------------------------------


class SetFigures(Metrics):
    """A tokenizer measured on one text set (`textmetrics.TokenStats.summary`: the tokenizer stage's report and
    eval's `tokenizer_metrics`); ratios are NaN on an empty set."""

    tokens_per_word: float
    bytes_per_token: float
    share_words_3plus: float
    num_texts: int
    num_words: int
    num_tokens: int
    num_bytes: int
    num_words_3plus: int


class LanguageFigures(Metrics):
    """The headline figures of one validation set (tokenizer report.language_figures)."""

    tokens_per_word: float
    bytes_per_token: float
    frac_words_3plus: float


class StrategyRow(Metrics):
    """One strategy's candidate in the side-by-side comparison (`languages`: per validation set)."""

    strategy: str
    vocab_size: int
    num_new_tokens: int
    selected: bool
    languages: dict[str, LanguageFigures]
    dead_new_tokens_frac: float | None = None


class SweepRow(Metrics):
    """One candidate size of the configured strategy: replace records its regular vocabulary, extend the
    number of tokens it added."""

    vocab_size: int
    vocab_size_total: int | None = None
    vocab_size_regular: int | None = None
    num_added_tokens: int | None = None
    sets: dict[str, SetFigures]


class TokenizerBase(Metrics):
    uri: str
    sets: dict[str, SetFigures]


class TokenizerMetrics(Metrics):
    strategy: str
    family: str
    selected_vocab_size: int | None
    selection: dict[str, Any]
    word_definition: str
    comparison: list[StrategyRow]
    languages: dict[str, LanguageFigures]
    dead_tokens: dict[str, Any] = Field(description="The dead-token audit of the published tokenizer.")
    sweep: list[SweepRow]
    base: TokenizerBase | None = None
    output: dict[str, Any]
    corpus: dict[str, Any]
    seconds: dict[str, float]
    peak_rss_mib: float


# ---- cpt ----------------------------------------------------------------------------------------------


class TrainRow(Metrics):
    """One logged optimizer step."""

    step: int
    phase: int
    loss: float
    lr: float
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None
    peak_memory_gb: float | None = None


SET_PREFIX = "val_bpb/"  # a validation row holds one `val_bpb/<set name>` per validation set


class ValidationRow(BaseModel):
    """One validation pass: loss and BPB over all sets, and `val_bpb/<set>` per set (read as `by_set`)."""

    model_config = ConfigDict(extra="allow")
    step: int
    val_loss: float
    val_bpb: float
    eval_peak_memory_gb: float | None = None

    @model_validator(mode="after")
    def _only_per_set_bpb(self) -> ValidationRow:
        for key, value in (self.model_extra or {}).items():
            if not key.startswith(SET_PREFIX) or not isinstance(value, (int, float)):
                raise ValueError(f"unknown validation metric {key!r} (only {SET_PREFIX}<set> may be added)")
        return self

    @property
    def by_set(self) -> dict[str, float]:
        return {k.removeprefix(SET_PREFIX): float(v) for k, v in (self.model_extra or {}).items()}


class LeakageRow(Metrics):
    """One initialisation on one validation set at step 0 (services/cpt leakage.py); only `bpb_extended`
    where the base tokenisation cannot be scored."""

    bpb_extended: float
    bpb_base_model: float | None = None
    extended_vs_base: float | None = None
    bpb_base_tokenization: float | None = None
    base_tokenization_vs_base: float | None = None


class Transplant(Metrics):
    """How the base model's vocabulary became the stage's: kept/new rows and the step-0 BPB of each
    initialisation compared (`step0_val_bpb[method]`, per validation set in `step0_val_bpb_by_set`)."""

    method: str
    reason: str | None = None
    num_kept: int | None = None
    num_new: int | None = None
    base_vocab_size: int | None = None
    new_vocab_size: int | None = None
    step0_val_bpb: dict[str, float] = Field(default_factory=dict)
    step0_val_bpb_by_set: dict[str, dict[str, float]] = Field(default_factory=dict)
    step0_leakage: dict[str, dict[str, LeakageRow]] = Field(
        default_factory=dict, description="The step-0 leakage table: method -> validation set -> row."
    )
    tied: bool | None = None  # the trained model ties embedding and LM head
    leakage_not_measured: str | None = None  # why there is no leakage table (base tokens missing from the vocab)


class LeakageEntry(Metrics):
    """One leakage measurement (step 0 or a validation): per set {bpb_base_tokenization, bpb_kept_rows,
    leakage}."""

    step: int
    sets: dict[str, dict[str, float]]


class CptMetrics(Metrics):
    num_steps: int
    tokens_seen: int
    final_train_loss: float | None
    final_val_loss: float | None
    final_val_bpb: float | None
    final_val_bpb_by_set: dict[str, float]
    best_val_bpb: float | None
    step0_val_loss: float | None
    step0_val_bpb: float | None
    step0_val_bpb_by_set: dict[str, float]
    transplant: Transplant | None
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_gb: float | None
    eval_peak_memory_gb: float | None
    world_size: int
    global_batch_sequences: int
    global_batch_tokens: int
    total_tokens: int
    num_params: int
    liger_kernels: list[str]
    dtype: str
    history: list[TrainRow]
    validation: list[ValidationRow]
    leakage: list[LeakageEntry] = Field(default_factory=list)  # step 0 and every validation

    def cost(self) -> dict[str, float]:
        """Time, token and memory figures the eval report lists."""
        figures = {
            "tokens_seen": self.tokens_seen,
            "total_tokens": self.total_tokens,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "peak_memory_gb": self.peak_memory_gb,
            "eval_peak_memory_gb": self.eval_peak_memory_gb,
        }
        return {k: v for k, v in figures.items() if v is not None}

    def curves(self) -> dict[str, list[tuple[float, float]]]:
        """Loss per step (train) and validation loss per step."""
        out = {
            "loss": [(float(r.step), r.loss) for r in self.history],
            "validation/val_loss": [(float(r.step), r.val_loss) for r in self.validation],
        }
        return {k: v for k, v in out.items() if v}


# ---- sft ----------------------------------------------------------------------------------------------


class LossPoint(Metrics):
    step: int
    loss: float


class SftMetrics(Metrics):
    base_model: str
    chat_template: str
    family: str
    attention: str
    activation_checkpointing: bool
    device: str
    bf16: bool
    liger: bool
    trainable_parameters: int
    total_parameters: int
    eval_loss_before: float
    eval_loss_after: float
    train_loss: float
    train_loss_history: list[LossPoint]
    optimizer_steps: int
    resumed_from_step: int
    train_runtime_s: float
    train_steps_per_second: float | None = None
    data: dict[str, dict[str, Any]] = Field(description="Record counts per split (sft data.DataCounts).")
    outputs: list[str]
    num_label_preview_examples: int

    def cost(self) -> dict[str, float]:
        figures = {
            "train_runtime_s": self.train_runtime_s,
            "train_steps_per_second": self.train_steps_per_second,
            "optimizer_steps": self.optimizer_steps,
        }
        return {k: v for k, v in figures.items() if v is not None}

    def curves(self) -> dict[str, list[tuple[float, float]]]:
        return {"loss": [(float(p.step), p.loss) for p in self.train_loss_history]} if self.train_loss_history else {}


# ---- eval ---------------------------------------------------------------------------------------------


class HarnessInfo(Metrics):
    """The harness the downstream tasks ran in, and its settings."""

    name: str
    version: str
    bootstrap_iters: int
    batch_size: int


class DownstreamTask(Metrics):
    """One lm-eval task the stage wrote (services/eval downstream.TaskSpec, less its key)."""

    task: str
    kind: str
    language: str
    row: str
    metrics: list[str]
    headline_metrics: list[str]
    num_examples: int
    num_fewshot: int = 0
    chat: bool = False
    chance: dict[str, float] = Field(default_factory=dict, description="metric -> chance / trivial-baseline value.")
    chance_note: str = ""
    source: str = ""


class TaskScore(Metrics):
    """One metric of one model on one task: value, standard error and the normal 95 % interval."""

    value: float
    stderr: float | None = None
    ci95: tuple[float, float] | None = None


class Downstream(Metrics):
    """eval's downstream tasks (lm-eval): what each task is, how to rerun it, each model's scores and the change
    against the reference model (services/eval downstream.py)."""

    harness: HarnessInfo
    task_dir: str
    commands: list[str]
    tasks: dict[str, DownstreamTask]
    results: dict[str, dict[str, dict[str, TaskScore]]] = Field(description="model -> task -> metric -> score.")
    seconds: dict[str, float]
    changes: dict[str, dict[str, dict[str, float]]] = Field(
        default_factory=dict, description="model -> task -> metric -> value minus the reference model's."
    )


class EvalModel(Metrics):
    """One evaluated model (`models[label]`)."""

    origin: str
    num_parameters: int
    adapter: bool
    bpb_window: int
    bpb_stride: int
    dtype: str
    device: str
    load_seconds: float
    tasks_seconds: float | None = None
    tasks_cpu_seconds: float | None = None


class EvalTokenizer(Metrics):
    """One measured tokenizer (`tokenizers[label]`); `aliases`: labels of the same tokenizer measured once."""

    origin: str
    vocab_size: int
    aliases: list[str] = Field(default_factory=list)


class TextSet(Metrics):
    uri: str
    language: str
    num_docs: int
    num_bytes: int


class ParityFigures(Metrics):
    """Tokens of the Azerbaijani side over the English side of one parallel set."""

    tokens_az: int
    tokens_en: int
    num_pairs: int
    parity: float | None


class MorphFigures(Metrics):
    """Token boundaries against gold morpheme boundaries (services/eval morph.py); ratios None when undefined."""

    boundary_recall: float | None
    inside_morpheme_rate: float | None
    exact_segmentation_rate: float | None
    num_words: int
    num_gold_boundaries: int
    num_gold_hit: int
    num_token_boundaries_decidable: int
    num_token_boundaries_inside: int
    num_words_exact: int
    num_words_fully_known: int


class BpbFigures(Metrics):
    """A model on one text set (`dilforge_shared.bpb`)."""

    bpb: float
    bits_per_token: float
    bytes_per_second: float | None
    num_bytes: int
    num_tokens: int
    num_windows: int
    seconds: float
    bits: float


class BpbChange(Metrics):
    """A model's BPB on one set against the reference model's; change = bpb / reference_bpb - 1."""

    language: str | None
    bpb: float | None
    reference_bpb: float | None
    change: float | None


class HeadlineEntry(BpbChange):
    set: str


class Headline(Metrics):
    """Per model: the gain on the target language's first set, the retention on every other language's first set."""

    reference: str | None
    target_language: str
    gain: dict[str, HeadlineEntry]
    retention: dict[str, dict[str, HeadlineEntry]]


class GenerationFigures(Metrics):
    """Means over one model's generations in one decoding mode (services/eval generate.py)."""

    num_generations: int
    num_words: float | None
    distinct_1: float | None
    distinct_2: float | None
    repeated_3gram_rate: float | None


class Share(Metrics):
    """A share of answers (`count` of `n`) with its 95 % Wilson score interval; None when n is 0."""

    count: int
    n: int
    value: float | None
    low: float | None
    high: float | None


class ChrfFigures(Metrics):
    """Corpus chrF++ (sacrebleu) of the answers that have a reference, with sacrebleu's bootstrap 95 % interval."""

    score: float
    low: float | None
    high: float | None
    n: int


class AssistantFigures(Metrics):
    """One model's answers to one prompt group (services/eval assistant.py defines each measure)."""

    language: str = Field(description="The language the answers should be in (the prompts').")
    n: int
    in_language: Share
    ended_turn: Share
    looping: Share
    parroting: Share
    chrf: ChrfFigures | None = None


class AssistantThresholds(Metrics):
    """The shares below which `serve`, `deploy` and `export` refuse a model unless forced."""

    language: str
    min_in_language: float
    min_ended_turn: float


class AssistantSection(Metrics):
    """eval's `assistant`: held-out prompts answered through each model's published generation defaults."""

    prompts: str
    max_new_tokens: int
    batch_size: int
    thresholds: AssistantThresholds
    figures: dict[str, dict[str, AssistantFigures]] = Field(description="model -> prompt group -> figures.")
    generation_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="model -> the generation defaults its answers were decoded with."
    )
    seconds: dict[str, float] = Field(default_factory=dict, description="model -> seconds generating.")


class Step0Section(Metrics):
    """eval's `transplant`: step-0 BPB per initialisation and validation set, and the leakage table, from the CPT
    manifest (services/eval compare.step0_bpb)."""

    method: str
    sets: list[str]
    step0_bpb: dict[str, dict[str, float]] = Field(description="method -> validation set -> step-0 BPB.")
    leakage: dict[str, dict[str, LeakageRow]] | None = None


class TokenizerComparison(Metrics):
    """eval's `tokenizer_comparison`: the tokenizer stage's strategies side by side and its dead-token audit."""

    rows: list[StrategyRow]
    languages: list[str]
    dead_tokens: dict[str, Any] | None = Field(description="The audit as the tokenizer stage published it.")


class VocabSweep(Metrics):
    """eval's `vocab_sweep`: the tokenizer stage's fertility per vocabulary size, the selected size, the base's."""

    selected: int | None
    rows: list[SweepRow]
    base: TokenizerBase | None


class EvalMetrics(Metrics):
    """The eval summary in the manifest (metrics.json beside the report has the full curves). The stage builds
    it, section by section, before writing the report, and the report reads its attributes."""

    models: dict[str, EvalModel]
    tokenizers: dict[str, EvalTokenizer]
    text_sets: dict[str, TextSet]
    tokenizer_metrics: dict[str, dict[str, SetFigures]]
    parity: dict[str, dict[str, ParityFigures]]
    morph: dict[str, dict[str, MorphFigures]]
    bpb: dict[str, dict[str, BpbFigures]]
    bpb_change: dict[str, dict[str, BpbChange]]
    headline: Headline
    generation: dict[str, dict[str, GenerationFigures]]
    curves: dict[str, dict[str, Any]]
    cost: dict[str, dict[str, float]]
    vocab_sweep: VocabSweep | None = None
    tokenizer_comparison: TokenizerComparison | None = None
    transplant: Step0Section | None = None
    downstream: Downstream | None = None
    assistant: AssistantSection | None = None
    skipped: list[str]
    seconds: dict[str, float]
    report: dict[str, str] = Field(default_factory=dict, description="The report's files, relative to the artifact.")


STAGE_METRICS: dict[str, type[BaseModel]] = {
    "curate": CurateMetrics,
    "model": ModelMetrics,
    "tokenizer": TokenizerMetrics,
    "cpt": CptMetrics,
    "sft": SftMetrics,
    "eval": EvalMetrics,
}


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"metrics.{where}: {err['msg']}{more}"


def validate_metrics(stage: str, metrics: dict[str, Any]) -> BaseModel:
    """The stage's metrics model for what a run is about to publish (DilforgeError naming the field: a bug
    in the stage, caught before anything is published)."""
    try:
        return STAGE_METRICS[stage].model_validate(metrics)
    except ValidationError as exc:
        raise DilforgeError(
            f"stage {stage} publishes metrics that do not match "
            f"dilforge_shared.metrics.{STAGE_METRICS[stage].__name__}: {_first_error(exc)}"
        ) from None


def read_metrics(stage: str, metrics: dict[str, Any], uri: str) -> Any:
    """An upstream manifest's metrics, typed; InputError naming the artifact and field when they do not parse."""
    try:
        return STAGE_METRICS[stage].model_validate(metrics)
    except ValidationError as exc:
        raise InputError(
            f"{stage} metrics do not match {STAGE_METRICS[stage].__name__} (an artifact of another "
            f"dilforge version?): {_first_error(exc)}",
            path=uri,
        ) from None
