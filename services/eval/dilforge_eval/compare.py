"""Each model's BPB against the base model's, per text set (an average across languages would hide the loss
elsewhere), the headline per language, and what the report shows of the upstream manifests' metrics: curves,
cost, step-0 BPB and tokenizer strategies. Those are read through eval's own models of just the fields it shows
(other fields are the producer's, ignored), so an artifact of another version fails here naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from dilforge_shared.configs import DataSource
from dilforge_shared.fertility import SetFigures
from pydantic import BaseModel, ConfigDict, Field

from .metrics import (
    BpbChange,
    BpbFigures,
    Headline,
    HeadlineEntry,
    Step0Section,
    TokenizerComparison,
    VocabSweep,
)

# ISO 639-3 codes that FLORES-style column names use, mapped to the 2-letter codes the report uses.
ISO3 = {"eng": "en", "azj": "az", "aze": "az", "azb": "az", "rus": "ru", "tur": "tr", "deu": "de", "fra": "fr"}
LANGUAGE_NAMES = dict(az="Azerbaijani", en="English", ru="Russian", tr="Turkish", de="German", fr="French")
_FLORES_FIELD = re.compile(r"^([a-z]{3})_[A-Z][a-z]{3}$")
_SUFFIX = re.compile(r"[-_.]([a-z]{2,3})$")


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


def infer_language(source: DataSource, explicit: dict[str, str], default: str) -> str:
    """The language of a text set: explicit config, a FLORES-style text_field, a -xx suffix, else `default`."""
    if source.label in explicit:
        return explicit[source.label]
    if m := _FLORES_FIELD.match(source.text_field):
        return ISO3.get(m.group(1), m.group(1))
    file_stem = source.uri.rstrip("/").rsplit("/", 1)[-1].split(".txt")[0].split(".jsonl")[0].split(".tsv")[0]
    for name in (source.label, file_stem):
        if m := _SUFFIX.search(name.lower()):
            code = ISO3.get(m.group(1), m.group(1))
            if code in LANGUAGE_NAMES:
                return code
    return default


def reference_label(model_labels: Iterable[str], base_label: str = "base") -> str | None:
    """The model every change is measured against: the one labelled `base`, else the first model listed."""
    labels = list(model_labels)
    if base_label in labels:
        return base_label
    return labels[0] if labels else None


def bpb_changes(
    bpb: dict[str, dict[str, BpbFigures]], reference: str | None, languages: dict[str, str]
) -> dict[str, dict[str, BpbChange]]:
    """model -> set -> its BPB against the reference model's; change = bpb / reference's bpb - 1, per set."""
    if reference is None:  # no model
        return {}
    ref = bpb[reference]
    out: dict[str, dict[str, BpbChange]] = {}
    for model, sets in bpb.items():
        if model == reference:
            continue
        for name, res in sets.items():
            base = ref[name].bpb if name in ref else None
            change = round(res.bpb / base - 1, 5) if base else None
            out.setdefault(model, {})[name] = BpbChange(
                language=languages.get(name), bpb=res.bpb, reference_bpb=base, change=change
            )
    return out


def headline(
    changes: dict[str, dict[str, BpbChange]], reference: str | None, languages: dict[str, str], target: str
) -> Headline:
    """Per model: the gain on the first target-language set and the retention on the first set of every other
    language. Negative change = lower BPB = better; a retention change > 0 means that language got worse."""
    first: dict[str, str] = {}
    for name, lang in languages.items():
        first.setdefault(lang, name)
    out = Headline(reference=reference, target_language=target, gain={}, retention={})
    for model, sets in changes.items():
        if target in first and first[target] in sets:
            out.gain[model] = HeadlineEntry(set=first[target], **sets[first[target]].model_dump())
        for lang, name in first.items():
            if lang != target and name in sets:
                out.retention.setdefault(model, {})[lang] = HeadlineEntry(set=name, **sets[name].model_dump())
    return out


class Read(BaseModel):
    """What eval reads of an upstream stage's metrics; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")


class LossRow(Read):
    step: int
    loss: float


