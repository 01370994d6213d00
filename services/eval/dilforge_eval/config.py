"""Eval stage config: which models, tokenizers, text sets and resources the report compares."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from dilforge_shared.configs.base import (
    MAX_BATCH,
    MAX_NEW_TOKENS,
    MAX_TOKENS,
    RUN_ONLY,
    DataSource,
    Precision,
    StageConfig,
    StrictModel,
)
from pydantic import AfterValidator, Field, model_validator

from .metrics import EvalMetrics

_LABEL = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,39}$"
UPSTREAM_LABELS = ("tokenizer", "cpt", "sft")
BASE_LABEL = "base"  # the label of the upstream `model` input (the pipeline's base model)
_LANG = r"^[a-z]{2,3}$"


def _builtin_name(value: str) -> str:
    """`builtin:NAME` names a file shipped with the eval service, never a path (`builtin:../../x` read any file)."""
    if value.startswith("builtin:") and not re.fullmatch(r"builtin:[a-z0-9][a-z0-9_-]{0,63}", value):
        raise ValueError(f"{value!r}: a built-in prompt set is `builtin:` and a name (letters, digits, - and _)")
    return value


PromptsUri = Annotated[str, AfterValidator(_builtin_name)]


def _unique(values: list[str], what: str, hint: str = "") -> None:
    if dupes := sorted({x for x in values if values.count(x) > 1}):
        raise ValueError(f"{what} {dupes}{hint}")


class ModelRef(StrictModel):
    """A causal LM to evaluate besides the upstream CPT/SFT models (e.g. the stock base model)."""

    label: str = Field(pattern=_LABEL, description="Name shown in the report, e.g. 'base'.")
    uri: str = Field(
        description="HF model folder (local path or s3:// prefix) or a dilforge artifact "
        "(folder or manifest.json URI) holding one."
    )
    tokenizer_uri: str | None = Field(default=None, description="Tokenizer folder if it is not next to the model.")
    adapter_uri: str | None = Field(
        default=None, description="Optional PEFT adapter folder applied on top of the model."
    )


class TokenizerRef(StrictModel):
    """A tokenizer to compare (fertility, morpheme alignment) without a model."""

    label: str = Field(pattern=_LABEL, description="Name shown in the report, e.g. 'llama3'.")
    uri: str = Field(
        description="HF tokenizer folder (local or s3:// prefix), a tokenizer.json file, or a dilforge artifact."
    )


class ParallelSet(StrictModel):
    """Aligned Azerbaijani/English text for tokenizer parity (tokens az / tokens en)."""

    name: str = Field(pattern=_LABEL, description="Name shown in the report.")
    az: DataSource = Field(description="Azerbaijani side; document i aligns with document i of `en`.")
    en: DataSource = Field(description="English side.")


class MorphResources(StrictModel):
    """Gold morphology for the morpheme-alignment metric (see docs/eval.md for the method)."""

    segmented: list[str] = Field(
        default_factory=list, description="TSV files word<TAB>segmentation ('kitab+lar'), header row optional."
    )
    lemma_forms: list[str] = Field(
        default_factory=list,
        description="TSV files of lemma/form pairs (UniMorph "
        "lemma<TAB>form<TAB>feats, or a header naming 'lemma' and 'form' columns).",
    )
    conllu: list[str] = Field(
        default_factory=list,
        description="CoNLL-U files; lemmas give stem boundaries and a "
        "'# glossing =' comment (Leipzig hyphens) refines them.",
    )
    num_words_per_source: int = Field(
        le=1_000_000, default=2000, ge=1, description="Words sampled (seeded) from each source."
    )


class GenerationSettings(StrictModel):
    modes: list[Literal["greedy", "sampled"]] = Field(default=["greedy", "sampled"], description="Decoding modes.")
    max_new_tokens: int = Field(le=MAX_NEW_TOKENS, default=64, ge=1, description="New tokens per answer.")
    temperature: float = Field(default=0.7, gt=0, description="Sampling temperature (sampled mode).")
    top_p: float = Field(default=0.9, gt=0, le=1, description="Nucleus sampling mass (sampled mode).")
    repetition_penalty: float = Field(
        default=1.0,
        gt=0,
        description="Divides the logits of tokens already in the "
        "prompt or answer (transformers' CTRL penalty); 1.0 = none, so the report "
        "shows raw behaviour; 1.1-1.3 keeps small models from looping.",
    )
    no_repeat_ngram_size: int = Field(
        le=64,
        default=0,
        ge=0,
        description="Never repeat an n-gram of this many tokens within one prompt+answer; 0 = off.",
    )
    num_prompts: int | None = Field(default=None, ge=1, description="Use at most this many prompts (demos).")


class AssistantSettings(StrictModel):
    """Held-out user turns answered through each model's published generation defaults and scored as an
    assistant (docs/eval.md "Assistant measures"); the thresholds are the gate `serve`, `deploy` and `export`
    apply to the SFT model's answers in the target language."""

    prompts: PromptsUri = Field(
        default="builtin:assistant",
        description="JSONL {id, language, prompt, reference?}, or 'builtin:assistant' for the held-out "
        "Azerbaijani and English prompts shipped with the eval service.",
    )
    per_language: int | None = Field(
        default=40, ge=1, description="Prompts per language (the first ones of each); None = all."
    )
    no_diacritics: bool = Field(
        default=True,
        description="Also score the target language's prompts typed without its letters (ə→e, ı→i, ş→s, ç→c, "
        "ğ→g, ö→o, ü→u), as their own group.",
    )
    max_new_tokens: int = Field(
        le=MAX_NEW_TOKENS,
        default=64,
        ge=1,
        description="New tokens per answer: an answer that reaches it has not ended its turn.",
    )
    batch_size: int = Field(
        le=MAX_BATCH,
        json_schema_extra=RUN_ONLY,
        default=40,
        ge=1,
        description="Prompts per generate call (left-padded; larger batches cost less time per prompt, docs/eval.md).",
    )
    min_in_language: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="Gate: the least share of the SFT model's answers to target-language prompts that are in "
        "that language; below it serve/deploy/export refuse the model unless --force.",
    )
    min_ended_turn: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="Gate: the least share of those answers that end the turn (stop token, not the length limit).",
    )


