"""The report: tables built from metrics.json, rendered by Jinja2 templates shipped with the package
(`templates/report.html.j2`, self-contained with plots inlined as base64, and `templates/report.md.j2`).

Tables are data (a header and rows of cells); the templates own the markup and its escaping, so no
HTML or Markdown is assembled by string concatenation here. Every BPB change is per text set against
the reference (base) model: nothing averages across sets or languages.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .compare import language_name
from .plots import make_plots


@dataclass(frozen=True)
class Cell:
    """A table cell with a CSS class (better/worse colouring, numbers aligned right)."""

    text: str
    cls: str = ""

    def __str__(self) -> str:
        return self.text


Table = tuple[list[str], list[list[str | Cell]]]


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def change_cell(change: float | None) -> Cell:
    """A relative BPB change: negative is better (fewer bits per byte)."""
    if change is None:
        return Cell("–")
    return Cell(f"{100 * change:+.1f}%", "num better" if change < 0 else "num worse" if change > 0 else "num")


def transition(entry: dict | None) -> Cell:
    """'3.250 → 2.330 (−28.3%)' for one model on one set against the reference."""
    if not entry:
        return Cell("–")
    ch = change_cell(entry.get("change"))
    return Cell(f"{_fmt(entry.get('reference_bpb'), 3)} → {_fmt(entry.get('bpb'), 3)} ({ch.text})", ch.cls)


# ----------------------------------------------------------------------------------------------- tables


def headline_table(metrics: dict) -> Table:
    """One row per model: the target-language gain and each other language's retention, each on one named set."""
    h = metrics.get("headline") or {}
    if not h.get("gain") and not h.get("retention"):
        return [], []
    target, ref = h.get("target_language", "az"), h.get("reference")
    gain_set = next((g["set"] for g in h.get("gain", {}).values()), None)
    others: dict[str, str] = {}
    for langs in h.get("retention", {}).values():
        for lang, e in langs.items():
            others.setdefault(lang, e["set"])
    head = ["model"]
    if gain_set:
        head.append(f"{language_name(target)} gain: BPB vs {ref} on {gain_set}")
    head += [f"{language_name(lang)} retention: BPB vs {ref} on {name}" for lang, name in others.items()]
    models = list(dict.fromkeys([*h.get("gain", {}), *h.get("retention", {})]))
    rows = []
    for m in models:
        row: list[str | Cell] = [m]
        if gain_set:
            row.append(transition(h["gain"].get(m)))
        row += [transition(h.get("retention", {}).get(m, {}).get(lang)) for lang in others]
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


def _score(v: dict | None, metric: str) -> str:
    """'0.250 [0.10, 0.40]' (value and 95 % interval); chrF/BLEU with one decimal."""
    if not v:
        return "–"
    digits = 1 if metric in ("chrf++", "chrf", "bleu") else 3
    ci = v.get("ci95")
    return _fmt(v["value"], digits) + (f" [{_fmt(ci[0], digits)}, {_fmt(ci[1], digits)}]" if ci else "")


def _delta_cell(v: dict | None, delta: float | None, metric: str) -> Cell:
    """A score with its change against the reference model, coloured by whether higher is better."""
    from .harness import HIGHER_IS_BETTER

    text = _score(v, metric)
    if v is None or delta is None:
        return Cell(text, "num")
    digits = 1 if metric in ("chrf++", "chrf", "bleu") else 3
    better = delta > 0 if HIGHER_IS_BETTER.get(metric, True) else delta < 0
    cls = "num" if delta == 0 else "num better" if better else "num worse"
    return Cell(f"{text} ({delta:+.{digits}f})", cls)


def _task_rows(metrics: dict, metric_key: str) -> tuple[list[str], list[str], list[tuple[str, str, dict]]]:
    """(models, languages, [(row label, metric, {language: task key})]) of the downstream section."""
    d = metrics.get("downstream") or {}
    tasks, models = d.get("tasks") or {}, list(d.get("results") or {})
    languages = list(dict.fromkeys(t["language"] for t in tasks.values()))
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for key, t in tasks.items():
        for m in t[metric_key]:
            rows.setdefault((t["row"], m), {})[t["language"]] = key
    return models, languages, [(row, m, by_lang) for (row, m), by_lang in rows.items()]


