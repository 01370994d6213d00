"""The report's tables of model comparisons: headline BPB, downstream tasks, BPB per set, step-0 BPB and leakage
per initialisation, cost. A table is data, a header and rows of `Cell`s (text + CSS class); every change is
per text set or task against the reference (base) model, never averaged across languages."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .compare import language_name
from .metrics import BpbChange, EvalMetrics, TaskScore


@dataclass(frozen=True)
class Cell:
    """A table cell with a CSS class (better/worse colouring, numbers aligned right)."""

    text: str
    cls: str = ""

    def __str__(self) -> str:
        return self.text


Table = tuple[list[str], list[list[str | Cell]]]


def fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def change_cell(change: float | None) -> Cell:
    """A relative BPB change: negative is better (fewer bits per byte)."""
    if change is None:
        return Cell("–")
    return Cell(f"{100 * change:+.1f}%", "num better" if change < 0 else "num worse" if change > 0 else "num")


def transition(entry: BpbChange | None) -> Cell:
    """'3.250 → 2.330 (−28.3%)' for one model on one set against the reference."""
    if entry is None:
        return Cell("–")
    ch = change_cell(entry.change)
    return Cell(f"{fmt(entry.reference_bpb, 3)} → {fmt(entry.bpb, 3)} ({ch.text})", ch.cls)


def headline_table(metrics: EvalMetrics) -> Table:
    """One row per model: the target-language gain and each other language's retention, each on one named set."""
    h = metrics.headline
    if not h.gain and not h.retention:
        return [], []
    target, ref = h.target_language, h.reference
    gain_set = next((g.set for g in h.gain.values()), None)
    others: dict[str, str] = {}
    for langs in h.retention.values():
        for lang, e in langs.items():
            others.setdefault(lang, e.set)
    head = ["model"]
    if gain_set:
        head.append(f"{language_name(target)} gain: BPB vs {ref} on {gain_set}")
    head += [f"{language_name(lang)} retention: BPB vs {ref} on {name}" for lang, name in others.items()]
    models = list(dict.fromkeys([*h.gain, *h.retention]))
    rows = []
    for m in models:
        row: list[str | Cell] = [m]
        if gain_set:
            row.append(transition(h.gain.get(m)))
        row += [transition(h.retention.get(m, {}).get(lang)) for lang in others]
        rows.append(row)
    return head, rows


METRIC_NAMES = {
    "acc": "accuracy",
    "acc_norm": "accuracy (length-normalised)",
    "chrf++": "chrF++",
    "chrf": "chrF",
    "bleu": "BLEU",
    "answer_in_language": "answers in the language",
    "repetition_rate": "repeated 3-gram rate",
    "empty_answer": "empty answers",
    "ended_turn": "answers ending at the end of the turn",
}


def _score(v: TaskScore | None, metric: str) -> str:
    """'0.250 [0.10, 0.40]' (value and 95 % interval); chrF/BLEU with one decimal."""
    if v is None:
        return "–"
    digits = 1 if metric in ("chrf++", "chrf", "bleu") else 3
    ci = v.ci95
    return fmt(v.value, digits) + (f" [{fmt(ci[0], digits)}, {fmt(ci[1], digits)}]" if ci else "")


def _delta_cell(v: TaskScore | None, delta: float | None, metric: str) -> Cell:
    """A score with its change against the reference model, coloured by whether higher is better."""
    from .harness import HIGHER_IS_BETTER

    text = _score(v, metric)
    if v is None or delta is None:
        return Cell(text, "num")
    digits = 1 if metric in ("chrf++", "chrf", "bleu") else 3
    better = delta > 0 if HIGHER_IS_BETTER.get(metric, True) else delta < 0
    cls = "num" if delta == 0 else "num better" if better else "num worse"
    return Cell(f"{text} ({delta:+.{digits}f})", cls)


def _task_rows(metrics: EvalMetrics) -> tuple[list[str], list[str], list[tuple[str, str, dict]]]:
    """(models, languages, [(row label, headline metric, {language: task key})]) of the downstream section."""
    d = metrics.downstream
    if d is None:
        return [], [], []
    languages = list(dict.fromkeys(t.language for t in d.tasks.values()))
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for key, t in d.tasks.items():
        for m in t.headline_metrics:
            rows.setdefault((t.row, m), {})[t.language] = key
    return list(d.results), languages, [(row, m, by_lang) for (row, m), by_lang in rows.items()]


def downstream_table(metrics: EvalMetrics) -> Table:
    """Headline task rows: each model's figure per language side by side (95 % interval; change vs the
    reference model in brackets, coloured better/worse), with the task's chance level. Nothing averaged."""
    models, languages, rows_ = _task_rows(metrics)
    if not models or metrics.downstream is None:
        return [], []
    results, changes, tasks = metrics.downstream.results, metrics.downstream.changes, metrics.downstream.tasks
    head = ["task", "metric", "n", "chance"] + [f"{m} {lang}" for m in models for lang in languages]
    rows = []
    for row, metric, by_lang in rows_:
        chance = [
            f"{lang} {fmt(tasks[k].chance[metric], 3 if metric not in ('chrf++', 'bleu') else 1)}"
            for lang, k in by_lang.items()
            if metric in tasks[k].chance
        ]
        n = "/".join(str(tasks[k].num_examples) for k in by_lang.values())
        cells: list[str | Cell] = [
            row,
            METRIC_NAMES.get(metric, metric),
            Cell(n, "num"),
            Cell(", ".join(chance) or "–", "num"),
        ]
        for model in models:
            for lang in languages:
                key = by_lang.get(lang)
                v = results[model].get(key, {}).get(metric) if key else None
                cells.append(
                    _delta_cell(v, changes.get(model, {}).get(key, {}).get(metric), metric) if key else Cell("–")
                )
        rows.append(cells)
    return head, rows