class BpbSettings(StrictModel):
    window: int | None = Field(
        le=MAX_TOKENS,
        default=None,
        ge=8,
        description="Tokens per forward window; None = the model's max_position_embeddings capped at 2048.",
    )
    stride: int | None = Field(
        le=MAX_TOKENS,
        default=None,
        ge=1,
        description="Window step in tokens; every token after the first "
        "window sees at least window-stride tokens of context. None = window/2.",
    )
    batch_size: int = Field(
        le=MAX_BATCH, json_schema_extra=RUN_ONLY, default=8, ge=1, description="Windows per forward pass."
    )

    @model_validator(mode="after")
    def _check(self) -> BpbSettings:
        if self.window is not None and self.stride is not None and self.stride > self.window:
            raise ValueError(f"bpb.stride ({self.stride}) must not exceed bpb.window ({self.window})")
        return self


SIB_LABELS = ("science/technology", "travel", "politics", "sports", "health", "entertainment", "geography")


class SibTask(StrictModel):
    """SIB-200 topic classification (docs/eval.md): log-likelihood of each topic label after the sentence,
    k-shot from the SIB train split, scored on the SIB test split."""

    uri: str = Field(
        description="TSV/CSV/JSONL with a split column, a topic column and one text column per "
        "language (the FLORES-200 dev file with SIB-200 labels)."
    )
    languages: dict[str, str] = Field(
        default_factory=lambda: {"az": "azj_Latn", "en": "eng_Latn"},
        description="Language code -> text column; one task per language.",
    )
    label_field: str = Field(
        default="sib_category", description="Column with the topic label (one of the 7 SIB-200 topics)."
    )
    split_field: str = Field(
        default="sib_split",
        description="Column with the SIB split (train/dev/test): examples come from `test`, shots from `train`.",
    )
    num_fewshot: list[Annotated[int, Field(ge=0, le=64)]] = Field(
        default=[0, 5], min_length=1, description="Shots per run; one figure each."
    )
    max_examples: int | None = Field(
        default=None,
        ge=1,
        description="Score at most this many test sentences (the first ones; the CPU demo's budget), None = all.",
    )

    @model_validator(mode="after")
    def _check(self) -> SibTask:
        for lang in self.languages:
            if not re.fullmatch(_LANG, lang):
                raise ValueError(f"languages: {lang!r} is not a 2-3 letter language code")
        return self


class TranslationSet(StrictModel):
    """Aligned Azerbaijani/English sentences scored as translation (chrF++ and BLEU, sacrebleu)."""

    name: str = Field(pattern=_LABEL, description="Name shown in the report, e.g. 'flores-dev'.")
    az: DataSource = Field(description="Azerbaijani side; line i aligns with line i of `en`.")
    en: DataSource = Field(description="English side.")
    directions: list[Literal["az-en", "en-az"]] = Field(
        default=["az-en", "en-az"], min_length=1, description="Directions scored, one task each."
    )
    max_examples: int | None = Field(default=None, ge=1, description="Translate at most this many (first) pairs.")