class ValidationRow(LossRow):
    loss: float = Field(alias="val_loss")


class TransplantRead(Read):
    method: str
    step0_val_bpb_by_set: dict[str, dict[str, float]] = Field(default_factory=dict)
    step0_leakage: dict[str, dict[str, dict[str, float | None]]] = Field(default_factory=dict)


class CptRead(Read):
    history: list[LossRow]
    validation: list[ValidationRow]
    transplant: TransplantRead | None
    tokens_seen: int
    total_tokens: int
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_gb: float | None
    eval_peak_memory_gb: float | None


class SftRead(Read):
    train_loss_history: list[LossRow]
    train_runtime_s: float
    train_steps_per_second: float | None = None
    optimizer_steps: int


class SweepRow(Read):
    vocab_size: int
    sets: dict[str, SetFigures]


class StrategyRow(Read):
    languages: dict[str, dict[str, float]]


class BaseRead(Read):
    sets: dict[str, SetFigures]


class TokenizerRead(Read):
    selected_vocab_size: int | None
    sweep: list[SweepRow]
    base: BaseRead | None = None
    comparison: list[StrategyRow]
    dead_tokens: dict[str, Any]


READERS: dict[str, type[Read]] = {"cpt": CptRead, "sft": SftRead, "tokenizer": TokenizerRead}
COST = {  # the figures of each stage's metrics the report lists as its cost
    "cpt": ("tokens_seen", "total_tokens", "tokens_per_s", "mfu", "peak_memory_gb", "eval_peak_memory_gb"),
    "sft": ("train_runtime_s", "train_steps_per_second", "optimizer_steps"),
}


def upstream(stage: str, metrics: dict[str, Any], out: dict[str, Any]) -> None:
    """Into `out`: the curves and cost of a cpt or sft manifest's metrics, the step-0 BPB of cpt's, the vocab
    sweep and strategies of the tokenizer's. pydantic's ValidationError where a field read here is missing or of
    another shape (`stage.upstream_sections` names it)."""
    read = READERS[stage].model_validate(metrics)
    if isinstance(read, CptRead):
        curves = {"loss": read.history, "validation/val_loss": read.validation}
    elif isinstance(read, SftRead):
        curves = {"loss": read.train_loss_history}
    if isinstance(read, CptRead | SftRead):
        if curves := {name: sorted([float(r.step), r.loss] for r in rows) for name, rows in curves.items() if rows}:
            out["curves"][stage] = curves
        if cost := {name: value for name in COST[stage] if (value := getattr(read, name)) is not None}:
            out["cost"][stage] = cost
    if isinstance(read, CptRead):
        out["transplant"] = step0_bpb(read.transplant)
    if isinstance(read, TokenizerRead):
        # the rows as published (checked above), which the report shows as they are
        base = metrics.get("base")
        out["vocab_sweep"] = VocabSweep(selected=read.selected_vocab_size, rows=metrics["sweep"], base=base)
        out["tokenizer_comparison"] = tokenizer_comparison(read, metrics["comparison"])


def step0_bpb(t: TransplantRead | None) -> Step0Section | None:
    """Step-0 BPB per initialisation and validation set, from the CPT metrics' `transplant` block."""
    if t is None or not t.step0_val_bpb_by_set:
        return None
    methods = t.step0_val_bpb_by_set
    return Step0Section(
        method=t.method,
        sets=sorted({s for v in methods.values() for s in v}),
        step0_bpb=methods,
        leakage=t.step0_leakage or None,  # {method: {set: row}} (cpt leakage.step0_row)
    )


def tokenizer_comparison(tok: TokenizerRead, rows: list[dict[str, Any]]) -> TokenizerComparison | None:
    """The tokenizer strategies side by side (`rows`: the published `comparison`, `dead_tokens`), or None when it
    has neither."""
    if not tok.comparison and not tok.dead_tokens:
        return None
    languages = sorted({lang for r in tok.comparison for lang in r.languages})
    return TokenizerComparison(rows=rows, languages=languages, dead_tokens=tok.dead_tokens or None)