def downstream_table(metrics: dict) -> Table:
    """Headline task rows: each model's figure per language side by side (95 % interval; change vs the
    reference model in brackets, coloured better/worse), with the task's chance level. Nothing averaged."""
    d = metrics.get("downstream") or {}
    models, languages, rows_ = _task_rows(metrics, "headline_metrics")
    if not models:
        return [], []
    results, changes, tasks = d["results"], d.get("changes") or {}, d["tasks"]
    head = ["task", "metric", "n", "chance"] + [f"{m} {lang}" for m in models for lang in languages]
    rows = []
    for row, metric, by_lang in rows_:
        chance = [
            f"{lang} {_fmt(tasks[k]['chance'][metric], 3 if metric not in ('chrf++', 'bleu') else 1)}"
            for lang, k in by_lang.items()
            if metric in tasks[k]["chance"]
        ]
        n = "/".join(str(tasks[k]["num_examples"]) for k in by_lang.values())
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


def tasks_detail_table(metrics: dict) -> Table:
    """Every task, model and metric: value, standard error, 95 % interval, chance, examples, shots."""
    d = metrics.get("downstream") or {}
    head = ["task", "language", "model", "metric", "value", "stderr", "95 % interval", "chance", "n", "shots"]
    rows = []
    for key, t in (d.get("tasks") or {}).items():
        for model, res in (d.get("results") or {}).items():
            for metric in dict.fromkeys([*t["metrics"], *t["headline_metrics"]]):
                v = res.get(key, {}).get(metric)
                if v is None:
                    continue
                ci = v.get("ci95")
                rows.append(
                    [
                        key,
                        t["language"],
                        model,
                        METRIC_NAMES.get(metric, metric),
                        Cell(_fmt(v["value"], 4), "num"),
                        Cell(_fmt(v.get("stderr"), 4), "num"),
                        Cell(f"{_fmt(ci[0], 4)} – {_fmt(ci[1], 4)}" if ci else "–", "num"),
                        Cell(_fmt(t["chance"].get(metric), 4), "num"),
                        Cell(str(t["num_examples"]), "num"),
                        Cell(str(t["num_fewshot"]), "num"),
                    ]
                )
    return head, rows


def bpb_table(metrics: dict) -> Table:
    """Every model on every set, with the set's language and the change against the reference on that set."""
    bpb, changes = metrics.get("bpb", {}), metrics.get("bpb_change", {})
    ref = (metrics.get("headline") or {}).get("reference")
    langs = {k: v.get("language") for k, v in metrics.get("text_sets", {}).items()}
    head = ["model", "text set", "language", "BPB", *([f"{ref} BPB", f"change vs {ref}"] if ref else [])]
    rows = []
    for m, sets in bpb.items():
        for s, res in sets.items():
            row: list[str | Cell] = [m, s, langs.get(s) or "–", Cell(_fmt(res.get("bpb"), 4), "num")]
            if ref:
                e = changes.get(m, {}).get(s)
                row += [
                    Cell(_fmt(e.get("reference_bpb") if e else None, 4), "num"),
                    change_cell(e.get("change")) if e else Cell("–"),
                ]
            rows.append(row)
    return head, rows


def step0_table(metrics: dict) -> Table:
    t = metrics.get("transplant") or {}
    if not t.get("step0_bpb"):
        return [], []
    sets = t.get("sets") or []
    head = ["initialisation", *[f"step-0 BPB ({s})" for s in sets]]
    rows = [
        [
            f"{method} (trained)" if method == t.get("method") else method,
            *[Cell(_fmt(vals.get(s), 4), "num") for s in sets],
        ]
        for method, vals in t["step0_bpb"].items()
    ]
    return head, rows