class InstructionTask(StrictModel):
    """Instruction answering with the model's chat template (chrF++ against the reference, share of answers in
    the task language, repetition)."""

    name: str = Field(default="khazar", pattern=_LABEL, description="Name shown in the report.")
    uri: str = Field(description="JSONL (or TSV/CSV) with an instruction and a reference response per row.")
    instruction_field: str = Field(default="instruction", description="Field with the user's turn.")
    response_field: str = Field(default="response", description="Field with the reference answer.")
    language: Literal["az", "en"] = Field(default="az", description="Language the answers should be in.")
    system_prompt: str | None = Field(default=None, description="System turn before every instruction.")
    max_examples: int | None = Field(default=None, ge=1, description="Answer at most this many (first) rows.")


class MultipleChoiceTask(StrictModel):
    """A multiple-choice file in the Belebele or TUMLU layout (docs/eval.md), scored as lm-eval scores them."""

    name: str = Field(pattern=_LABEL, description="Name shown in the report, e.g. 'belebele-az'.")
    uri: str = Field(description="JSONL/TSV/CSV test file.")
    layout: Literal["belebele", "tumlu"] = Field(
        description="belebele: flores_passage, question, mc_answer1-4, "
        "correct_answer_num (1-4); tumlu: question, choices (list of 2-5), "
        "answer (letter A-E)."
    )
    language: str = Field(pattern=_LANG, description="Language of the questions (the report's column).")
    fewshot_uri: str | None = Field(
        default=None,
        description="File (same layout) the shots come from; None = the first rows of `uri` other than the one scored.",
    )
    num_fewshot: int = Field(le=64, default=0, ge=0, description="Shots (TUMLU-mini publishes 5-shot).")
    max_examples: int | None = Field(default=None, ge=1, description="Score at most this many (first) rows.")


