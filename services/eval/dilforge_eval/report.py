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

# (heading, plot, table or the note of a plot-only section); a table's docstring is its note
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
    ("Vocab size sweep", "sweep", "Fertility per vocab size from the tokenizer stage's manifest."),
    ("Training curves", "curves", "Loss per step read from the CPT/SFT manifests (or their TensorBoard logs)."),
    ("Cost", None, tables.cost_table),
    ("Generation repetition", None, tables.repetition_table),
]


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
    for heading, plot_key, source in SECTIONS:
        table = source(metrics) if callable(source) else None
        note = " ".join(source.__doc__.split()) if callable(source) else source
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