def leakage_table(metrics: dict) -> Table:
    """Step-0 leakage per initialisation and set: the base model's BPB, the extended tokenizer's and the base
    tokenisation's under the full softmax (what the new rows take from text the base model handled)."""
    t = metrics.get("transplant") or {}
    table = t.get("leakage") or {}
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
    for method, sets in table.items():
        name = f"{method} (trained)" if method == t.get("method") else method
        for s, r in sets.items():
            rows.append(
                [
                    name,
                    s,
                    Cell(_fmt(r.get("bpb_base_model"), 4), "num"),
                    Cell(_fmt(r.get("bpb_extended"), 4), "num"),
                    Cell(_fmt(r.get("extended_vs_base"), 4), "num"),
                    Cell(_fmt(r.get("bpb_base_tokenization"), 4), "num"),
                    Cell(_fmt(r.get("base_tokenization_vs_base"), 4), "num"),
                ]
            )
    return (head, rows) if rows else ([], [])


def strategy_table(metrics: dict) -> Table:
    """The tokenizer strategies side by side, every language's figures in the same row."""
    comp = metrics.get("tokenizer_comparison") or {}
    languages = comp.get("languages") or []
    head = ["strategy", "vocab size", "new tokens", "selected"]
    for lang in languages:
        head += [f"{lang} tokens/word", f"{lang} bytes/token", f"{lang} words in 3+ tokens"]
    head.append("dead new tokens")
    rows = []
    for r in comp.get("rows") or []:
        per = r.get("languages") or {}
        row: list[str | Cell] = [
            str(r.get("strategy")),
            Cell(_fmt(r.get("vocab_size")), "num"),
            Cell(_fmt(r.get("num_new_tokens")), "num"),
            "yes" if r.get("selected") else "",
        ]
        for lang in languages:
            v = per.get(lang) or {}
            row += [
                Cell(_fmt(v.get("tokens_per_word")), "num"),
                Cell(_fmt(v.get("bytes_per_token")), "num"),
                Cell(_pct(v.get("frac_words_3plus")), "num"),
            ]
        row.append(Cell(_pct(r.get("dead_new_tokens_frac")), "num"))
        rows.append(row)
    return head, rows


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out += _flatten(v, f"{key}.") if isinstance(v, dict) else [(key, v)]
    return out


def dead_tokens_table(metrics: dict) -> Table:
    dead = (metrics.get("tokenizer_comparison") or {}).get("dead_tokens") or {}
    rows = [
        [k, Cell(_fmt(v, 4) if isinstance(v, float) else _fmt(v if not isinstance(v, list) else len(v)), "num")]
        for k, v in _flatten(dead)
    ]
    return ["figure", "value"], rows


def tokenizer_table(metrics: dict) -> Table:
    head = ["tokenizer", "text set", "language", "tokens/word", "bytes/token", "words in 3+ tokens", "tokens", "words"]
    langs = {k: v.get("language") for k, v in metrics.get("text_sets", {}).items()}
    rows = [
        [
            tok,
            s,
            langs.get(s) or "–",
            Cell(_fmt(v["tokens_per_word"]), "num"),
            Cell(_fmt(v["bytes_per_token"]), "num"),
            Cell(_pct(v["share_words_3plus"]), "num"),
            Cell(str(v["num_tokens"]), "num"),
            Cell(str(v["num_words"]), "num"),
        ]
        for tok, sets in metrics.get("tokenizer_metrics", {}).items()
        for s, v in sets.items()
    ]
    return head, rows


def parity_table(metrics: dict) -> Table:
    head = ["tokenizer", "aligned set", "tokens az", "tokens en", "parity (az/en)", "pairs"]
    rows = [
        [
            tok,
            s,
            Cell(str(v["tokens_az"]), "num"),
            Cell(str(v["tokens_en"]), "num"),
            Cell(_fmt(v["parity"]), "num"),
            Cell(str(v["num_pairs"]), "num"),
        ]
        for tok, sets in metrics.get("parity", {}).items()
        for s, v in sets.items()
    ]
    return head, rows


def morph_table(metrics: dict) -> Table:
    head = [
        "tokenizer",
        "resource",
        "words",
        "gold boundaries",
        "boundary recall",
        "token boundaries inside a morpheme",
        "exact segmentation",
    ]
    rows = [
        [
            tok,
            src,
            Cell(str(v["num_words"]), "num"),
            Cell(str(v["num_gold_boundaries"]), "num"),
            Cell(_pct(v["boundary_recall"]), "num"),
            Cell(_pct(v["inside_morpheme_rate"]), "num"),
            Cell(_pct(v["exact_segmentation_rate"]), "num"),
        ]
        for tok, d in metrics.get("morph", {}).items()
        for src, v in d.items()
    ]
    return head, rows


