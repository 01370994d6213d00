"""Eval stage config: which models, tokenizers, text sets and resources the report compares."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from dilforge_shared.configs import (
    MAX_BATCH,
    MAX_TOKENS,
    RUN_ONLY,
    DataSource,
    Precision,
    StageConfig,
    StrictModel,
)
from pydantic import AfterValidator, Field, model_validator

from .metrics import EvalMetrics

Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,39}$", description="Name shown in the report.")]
Language = Annotated[str, Field(pattern=r"^[a-z]{2,3}$", description="2-3 letter language code.")]
MAX_NEW_TOKENS = 32_768  # far above any real answer: a typo such as 1e9 is refused
BASE_LABEL = "base"  # the label of the upstream `model` input (the pipeline's base model)
SIB_LABELS = ("science/technology", "travel", "politics", "sports", "health", "entertainment", "geography")


def _builtin_name(value: str) -> str:
    """`builtin:NAME` names a file shipped with the eval service, never a path (`builtin:../../x` read any file)."""
    if value.startswith("builtin:") and not re.fullmatch(r"builtin:[a-z0-9][a-z0-9_-]{0,63}", value):
        raise ValueError(f"{value!r}: a built-in prompt set is `builtin:` and a name (letters, digits, - and _)")
    return value


PromptsUri = Annotated[str, AfterValidator(_builtin_name)]
Count = Annotated[int | None, Field(ge=1)]  # at most this many (the first ones); None = all


def _unique(values: list[str], what: str, hint: str = "") -> None:
    if dupes := sorted({x for x in values if values.count(x) > 1}):
        raise ValueError(f"{what} {dupes}{hint}")


class ModelRef(StrictModel):
    """A causal LM to evaluate besides the upstream CPT/SFT models (e.g. the stock base model)."""

    label: Label
    uri: str = Field(description="HF model folder (local or s3://) or a dilforge artifact (folder or manifest URI).")
    tokenizer_uri: str | None = Field(default=None, description="Tokenizer folder if it is not next to the model.")
    adapter_uri: str | None = Field(default=None, description="PEFT adapter folder applied on top of the model.")


class TokenizerRef(StrictModel):
    """A tokenizer to compare (fertility, morpheme alignment) without a model."""

    label: Label
    uri: str = Field(description="HF tokenizer folder (local or s3://), a tokenizer.json or a dilforge artifact.")


class ParallelSet(StrictModel):
    """Aligned Azerbaijani/English text for tokenizer parity (tokens az / tokens en); document i of `az` aligns
    with document i of `en`."""

    name: Label
    az: DataSource
    en: DataSource


class MorphResources(StrictModel):
    """Gold morphology for the morpheme-alignment metric (docs/eval.md has the file layouts and the method)."""

    segmented: list[str] = Field(default_factory=list, description="TSV word<TAB>segmentation ('kitab+lar').")
    lemma_forms: list[str] = Field(default_factory=list, description="TSV lemma/form pairs (UniMorph or a header).")
    conllu: list[str] = Field(default_factory=list, description="CoNLL-U: lemmas and '# glossing =' comments.")
    num_words_per_source: int = Field(le=1_000_000, default=2000, ge=1, description="Words sampled per source.")


class GenerationSettings(StrictModel):
    modes: list[Literal["greedy", "sampled"]] = Field(default=["greedy", "sampled"], description="Decoding modes.")
    max_new_tokens: int = Field(le=MAX_NEW_TOKENS, default=64, ge=1, description="New tokens per answer.")
    temperature: float = Field(default=0.7, gt=0, description="Sampling temperature (sampled mode).")
    top_p: float = Field(default=0.9, gt=0, le=1, description="Nucleus sampling mass (sampled mode).")
    repetition_penalty: float = Field(
        default=1.0, gt=0, description="CTRL penalty on tokens already seen; 1.0 = none (raw behaviour)."
    )
    no_repeat_ngram_size: int = Field(le=64, default=0, ge=0, description="Never repeat an n-gram this long; 0 = off.")
    num_prompts: Count = Field(default=None, description="Use at most this many prompts (demos).")


class AssistantSettings(StrictModel):
    """Held-out user turns answered through each model's published generation defaults and scored as an
    assistant (docs/eval.md "Assistant measures"); `min_*` are the gate `serve`, `deploy` and `export` apply to
    the SFT model's answers in the target language (below it they refuse the model unless --force)."""

    prompts: PromptsUri = Field(
        default="builtin:assistant", description="JSONL {id, language, prompt, reference?} or 'builtin:assistant'."
    )
    per_language: Count = Field(default=40, description="Prompts per language (the first ones of each).")
    no_diacritics: bool = Field(default=True, description="Also the target language typed without its letters.")
    max_new_tokens: int = Field(le=MAX_NEW_TOKENS, default=64, ge=1, description="An answer reaching it did not end.")
    batch_size: int = Field(le=MAX_BATCH, json_schema_extra=RUN_ONLY, default=40, ge=1, description="Prompts per call.")
    min_in_language: float = Field(default=0.9, ge=0, le=1, description="Gate: least share in the language.")
    min_ended_turn: float = Field(default=0.9, ge=0, le=1, description="Gate: least share that end the turn.")


