"""The report's tables, as data: a header and rows of `Cell`s (text + CSS class), rendered by `report` under the
note `report.NOTES` holds for each. Every change is per text set or task against the reference (base) model,
never averaged across languages."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .compare import language_name
from .downstream import SCALE_100  # chrF/BLEU: 0-100, shown with one decimal
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
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def num(v: Any, digits: int = 3) -> Cell:
    """A number, right-aligned."""
    return Cell(fmt(v, digits), "num")


def pct(v: float | None) -> Cell:
    return Cell("–" if v is None else f"{100 * v:.1f}%", "num")


def _pairs(data: dict[str, dict[str, Any]], cells: Callable[[str, Any], list]) -> list[list[str | Cell]]:
    """One row per (outer, inner) key of a two-level dict: both keys, then `cells(inner key, value)`."""
    return [[a, b, *cells(b, v)] for a, inner in data.items() for b, v in inner.items()]


def _fields(v: Any, names: tuple[str, ...], digits: int = 3) -> list[Cell]:
    return [num(getattr(v, k), digits) for k in names]


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
    return Cell(f"{fmt(entry.reference_bpb)} → {fmt(entry.bpb)} ({ch.text})", ch.cls)


def headline_table(metrics: EvalMetrics) -> Table:
    h = metrics.headline
    entries = [(m, h.target_language, e) for m, e in h.gain.items()]
    entries += [(m, lang, e) for m, langs in h.retention.items() for lang, e in langs.items()]
    sets: dict[str, str] = {}  # language -> its set, the target language's (the gain) first
    by_model: dict[str, dict[str, BpbChange]] = {}
    for m, lang, e in entries:
        sets.setdefault(lang, e.set)
        by_model.setdefault(m, {})[lang] = e
    head = ["model"] + [
        f"{language_name(lang)} {'gain' if lang == h.target_language else 'retention'}: BPB vs {h.reference} on {s}"
        for lang, s in sets.items()
    ]
    return head if by_model else [], [[m, *[transition(d.get(lang)) for lang in sets]] for m, d in by_model.items()]


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
LOWER_IS_BETTER = ("repetition_rate", "empty_answer")


def _delta_cell(v: TaskScore | None, delta: float | None, metric: str) -> Cell:
    """'0.250 [0.10, 0.40] (+0.050)': value, 95 % interval and the change against the reference model, coloured
    by whether higher is better."""
    if v is None:
        return Cell("–", "num")
    digits = 1 if metric in SCALE_100 else 3
    text = fmt(v.value, digits) + (f" [{fmt(v.ci95[0], digits)}, {fmt(v.ci95[1], digits)}]" if v.ci95 else "")
    if delta is None:
        return Cell(text, "num")
    better = delta < 0 if metric in LOWER_IS_BETTER else delta > 0
    return Cell(f"{text} ({delta:+.{digits}f})", "num" if delta == 0 else "num better" if better else "num worse")


def downstream_table(metrics: EvalMetrics) -> Table:
    d = metrics.downstream
    if d is None or not d.results:
        return [], []
    models, languages = list(d.results), list(dict.fromkeys(t.language for t in d.tasks.values()))
    by_row: dict[tuple[str, str], dict[str, str]] = {}  # (row label, headline metric) -> {language: task key}
    for key, t in d.tasks.items():
        for m in t.headline_metrics:
            by_row.setdefault((t.row, m), {})[t.language] = key
    head = ["task", "metric", "n", "chance"] + [f"{m} {lang}" for m in models for lang in languages]
    rows = []
    for (row, metric), by_lang in by_row.items():
        digits = 1 if metric in SCALE_100 else 3
        chance = [
            f"{lang} {fmt(d.tasks[k].chance[metric], digits)}"
            for lang, k in by_lang.items()
            if metric in d.tasks[k].chance
        ]
        n = "/".join(str(d.tasks[k].num_examples) for k in by_lang.values())
        cells: list[str | Cell] = [row, METRIC_NAMES.get(metric, metric), Cell(n, "num")]
        cells.append(Cell(", ".join(chance) or "–", "num"))
        for model in models:
            for lang in languages:
                key = by_lang.get(lang)
                v = d.results[model].get(key, {}).get(metric)
                delta = d.changes.get(model, {}).get(key, {}).get(metric)
                cells.append(_delta_cell(v, delta, metric) if key else Cell("–"))
        rows.append(cells)
    return head, rows


def tasks_detail_table(metrics: EvalMetrics) -> Table:
    d = metrics.downstream
    head = ["task", "language", "model", "metric", "value", "stderr", "95 % interval", "chance", "n", "shots"]
    rows = []
    for key, t in d.tasks.items() if d else ():
        for model, res in d.results.items():
            for metric in dict.fromkeys([*t.metrics, *t.headline_metrics]):
                if (v := res.get(key, {}).get(metric)) is None:
                    continue
                ci = Cell(f"{fmt(v.ci95[0], 4)} – {fmt(v.ci95[1], 4)}" if v.ci95 else "–", "num")
                rows.append(
                    [key, t.language, model, METRIC_NAMES.get(metric, metric), num(v.value, 4), num(v.stderr, 4), ci]
                    + [num(t.chance.get(metric), 4), num(t.num_examples), num(t.num_fewshot)]
                )
    return head, rows


def bpb_table(metrics: EvalMetrics) -> Table:
    ref = metrics.headline.reference
    head = ["model", "text set", "language", "BPB", *([f"{ref} BPB", f"change vs {ref}"] if ref else [])]
    rows = []
    for m, sets in metrics.bpb.items():
        for s, res in sets.items():
            e = metrics.bpb_change.get(m, {}).get(s)
            change = [num(e.reference_bpb, 4), change_cell(e.change)] if e else [num(None), Cell("–")]
            rows.append([m, s, _language(metrics, s), num(res.bpb, 4), *(change if ref else [])])
    return head, rows


def _language(metrics: EvalMetrics, text_set: str) -> str:
    return (s.language if (s := metrics.text_sets.get(text_set)) else None) or "–"


def _method(name: str, trained: str) -> str:
    return f"{name} (trained)" if name == trained else name


def step0_table(metrics: EvalMetrics) -> Table:
    t = metrics.transplant
    if t is None or not t.step0_bpb:
        return [], []
    head = ["initialisation", *[f"step-0 BPB ({s})" for s in t.sets]]
    return head, [[_method(m, t.method), *[num(vals.get(s), 4) for s in t.sets]] for m, vals in t.step0_bpb.items()]


def leakage_table(metrics: EvalMetrics) -> Table:
    t = metrics.transplant
    if t is None or not t.leakage:
        return [], []
    head = ["initialisation", "set", "base model BPB", "extended tokenizer BPB", "× base"]
    head += ["base tokenisation BPB", "× base"]
    figures = ("bpb_base_model", "bpb_extended", "extended_vs_base", "bpb_base_tokenization")
    figures += ("base_tokenization_vs_base",)
    leakage = {_method(m, t.method): sets for m, sets in t.leakage.items()}
    return head, _pairs(leakage, lambda _, r: [num(r.get(k), 4) for k in figures])


def cost_table(metrics: EvalMetrics) -> Table:
    return ["stage", "figure", "value"], _pairs(metrics.cost, lambda _, v: [num(v)])


def _share_cell(s, floor: float | None = None) -> Cell:
    """A share with its 95 % Wilson interval; red when under the gate's floor."""
    if s.value is None:
        return Cell("–", "num")
    return Cell(f"{s.value:.2f} [{s.low:.2f}–{s.high:.2f}]", "num worse" if floor and s.value < floor else "num")