def repetition_table(metrics: dict) -> Table:
    head = ["model", "mode", "answers", "words/answer", "distinct-1", "distinct-2", "repeated 3-gram rate"]
    rows = [
        [
            m,
            mode,
            Cell(str(v["num_generations"]), "num"),
            Cell(_fmt(v["num_words"], 1), "num"),
            Cell(_fmt(v["distinct_1"]), "num"),
            Cell(_fmt(v["distinct_2"]), "num"),
            Cell(_fmt(v["repeated_3gram_rate"]), "num"),
        ]
        for m, modes in metrics.get("generation", {}).items()
        for mode, v in modes.items()
    ]
    return head, rows


def cost_table(metrics: dict) -> Table:
    head = ["stage", "figure", "value"]
    rows = [[stage, k, Cell(_fmt(v), "num")] for stage, d in metrics.get("cost", {}).items() for k, v in d.items()]
    return head, rows


def generations_tables(generations: list[dict], models: list[str]) -> dict[str, Table]:
    """Per mode: one row per prompt, one column per model (base, cpt, sft side by side)."""
    out: dict[str, Table] = {}
    for mode in dict.fromkeys(g["mode"] for g in generations):
        by_prompt: dict[str, dict] = {}
        for g in generations:
            if g["mode"] == mode:
                by_prompt.setdefault(g["prompt_id"], {"prompt": g["prompt"], "kind": g["kind"]})[g["model"]] = g[
                    "output"
                ]
        head = ["prompt", *models]
        rows = [
            [f"[{d['kind']}] {d['prompt']}", *[Cell(d.get(m, ""), "gen") for m in models]] for d in by_prompt.values()
        ]
        out[mode] = (head, rows)
    return out


# ----------------------------------------------------------------------------------------------- render

SECTIONS = [
    (
        "Headline",
        None,
        headline_table,
        (
            "BPB of each model against the reference model named in the header (the base model when the pipeline has "
            "one) on the first text set of each language: the gain on the target language and what every other "
            "language kept (negative = fewer bits per byte = better). Per set, never averaged across languages."
        ),
    ),
    (
        "Headline: downstream tasks",
        None,
        downstream_table,
        (
            "Tasks run by lm-evaluation-harness with the task configs in the artifact's lm_eval_tasks/ (commands.txt "
            "reproduces them with `lm_eval`). Each figure with its 95 % interval (value ± 1.96 standard errors: "
            "binomial for accuracies and shares, bootstrap for chrF++/BLEU), the change against the reference "
            "model in brackets (green better, red worse, by the metric's direction) and the chance level: uniform "
            "guessing for classification and multiple choice, copying the source (translation) or the instruction "
            "(answers) for chrF++/BLEU. Translation columns are the target language. Small n means wide intervals: "
            "read a change as real only when the intervals do not overlap."
        ),
    ),
    (
        "Downstream tasks: all figures",
        None,
        tasks_detail_table,
        ("Every metric lm-eval reported, per task and model; per-example answers are in task_answers.jsonl."),
    ),
    (
        "Bits per byte",
        "bpb",
        bpb_table,
        (
            "BPB of each model with its own tokenizer on each text set: NLL in bits over "
            "the UTF-8 bytes, so different vocabularies compare fairly. Lower is better. "
            "The change is against the reference model on the same set."
        ),
    ),
    (
        "Step-0 BPB per initialisation",
        None,
        step0_table,
        (
            "BPB on the CPT validation text right after the vocabulary transplant, before any training, for each way of "
            "initialising the new embedding rows (from the CPT manifest)."
        ),
    ),
    (
        "Step-0 vocabulary leakage",
        None,
        leakage_table,
        (
            "Per initialisation (CPT manifest `transplant.step0_leakage`): each validation set scored with the extended "
            "tokenizer and in the base model's own tokenisation under the full softmax, next to the base model's BPB on "
            "the same text. Base tokenisation above 1.0 × base is probability the new rows take from text the base "
            "model already handled (docs/cpt.md, Vocabulary leakage)."
        ),
    ),
    (
        "Tokenizer strategies",
        None,
        strategy_table,
        (
            "The tokenizer stage's strategies side by side on each language's validation text (from its manifest); "
            "dead new tokens are never produced on the training corpus."
        ),
    ),
    ("Dead-token audit", None, dead_tokens_table, "From the tokenizer stage's manifest (`dead_tokens`)."),
    ("Tokenizer efficiency", "fertility", tokenizer_table, "Words are whitespace-separated; tokens exclude BOS/EOS."),
    (
        "Parity with English",
        None,
        parity_table,
        (
            "Tokens for the Azerbaijani side over tokens for the aligned English "
            "side; 1.0 means Azerbaijani costs as much as English."
        ),
    ),
    (
        "Morpheme alignment",
        "morph",
        morph_table,
        (
            "Gold boundaries from segmented words, lemma/form pairs and glossed "
            "UD sentences; see docs/eval.md for the method."
        ),
    ),
    ("Vocab size sweep", "sweep", None, "Fertility per vocab size from the tokenizer stage's manifest."),
    ("Training curves", "curves", None, "Loss per step read from the CPT/SFT manifests (or their TensorBoard logs)."),
    ("Cost", None, cost_table, "Time and token counts the upstream stages recorded in their manifests."),
    (
        "Generation repetition",
        None,
        repetition_table,
        (
            "Means over answers: distinct-n = unique n-grams / n-grams of words in one answer; repeated 3-gram rate = "
            "share of 3-grams that repeat an earlier one in the same answer."
        ),
    ),
]