class BpbSettings(StrictModel):
    window: int | None = Field(
        le=MAX_TOKENS, default=None, ge=8, description="Tokens per window; None = max_position_embeddings, ≤ 2048."
    )
    stride: int | None = Field(le=MAX_TOKENS, default=None, ge=1, description="Window step in tokens; None = window/2.")
    batch_size: int = Field(le=MAX_BATCH, json_schema_extra=RUN_ONLY, default=8, ge=1, description="Windows per pass.")

    @model_validator(mode="after")
    def _check(self) -> BpbSettings:
        if self.window is not None and self.stride is not None and self.stride > self.window:
            raise ValueError(f"bpb.stride ({self.stride}) must not exceed bpb.window ({self.window})")
        return self


class SibTask(StrictModel):
    """SIB-200 topic classification (docs/eval.md): a file with a split, a topic and one text column per
    language (the FLORES-200 dev file with SIB-200 labels); test rows scored, k shots from train."""

    uri: str
    languages: dict[Language, str] = Field(
        default_factory=lambda: {"az": "azj_Latn", "en": "eng_Latn"}, description="Language -> text column."
    )
    label_field: str = "sib_category"
    split_field: str = "sib_split"
    num_fewshot: list[Annotated[int, Field(ge=0, le=64)]] = Field(default=[0, 5], min_length=1)
    max_examples: Count = None


class TranslationSet(StrictModel):
    """Aligned Azerbaijani/English sentences (line i with line i) scored as translation (chrF++, BLEU)."""

    name: Label
    az: DataSource
    en: DataSource
    directions: list[Literal["az-en", "en-az"]] = Field(default=["az-en", "en-az"], min_length=1)
    max_examples: Count = None


class InstructionTask(StrictModel):
    """Instruction answering with the model's chat template (chrF++ against the reference, share of answers in
    the task language, repetition); rows from JSONL/TSV/CSV."""

    name: Label = "khazar"
    uri: str
    instruction_field: str = "instruction"
    response_field: str = "response"
    language: Literal["az", "en"] = "az"
    system_prompt: str | None = Field(default=None, description="System turn before every instruction.")
    max_examples: Count = None


class MultipleChoiceTask(StrictModel):
    """A multiple-choice file in the Belebele or TUMLU layout (docs/eval.md), scored as lm-eval scores them."""

    name: Label
    uri: str
    layout: Literal["belebele", "tumlu"]
    language: Language
    fewshot_uri: str | None = Field(default=None, description="Shots' file; None = rows of `uri` not scored.")
    num_fewshot: int = Field(le=64, default=0, ge=0)
    max_examples: Count = None


class DownstreamTasks(StrictModel):
    """Downstream tasks run through lm-evaluation-harness with the task configs shipped in
    dilforge_eval/tasks (docs/eval.md has the `lm_eval` command that reproduces every figure)."""

    sib200: SibTask | None = None
    translation: list[TranslationSet] = Field(default_factory=list)
    instructions: InstructionTask | None = None
    multiple_choice: list[MultipleChoiceTask] = Field(default_factory=list)
    translation_max_new_tokens: int = Field(le=MAX_NEW_TOKENS, default=64, ge=1)
    instruction_max_new_tokens: int = Field(le=MAX_NEW_TOKENS, default=128, ge=1)
    batch_size: int = Field(le=MAX_BATCH, json_schema_extra=RUN_ONLY, default=8, ge=1)
    max_length: int = Field(le=MAX_TOKENS, default=2048, ge=64, description="Longest prompt+answer in tokens.")
    bootstrap_iters: int = Field(le=100_000, default=1000, ge=0, description="For chrF++/BLEU stderr; 0 = none.")

    @model_validator(mode="after")
    def _check(self) -> DownstreamTasks:
        names = [t.name for t in [*self.translation, *self.multiple_choice, *filter(None, [self.instructions])]]
        _unique(names, "tasks: duplicate names")
        by_task: dict[str, list[str]] = {}  # lm-eval task names write '-' and '.' as '_'
        for name in names:
            by_task.setdefault(re.sub(r"[-.]", "_", name).lower(), []).append(name)
        if clash := next((sorted(group) for group in by_task.values() if len(group) > 1), None):
            raise ValueError(f"tasks: names {clash} become the same lm-eval task; rename one")
        return self

    @property
    def system_prompt(self) -> str | None:
        """The system turn of the chat tasks (the instruction task's), for the stage and its `lm_eval` command."""
        return self.instructions.system_prompt if self.instructions else None

    def data_sources(self) -> list[DataSource]:
        out = [DataSource(uri=self.sib200.uri, name="tasks.sib200")] if self.sib200 else []
        for t in self.translation:
            out += [getattr(t, side).model_copy(update={"name": f"tasks.{t.name}.{side}"}) for side in ("az", "en")]
        if self.instructions:
            out.append(DataSource(uri=self.instructions.uri, name=f"tasks.{self.instructions.name}"))
        for t in self.multiple_choice:
            out.append(DataSource(uri=t.uri, name=f"tasks.{t.name}"))
            if t.fewshot_uri:
                out.append(DataSource(uri=t.fewshot_uri, name=f"tasks.{t.name}.fewshot"))
        return out