def assistant_table(metrics: EvalMetrics) -> Table:
    a = metrics.assistant
    head = ["model", "prompts", "n", "in language", "ended the turn", "looping", "parroting", "chrF++ (n)"]
    if a is None:
        return head, []
    gate = a.thresholds

    def cells(_, f) -> list[Cell]:
        gated = f.language == gate.language
        chrf = f"{f.chrf.score:.1f} [{fmt(f.chrf.low, 1)}–{fmt(f.chrf.high, 1)}] ({f.chrf.n})" if f.chrf else "–"
        return [
            num(f.n),
            _share_cell(f.in_language, gate.min_in_language if gated else None),
            _share_cell(f.ended_turn, gate.min_ended_turn if gated else None),
            _share_cell(f.looping),
            _share_cell(f.parroting),
            Cell(chrf, "num"),
        ]

    return head, _pairs(a.figures, cells)


def strategy_table(metrics: EvalMetrics) -> Table:
    comp = metrics.tokenizer_comparison
    if comp is None:
        return [], []
    head = ["strategy", "vocab size", "new tokens", "selected"]
    for lang in comp.languages:
        head += [f"{lang} tokens/word", f"{lang} bytes/token", f"{lang} words in 3+ tokens"]
    rows = []
    for r in comp.rows:
        row: list[str | Cell] = [r["strategy"], num(r["vocab_size"]), num(r["num_new_tokens"])]
        row.append("yes" if r["selected"] else "")
        for v in (r["languages"].get(lang) or {} for lang in comp.languages):
            row += [num(v.get("tokens_per_word")), num(v.get("bytes_per_token")), pct(v.get("frac_words_3plus"))]
        rows.append([*row, pct(r.get("dead_new_tokens_frac"))])
    return [*head, "dead new tokens"], rows


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        out += _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def dead_tokens_table(metrics: EvalMetrics) -> Table:
    dead = (metrics.tokenizer_comparison.dead_tokens if metrics.tokenizer_comparison else None) or {}
    return ["figure", "value"], [[k, num(len(v) if isinstance(v, list) else v, 4)] for k, v in _flatten(dead)]