@lru_cache(maxsize=2)
def _environment(autoescape: bool):
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(
        loader=PackageLoader("dilforge_eval", "templates"),
        autoescape=autoescape,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["md_cell"] = lambda c: str(c).replace("|", "\\|").replace("\n", " ⏎ ")
    env.tests["cell"] = lambda c: isinstance(c, Cell)
    return env


def _inventory(metrics: dict) -> list[tuple[str, str]]:
    return [
        ("models", ", ".join(f"{k} ({v.get('origin', '')})" for k, v in metrics.get("models", {}).items()) or "none"),
        (
            "tokenizers",
            ", ".join(
                k + (f" (same as {', '.join(v['aliases'])})" if v.get("aliases") else "")
                for k, v in metrics.get("tokenizers", {}).items()
            )
            or "none",
        ),
        (
            "text sets",
            ", ".join(
                f"{k} [{v.get('language', '?')}] ({v['num_docs']} docs, {v['num_bytes']} bytes)"
                for k, v in metrics.get("text_sets", {}).items()
            )
            or "none",
        ),
    ]


def write_report(metrics: dict, generations: list[dict], out_dir: Path, title: str) -> dict[str, Path]:
    """report.html (self-contained), report.md and plots/*.png in out_dir; returns the paths."""
    plots = make_plots(metrics, out_dir / "plots")
    sections = []
    for heading, plot_key, table_fn, note in SECTIONS:
        table = table_fn(metrics) if table_fn else None
        plot = plots.get(plot_key) if plot_key else None
        if (table is None or not table[1]) and plot is None:
            continue
        sections.append(
            {
                "heading": heading,
                "note": note,
                "table": table if table and table[1] else None,
                "plot_name": plot.name if plot else None,
                "plot_b64": base64.b64encode(plot.read_bytes()).decode() if plot else None,
            }
        )
    models = list(metrics.get("models", {}))
    context = {
        "title": title,
        "inventory": _inventory(metrics),
        "skipped": metrics.get("skipped", []),
        "sections": sections,
        "generations": generations_tables(generations, models),
    }
    (out_dir / "report.html").write_text(
        _environment(True).get_template("report.html.j2").render(context), encoding="utf-8"
    )
    (out_dir / "report.md").write_text(
        _environment(False).get_template("report.md.j2").render(context), encoding="utf-8"
    )
    return {"html": out_dir / "report.html", "md": out_dir / "report.md", **{f"plot_{k}": v for k, v in plots.items()}}