class EvalConfig(StageConfig):
    stage: ClassVar[str] = "eval"
    metrics_model: ClassVar[type[EvalMetrics]] = EvalMetrics
    artifact_kind: ClassVar[str] = "eval_report"
    consumes: ClassVar[tuple[str, ...]] = ("model", "tokenizer", "cpt", "sft")

    on_unloadable_model: Literal["fail", "skip"] = Field(
        default="fail", description="An upstream model that cannot be loaded: fail, or skip it and say so."
    )
    models: list[ModelRef] = Field(
        default_factory=list,
        description="Models besides the upstream ones. Every change is against the upstream `model` ('base'), "
        "else the model labelled 'base', else the first listed.",
    )
    tokenizers: list[TokenizerRef] = Field(default_factory=list, description="Tokenizers besides the models' own.")
    text_sets: list[DataSource] = Field(default_factory=list, description="BPB and fertility sets, by `name`.")
    parallel_sets: list[ParallelSet] = Field(default_factory=list, description="Aligned az/en text for parity.")
    morph: MorphResources | None = Field(default=None, description="Gold morphology; None = no alignment metric.")
    prompts: PromptsUri | None = Field(
        default=None, description="JSONL {id, kind: completion|chat, prompt} or 'builtin:az-generation'."
    )
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    assistant: AssistantSettings | None = None
    bpb: BpbSettings = Field(default_factory=BpbSettings, description="Sliding-window settings for bits per byte.")
    tasks: DownstreamTasks | None = None
    target_language: Language = Field(
        default="az", description="Its first text set is the headline gain; every other language is retention."
    )
    set_languages: dict[str, Language] = Field(
        default_factory=dict,
        description="Language per text set name; else from a FLORES text_field (eng_Latn), a -en/_en/.en name "
        "suffix, else target_language.",
    )
    max_docs_per_set: Count = Field(default=None, description="Read at most this many documents per set.")
    max_bytes_per_set: Count = Field(default=200_000, description="Stop reading a set after this many UTF-8 bytes.")
    device: Literal["auto", "cpu", "cuda"] = Field(json_schema_extra=RUN_ONLY, default="auto")
    precision: Precision = Field(default="auto", description="auto = bf16 on CUDA with bf16 support, else fp32.")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        labels = [m.label for m in self.models]
        if reserved := sorted(set(labels) & {"tokenizer", "cpt", "sft"}):
            raise ValueError(f"models: label {reserved[0]!r} is reserved for the upstream artifact")
        _unique(labels, "models: duplicate labels")
        _unique([t.label for t in self.tokenizers], "tokenizers: duplicate labels")
        names = [s.label for s in self.text_sets]
        _unique(names, "text_sets: duplicate names", "; set `name` on each")
        if unknown := sorted(set(self.set_languages) - set(names)):
            raise ValueError(f"set_languages: {unknown[0]!r} is not a text set name (names: {names})")
        return self

    def model_uris(self) -> list[str]:
        uris = [u for m in self.models for u in (m.uri, m.tokenizer_uri, m.adapter_uri) if u]
        return uris + [t.uri for t in self.tokenizers]

    def data_sources(self) -> list[DataSource]:
        sources = list(self.text_sets)
        for p in self.parallel_sets:
            sources += [getattr(p, side).model_copy(update={"name": f"{p.name}.{side}"}) for side in ("az", "en")]
        if self.morph:
            for kind in ("segmented", "lemma_forms", "conllu"):
                sources += [
                    DataSource(uri=u, name=f"morph.{kind}.{i}") for i, u in enumerate(getattr(self.morph, kind))
                ]
        if self.prompts and not self.prompts.startswith("builtin:"):  # built-ins: in the eval stage's code version
            sources.append(DataSource(uri=self.prompts, name="prompts"))
        if self.assistant and not self.assistant.prompts.startswith("builtin:"):
            sources.append(DataSource(uri=self.assistant.prompts, name="assistant.prompts"))
        return sources + (self.tasks.data_sources() if self.tasks else [])
