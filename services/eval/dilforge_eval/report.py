"""report.html (self-contained, plots inlined) and report.md from the typed `EvalMetrics`: the tables of `tables`
rendered by tabulate into the package's Jinja2 templates."""

from __future__ import annotations

import base64
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape
from tabulate import tabulate

from . import tables
from .metrics import EvalMetrics
from .plots import make_plots

# (heading, plot, table); the notes are in NOTES, not in docstrings (which -OO drops)
SECTIONS = [
    ("Headline", None, tables.headline_table),
    ("Headline: downstream tasks", None, tables.downstream_table),
    ("Headline: the assistant", None, tables.assistant_table),
    ("Downstream tasks: all figures", None, tables.tasks_detail_table),
    ("Bits per byte", "bpb", tables.bpb_table),
    ("Step-0 BPB per initialisation", None, tables.step0_table),
    ("Step-0 vocabulary leakage", None, tables.leakage_table),
    ("Tokenizer strategies", None, tables.strategy_table),
    ("Dead-token audit", None, tables.dead_tokens_table),
    ("Tokenizer efficiency", "fertility", tables.tokenizer_table),
    ("Parity with English", None, tables.parity_table),
    ("Morpheme alignment", "morph", tables.morph_table),
    ("Vocab size sweep", "sweep", None),
    ("Training curves", "curves", None),
    ("Cost", None, tables.cost_table),
    ("Generation repetition", None, tables.repetition_table),
]
NOTES = {  # the note printed under each heading (whitespace collapsed)
    "Headline": """BPB of each model against the reference model named in the header (the base model when the
        pipeline has one) on the first text set of each language: the gain on the target language and what every
        other language kept (negative = fewer bits per byte = better). Per set, never averaged across languages.""",
    "Headline: downstream tasks": """Tasks run by lm-evaluation-harness with the task configs in the artifact's
        lm_eval_tasks/ (commands.txt reproduces them with `lm_eval`). Each figure with its 95 % interval (value ±
        1.96 standard errors: binomial for accuracies and shares, bootstrap for chrF++/BLEU), the change against the
        reference model in brackets (green better, red worse, by the metric's direction) and the chance level:
        uniform guessing for classification and multiple choice, copying the source (translation) or the instruction
        (answers) for chrF++/BLEU. Translation columns are the target language. Small n means wide intervals: read a
        change as real only when the intervals do not overlap.""",
    "Headline: the assistant": """Held-out user turns (never trained on) answered through each model's published
        generation defaults and chat template, as `serve`, HF generate and the GGUF answer them; per language, and
        the target language typed without its letters (ə→e, ı→i, ş→s, ç→c, ğ→g, ö→o, ü→u). Each share with its 95 %
        Wilson interval: answers in the prompt's language (lingua), ending the turn (a stop token before the length
        limit), looping (≥ 30 % repeated word 3-grams), parroting (≥ 80 % of the words copied from the prompt);
        chrF++ against the references where the prompts have them. Red: under the gate's thresholds
        (serve/deploy/export refuse such a model without --force). Answers: assistant_answers.jsonl.""",
    "Downstream tasks: all figures": """Every metric lm-eval reported, per task and model; per-example answers are
        in task_answers.jsonl.""",
    "Bits per byte": """BPB of each model with its own tokenizer on each text set: NLL in bits over the UTF-8 bytes,
        so different vocabularies compare fairly. Lower is better. The change is against the reference model on the
        same set.""",
    "Step-0 BPB per initialisation": """BPB on the CPT validation text right after the vocabulary transplant, before
        any training, for each way of initialising the new embedding rows (from the CPT manifest).""",
    "Step-0 vocabulary leakage": """Per initialisation (CPT manifest `transplant.step0_leakage`): each validation
        set scored with the extended tokenizer and in the base model's own tokenisation under the full softmax, next
        to the base model's BPB on the same text. Base tokenisation above 1.0 × base is probability the new rows
        take from text the base model already handled (docs/cpt.md, Vocabulary leakage).""",
    "Tokenizer strategies": """The tokenizer stage's strategies side by side on each language's validation text
        (from its manifest); dead new tokens are never produced on the training corpus.""",
    "Dead-token audit": "From the tokenizer stage's manifest (`dead_tokens`).",
    "Tokenizer efficiency": "Words are whitespace-separated; tokens exclude BOS/EOS.",
    "Parity with English": """Tokens for the Azerbaijani side over tokens for the aligned English side; 1.0 means
        Azerbaijani costs as much as English.""",
    "Morpheme alignment": """Gold boundaries from segmented words, lemma/form pairs and glossed UD sentences; see
        docs/eval.md for the method.""",
    "Vocab size sweep": "Fertility per vocab size from the tokenizer stage's manifest.",
    "Training curves": "Loss per step read from the CPT/SFT manifests.",
    "Cost": "Time and token counts the upstream stages recorded in their manifests.",
    "Generation repetition": """Means over answers: distinct-n = unique n-grams / n-grams of words in one answer;
        repeated 3-gram rate = share of 3-grams that repeat an earlier one in the same answer.""",
}