def tasks_detail_table(metrics: EvalMetrics) -> Table:
    """Every task, model and metric: value, standard error, 95 % interval, chance, examples, shots."""
    d = metrics.downstream
    head = ["task", "language", "model", "metric", "value", "stderr", "95 % interval", "chance", "n", "shots"]
    if d is None:
        return head, []
    rows = []
    for key, t in d.tasks.items():
        for model, res in d.results.items():
            for metric in dict.fromkeys([*t.metrics, *t.headline_metrics]):
                v = res.get(key, {}).get(metric)
                if v is None:
                    continue
                ci = v.ci95
                rows.append(
                    [
                        key,
                        t.language,
                        model,
                        METRIC_NAMES.get(metric, metric),
                        Cell(fmt(v.value, 4), "num"),
                        Cell(fmt(v.stderr, 4), "num"),
                        Cell(f"{fmt(ci[0], 4)} – {fmt(ci[1], 4)}" if ci else "–", "num"),
                        Cell(fmt(t.chance.get(metric), 4), "num"),
                        Cell(str(t.num_examples), "num"),
                        Cell(str(t.num_fewshot), "num"),
                    ]
                )
    return head, rows


def bpb_table(metrics: EvalMetrics) -> Table:
    """Every model on every set, with the set's language and the change against the reference on that set."""
    ref = metrics.headline.reference
    langs = {k: v.language for k, v in metrics.text_sets.items()}
    head = ["model", "text set", "language", "BPB", *([f"{ref} BPB", f"change vs {ref}"] if ref else [])]
    rows = []
    for m, sets in metrics.bpb.items():
        for s, res in sets.items():
            row: list[str | Cell] = [m, s, langs.get(s) or "–", Cell(fmt(res.bpb, 4), "num")]
            if ref:
                e = metrics.bpb_change.get(m, {}).get(s)
                row += [
                    Cell(fmt(e.reference_bpb if e else None, 4), "num"),
                    change_cell(e.change) if e else Cell("–"),
                ]
            rows.append(row)
    return head, rows


def step0_table(metrics: EvalMetrics) -> Table:
    t = metrics.transplant
    if t is None or not t.step0_bpb:
        return [], []
    head = ["initialisation", *[f"step-0 BPB ({s})" for s in t.sets]]
    rows = [
        [
            f"{method} (trained)" if method == t.method else method,
            *[Cell(fmt(vals.get(s), 4), "num") for s in t.sets],
        ]
        for method, vals in t.step0_bpb.items()
    ]
    return head, rows


def leakage_table(metrics: EvalMetrics) -> Table:
    """Step-0 leakage per initialisation and set: the base model's BPB, the extended tokenizer's and the base
    tokenisation's under the full softmax (what the new rows take from text the base model handled)."""
    t = metrics.transplant
    if t is None or not t.leakage:
        return [], []
    head = [
        "initialisation",
        "set",
        "base model BPB",
        "extended tokenizer BPB",
        "× base",
        "base tokenisation BPB",
        "× base",
    ]
    rows = []
    for method, sets in t.leakage.items():
        name = f"{method} (trained)" if method == t.method else method
        for s, r in sets.items():
            rows.append(
                [
                    name,
                    s,
                    Cell(fmt(r.bpb_base_model, 4), "num"),
                    Cell(fmt(r.bpb_extended, 4), "num"),
                    Cell(fmt(r.extended_vs_base, 4), "num"),
                    Cell(fmt(r.bpb_base_tokenization, 4), "num"),
                    Cell(fmt(r.base_tokenization_vs_base, 4), "num"),
                ]
            )
    return head, rows


def cost_table(metrics: EvalMetrics) -> Table:
    head = ["stage", "figure", "value"]
    rows = [[stage, k, Cell(fmt(v), "num")] for stage, d in metrics.cost.items() for k, v in d.items()]
    return head, rows


def _share_cell(s, floor: float | None = None) -> Cell:
    """A share with its 95 % Wilson interval; red when under the gate's floor."""
    if s.value is None:
        return Cell("–", "num")
    cls = "num worse" if floor is not None and s.value < floor else "num"
    return Cell(f"{s.value:.2f} [{s.low:.2f}–{s.high:.2f}]", cls)


def assistant_table(metrics: EvalMetrics) -> Table:
    """Per model and prompt group: answers in the prompt's language, ending the turn, looping, parroting (each
    share with its 95 % Wilson interval) and chrF++ against the references (bootstrap 95 % interval); the
    target language's in-language and ending shares in red under the gate's thresholds."""
    a = metrics.assistant
    head = ["model", "prompts", "n", "in language", "ended the turn", "looping", "parroting", "chrF++ (n)"]
    if a is None:
        return head, []
    gate = a.thresholds
    rows = []
    for model, groups in a.figures.items():
        for group, f in groups.items():
            gated = f.language == gate.language
            chrf = f"{f.chrf.score:.1f} [{fmt(f.chrf.low, 1)}–{fmt(f.chrf.high, 1)}] ({f.chrf.n})" if f.chrf else "–"
            rows.append(
                [
                    model,
                    group,
                    Cell(str(f.n), "num"),
                    _share_cell(f.in_language, gate.min_in_language if gated else None),
                    _share_cell(f.ended_turn, gate.min_ended_turn if gated else None),
                    _share_cell(f.looping),
                    _share_cell(f.parroting),
                    Cell(chrf, "num"),
                ]
            )
    return head, rows