class DownstreamTasks(StrictModel):
    """Downstream tasks run through lm-evaluation-harness with the task configs shipped in
    dilforge_eval/tasks (docs/eval.md has the `lm_eval` command that reproduces every figure)."""

    sib200: SibTask | None = Field(default=None, description="SIB-200 topic classification.")
    translation: list[TranslationSet] = Field(default_factory=list, description="Translation sets (FLORES, X-WMT).")
    instructions: InstructionTask | None = Field(default=None, description="Instruction answering (khazar).")
    multiple_choice: list[MultipleChoiceTask] = Field(default_factory=list, description="Belebele/TUMLU files.")
    translation_max_new_tokens: int = Field(
        le=MAX_NEW_TOKENS, default=64, ge=1, description="Tokens per translation (stops at the first newline)."
    )
    instruction_max_new_tokens: int = Field(
        le=MAX_NEW_TOKENS, default=128, ge=1, description="Tokens per answer (stops at the end of the turn)."
    )
    batch_size: int = Field(
        le=MAX_BATCH,
        json_schema_extra=RUN_ONLY,
        default=8,
        ge=1,
        description="Requests per forward pass (lm-eval batch_size).",
    )
    max_length: int = Field(
        le=MAX_TOKENS,
        default=2048,
        ge=64,
        description="Longest prompt+answer in tokens (lm-eval max_length; longer prompts are cut from the left).",
    )
    bootstrap_iters: int = Field(
        le=100_000,
        default=1000,
        ge=0,
        description="Bootstrap resamples for the standard error of "
        "corpus metrics (chrF++, BLEU); 0 = no standard errors.",
    )

    @model_validator(mode="after")
    def _check(self) -> DownstreamTasks:
        names = [t.name for t in self.translation] + [t.name for t in self.multiple_choice]
        if self.instructions:
            names.append(self.instructions.name)
        _unique(names, "tasks: duplicate names")
        # lm-eval task names write '-' and '.' as '_': `bele-a` and `bele_a` would be one task, scored once
        by_task: dict[str, list[str]] = {}
        for name in names:
            by_task.setdefault(name.replace("-", "_").replace(".", "_").lower(), []).append(name)
        clashes = [sorted(group) for group in by_task.values() if len(group) > 1]
        if clashes:
            raise ValueError(f"tasks: names {clashes[0]} become the same lm-eval task; rename one")
        return self

    @property
    def system_prompt(self) -> str | None:
        """The system turn of the chat tasks (the instruction task's), for the stage and its `lm_eval` command."""
        return self.instructions.system_prompt if self.instructions else None

    def data_sources(self) -> list[DataSource]:
        out: list[DataSource] = []
        if self.sib200:
            out.append(DataSource(uri=self.sib200.uri, name="tasks.sib200"))
        for t in self.translation:
            out += [
                t.az.model_copy(update={"name": f"tasks.{t.name}.az"}),
                t.en.model_copy(update={"name": f"tasks.{t.name}.en"}),
            ]
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
        default="fail",
        description="An upstream model that cannot be loaded (e.g. an adapter without its base): "
        "fail the stage, or skip it and say so in the report.",
    )
    models: list[ModelRef] = Field(
        default_factory=list,
        description="Models besides the upstream model/cpt/sft "
        "ones, each with a label. Every BPB change is against the upstream `model` "
        "artifact (labelled 'base'), else the model labelled 'base', else the first listed.",
    )
    tokenizers: list[TokenizerRef] = Field(
        default_factory=list, description="Tokenizers besides the upstream one and the models' own."
    )
    text_sets: list[DataSource] = Field(
        default_factory=list,
        description="Text sets (one per domain) for BPB and tokenizer metrics; `name` is the domain label.",
    )
    parallel_sets: list[ParallelSet] = Field(default_factory=list, description="Aligned az/en text for parity.")
    morph: MorphResources | None = Field(default=None, description="Gold morphology; None = no alignment metric.")
    prompts: PromptsUri | None = Field(
        default=None,
        description="JSONL prompts file: {id, kind: completion|chat, prompt}, or "
        "'builtin:az-generation' for the Azerbaijani prompts shipped with the eval service.",
    )
    generation: GenerationSettings = Field(default_factory=GenerationSettings, description="Decoding settings.")

    assistant: AssistantSettings | None = Field(
        default=None,
        description="Assistant measures on held-out prompts per language (and the gate's thresholds); None = none.",
    )

    bpb: BpbSettings = Field(default_factory=BpbSettings, description="Sliding-window settings for bits per byte.")
    tasks: DownstreamTasks | None = Field(
        default=None,
        description="Downstream tasks through lm-evaluation-harness "
        "(SIB-200, translation, instructions, multiple choice); None = none.",
    )
    target_language: str = Field(
        default="az",
        pattern=_LANG,
        description="Language the pipeline adapts to: its "
        "text sets give the report's headline gain; every other language is a retention "
        "row (BPB change against the base model, per set).",
    )
    set_languages: dict[str, str] = Field(
        default_factory=dict,
        description="Language code per text set name, e.g. "
        "{flores-dev-en: en}; a set not listed takes it from a FLORES-style "
        "text_field (eng_Latn -> en) or a trailing -en/_en/.en in its name or file "
        "name, else target_language.",
    )
    max_docs_per_set: int | None = Field(default=None, ge=1, description="Read at most this many documents per set.")
    max_bytes_per_set: int | None = Field(
        default=200_000,
        ge=1,
        description="Stop reading a set after this many UTF-8 bytes (keeps CPU demos fast); None = the whole set.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        json_schema_extra=RUN_ONLY, default="auto", description="auto = cuda when available."
    )
    precision: Precision = Field(default="auto", description="auto = bf16 on CUDA with bf16 support, else fp32.")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        labels = [m.label for m in self.models]
        for label in labels:
            if label in UPSTREAM_LABELS:
                raise ValueError(f"models: label {label!r} is reserved for the upstream artifact")
        _unique(labels, "models: duplicate labels")
        _unique([t.label for t in self.tokenizers], "tokenizers: duplicate labels")
        names = [s.label for s in self.text_sets]
        _unique(names, "text_sets: duplicate names", "; set `name` on each")
        for name, lang in self.set_languages.items():
            if name not in names:
                raise ValueError(f"set_languages: {name!r} is not a text set name (names: {names})")
            if not re.fullmatch(_LANG, lang):
                raise ValueError(f"set_languages[{name}]: {lang!r} is not a 2-3 letter language code")
        return self

    def model_uris(self) -> list[str]:
        uris = [u for m in self.models for u in (m.uri, m.tokenizer_uri, m.adapter_uri) if u]
        return uris + [t.uri for t in self.tokenizers]

    def data_sources(self) -> list[DataSource]:
        sources = list(self.text_sets)
        for p in self.parallel_sets:
            sources += [
                p.az.model_copy(update={"name": f"{p.name}.az"}),
                p.en.model_copy(update={"name": f"{p.name}.en"}),
            ]
        if self.morph:
            for kind in ("segmented", "lemma_forms", "conllu"):
                for i, uri in enumerate(getattr(self.morph, kind)):
                    sources.append(DataSource(uri=uri, name=f"morph.{kind}.{i}"))
        if self.prompts and not self.prompts.startswith("builtin:"):  # built-ins: in the eval stage's code version
            sources.append(DataSource(uri=self.prompts, name="prompts"))
        if self.assistant and not self.assistant.prompts.startswith("builtin:"):
            sources.append(DataSource(uri=self.assistant.prompts, name="assistant.prompts"))
        if self.tasks:
            sources += self.tasks.data_sources()
        return sources