def _render(table: tables.Table) -> dict[str, str]:
    """The table as HTML (every text escaped, a better/worse/gen cell in a span of that class) and as Markdown,
    both by tabulate; a column of numbers is right-aligned."""
    head, rows = table
    align = ["right" if any("num" in getattr(r[i], "cls", "") for r in rows) else "left" for i in range(len(head))]
    kw = {"colalign": align, "disable_numparse": True}
    html = [[_html_cell(c) for c in row] for row in [head, *rows]]
    md = [[str(c).replace("|", "\\|").replace("\n", " ⏎ ") for c in row] for row in [head, *rows]]
    return {
        "html": Markup(tabulate(html[1:], html[0], "unsafehtml", **kw)),
        "md": tabulate(md[1:], md[0], "pipe", **kw),
    }


def _html_cell(c: str | tables.Cell) -> str:
    cls = getattr(c, "cls", "").replace("num", "").strip()
    return str(Markup('<span class="{}">{}</span>').format(cls, c) if cls else escape(c))


def _inventory(m: EvalMetrics) -> list[tuple[str, str]]:
    listed = {
        "models": [f"{k} ({v.origin})" for k, v in m.models.items()],
        "tokenizers": [
            k + (f" (same as {', '.join(v.aliases)})" if v.aliases else "") for k, v in m.tokenizers.items()
        ],
        "text sets": [f"{k} [{v.language}] ({v.num_docs} docs, {v.num_bytes} bytes)" for k, v in m.text_sets.items()],
    }
    return [(k, ", ".join(v) or "none") for k, v in listed.items()]


def write_report(metrics: EvalMetrics, generations: list[dict], out_dir: Path, title: str) -> dict[str, Path]:
    """report.html (self-contained), report.md and plots/*.png in out_dir; returns the paths."""
    plots = make_plots(metrics, out_dir / "plots")
    sections = []
    for heading, plot_key, make_table in SECTIONS:
        note = " ".join(NOTES[heading].split())
        table = make_table(metrics) if make_table else None
        plot = plots.get(plot_key) if plot_key else None
        if (table is None or not table[1]) and plot is None:
            continue
        sections.append(
            {
                "heading": heading,
                "note": note,
                "table": _render(table) if table and table[1] else None,
                "plot_name": plot.name if plot else None,
                "plot_b64": base64.b64encode(plot.read_bytes()).decode() if plot else None,
            }
        )
    context = {
        "title": title,
        "inventory": _inventory(metrics),
        "skipped": metrics.skipped,
        "sections": sections,
        "generations": {
            mode: _render(t) for mode, t in tables.generations_tables(generations, list(metrics.models)).items()
        },
    }
    for ext in ("html", "md"):
        env = Environment(
            loader=PackageLoader("dilforge_eval", "templates"),
            autoescape=ext == "html",
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
        )
        (out_dir / f"report.{ext}").write_text(env.get_template(f"report.{ext}.j2").render(context), encoding="utf-8")
    return {"html": out_dir / "report.html", "md": out_dir / "report.md", **{f"plot_{k}": v for k, v in plots.items()}}
