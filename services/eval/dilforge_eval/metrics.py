"""The eval stage's metrics: every figure the report shows, section by section."""

from __future__ import annotations

from typing import Any

from dilforge_shared.fertility import SetFigures
from dilforge_shared.manifest import Metrics
from pydantic import Field


class HarnessInfo(Metrics):
    """The harness the downstream tasks ran in, and its settings."""

    name: str
    version: str
    bootstrap_iters: int
    batch_size: int


class DownstreamTask(Metrics):
    """One lm-eval task the stage wrote: what it measures, in which language, and its chance level."""

    task: str  # lm-eval task name
    kind: str  # sib200 | translation | instruction | multiple_choice
    language: str  # language of what is scored (target language for translation)
    row: str  # headline row; the language is the column
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
    leakage: dict[str, dict[str, dict[str, float | None]]] | None = Field(
        default=None, description="method -> validation set -> the CPT manifest's step-0 leakage row."
    )


class TokenizerComparison(Metrics):
    """eval's `tokenizer_comparison`: the tokenizer stage's strategies side by side and its dead-token audit."""

    rows: list[dict[str, Any]] = Field(description="The tokenizer manifest's `comparison` rows.")
    languages: list[str]
    dead_tokens: dict[str, Any] | None = Field(description="The audit as the tokenizer stage published it.")


class VocabSweep(Metrics):
    """eval's `vocab_sweep`: the tokenizer stage's fertility per vocabulary size, the selected size, the base's."""

    selected: int | None
    rows: list[dict[str, Any]] = Field(description="The tokenizer manifest's `sweep` rows.")
    base: dict[str, Any] | None = Field(description="The tokenizer manifest's `base`.")


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