def tokenizer_table(metrics: EvalMetrics) -> Table:
    head = ["tokenizer", "text set", "language", "tokens/word", "bytes/token", "words in 3+ tokens", "tokens", "words"]

    def cells(s: str, v) -> list:
        figures = [num(v.tokens_per_word), num(v.bytes_per_token), pct(v.share_words_3plus)]
        return [_language(metrics, s), *figures, num(v.num_tokens), num(v.num_words)]

    return head, _pairs(metrics.tokenizer_metrics, cells)


def parity_table(metrics: EvalMetrics) -> Table:
    head = ["tokenizer", "aligned set", "tokens az", "tokens en", "parity (az/en)", "pairs"]
    return head, _pairs(metrics.parity, lambda _, v: _fields(v, ("tokens_az", "tokens_en", "parity", "num_pairs")))


def morph_table(metrics: EvalMetrics) -> Table:
    head = ["tokenizer", "resource", "words", "gold boundaries", "boundary recall"]
    head += ["token boundaries inside a morpheme", "exact segmentation"]
    shares = ("boundary_recall", "inside_morpheme_rate", "exact_segmentation_rate")
    return head, _pairs(
        metrics.morph,
        lambda _, v: [*_fields(v, ("num_words", "num_gold_boundaries")), *[pct(getattr(v, k)) for k in shares]],
    )


def repetition_table(metrics: EvalMetrics) -> Table:
    head = ["model", "mode", "answers", "words/answer", "distinct-1", "distinct-2", "repeated 3-gram rate"]
    figures = ("distinct_1", "distinct_2", "repeated_3gram_rate")
    return head, _pairs(
        metrics.generation, lambda _, v: [num(v.num_generations), num(v.num_words, 1), *_fields(v, figures)]
    )


def generations_tables(generations: list[dict], models: list[str]) -> dict[str, Table]:
    """Per mode: one row per prompt, one column per model (base, cpt, sft side by side)."""
    out: dict[str, Table] = {}
    for mode in dict.fromkeys(g["mode"] for g in generations):
        by_prompt: dict[str, dict] = {}
        for g in (g for g in generations if g["mode"] == mode):
            by_prompt.setdefault(g["prompt_id"], {"prompt": g["prompt"], "kind": g["kind"]})[g["model"]] = g["output"]
        rows = [
            [f"[{d['kind']}] {d['prompt']}", *[Cell(d.get(m, ""), "gen") for m in models]] for d in by_prompt.values()
        ]
        out[mode] = (["prompt", *models], rows)
    return out
