"""The report: PNG plots (matplotlib, Agg), one self-contained HTML (plots inlined as base64) and Markdown."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;
padding:0 1em}
h1{border-bottom:2px solid #333}h2{margin-top:2em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.8em 0;font-size:.9em}th,td{border:1px solid #ccc;padding:.3em .6em;
vertical-align:top}th{background:#f2f2f2}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.gen{max-width:28em;white-space:pre-wrap;font-size:.85em}.better{color:#0a7a2f}.worse{color:#b00020}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.note{color:#666;font-size:.9em}
"""


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


# ----------------------------------------------------------------------------------------------- plots

def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def grouped_bars(data: dict[str, dict[str, float]], title: str, ylabel: str, path: Path) -> Path | None:
    """data[group][series] -> value; groups on the x axis (text sets), one bar per series (model/tokenizer)."""
    groups = sorted({g for s in data.values() for g in s})
    series = list(data)
    if not groups or not series:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * max(1, len(series)) / 2 + 2), 4))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [data[name].get(g, float("nan")) for g in groups]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(groups)), groups, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def sweep_plot(sweep: dict, path: Path) -> Path | None:
    rows = sweep.get("rows") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    sets = sorted({s for r in rows for s in r.get("sets", {})})
    for s in sets:
        pts = sorted((r["vocab_size"], r["sets"][s]["tokens_per_word"]) for r in rows if s in r.get("sets", {}))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        base = (sweep.get("base") or {}).get("sets", {}).get(s)
        if base:
            ax.axhline(base["tokens_per_word"], linestyle="--", linewidth=1, color=ax.lines[-1].get_color(),
                       label=f"{s} (base tokenizer)")
    if sweep.get("selected"):
        ax.axvline(sweep["selected"], color="grey", linestyle=":", label=f"selected {sweep['selected']}")
    sizes = sorted({r["vocab_size"] for r in rows})
    if len(sizes) > 1 and sizes[-1] / sizes[0] > 4:
        ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes], rotation=30)
    ax.minorticks_off()
    ax.set_xlabel("vocab size (regular tokens)")
    ax.set_ylabel("tokens per word")
    ax.set_title("Fertility per vocab size (tokenizer stage sweep)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def curves_plot(curves: dict[str, dict[str, list]], path: Path) -> Path | None:
    panels = [(stage, s) for stage, s in curves.items() if s]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (stage, series) in zip(axes[0], panels):
        for name, pts in sorted(series.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker="." if len(pts) < 30 else None)
        ax.set_title(f"{stage} training curves")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    return _save(fig, path)


def make_plots(metrics: dict, plot_dir: Path) -> dict[str, Path]:
    plots: dict[str, Path] = {}
    fert = {tok: {s: v["tokens_per_word"] for s, v in sets.items()} for tok, sets in metrics.get("tokenizer_metrics", {}).items()}
    bpb = {m: {s: v["bpb"] for s, v in sets.items()} for m, sets in metrics.get("bpb", {}).items()}
    morph = {tok: {src: v["boundary_recall"] for src, v in d.items() if v.get("boundary_recall") is not None}
             for tok, d in metrics.get("morph", {}).items()}
    for key, p in (
        ("fertility", grouped_bars(fert, "Fertility per tokenizer (lower is better)", "tokens per word",
                                   plot_dir / "fertility_per_tokenizer.png")),
        ("sweep", sweep_plot(metrics.get("vocab_sweep") or {}, plot_dir / "fertility_per_vocab_size.png")),
        ("bpb", grouped_bars(bpb, "Bits per byte per model and domain (lower is better)", "bits per byte",
                             plot_dir / "bpb_per_model.png")),
        ("morph", grouped_bars(morph, "Morpheme boundary recall (higher is better)",
                               "boundary recall", plot_dir / "morpheme_boundary_recall.png")),
        ("curves", curves_plot(metrics.get("curves", {}), plot_dir / "training_curves.png")),
    ):
        if p is not None:
            plots[key] = p
    return plots


# ----------------------------------------------------------------------------------------------- tables

Table = tuple[list[str], list[list[str]]]


def bpb_table(metrics: dict) -> Table:
    bpb = metrics.get("bpb", {})
    models = list(bpb)
    sets = sorted({s for d in bpb.values() for s in d})
    ref = models[0] if models else None
    head = ["model", *[f"{s} BPB" for s in sets], *([f"change vs {ref}"] if len(models) > 1 else [])]
    rows = []
    for m in models:
        row = [m, *[_fmt(bpb[m].get(s, {}).get("bpb"), 4) for s in sets]]
        if len(models) > 1:
            changes = [bpb[m][s]["bpb"] / bpb[ref][s]["bpb"] - 1 for s in sets if s in bpb[m] and s in bpb[ref]]
            row.append("–" if m == ref or not changes else f"{100 * sum(changes) / len(changes):+.1f}% (mean)")
        rows.append(row)
    return head, rows


def tokenizer_table(metrics: dict) -> Table:
    head = ["tokenizer", "text set", "tokens/word", "bytes/token", "words in 3+ tokens", "tokens", "words"]
    rows = [[tok, s, _fmt(v["tokens_per_word"]), _fmt(v["bytes_per_token"]), _pct(v["share_words_3plus"]),
             str(v["num_tokens"]), str(v["num_words"])]
            for tok, sets in metrics.get("tokenizer_metrics", {}).items() for s, v in sets.items()]
    return head, rows


def parity_table(metrics: dict) -> Table:
    head = ["tokenizer", "aligned set", "tokens az", "tokens en", "parity (az/en)", "pairs"]
    rows = [[tok, s, str(v["tokens_az"]), str(v["tokens_en"]), _fmt(v["parity"]), str(v["num_pairs"])]
            for tok, sets in metrics.get("parity", {}).items() for s, v in sets.items()]
    return head, rows


def morph_table(metrics: dict) -> Table:
    head = ["tokenizer", "resource", "words", "gold boundaries", "boundary recall", "token boundaries inside a morpheme",
            "exact segmentation"]
    rows = [[tok, src, str(v["num_words"]), str(v["num_gold_boundaries"]), _pct(v["boundary_recall"]),
             _pct(v["inside_morpheme_rate"]), _pct(v["exact_segmentation_rate"])]
            for tok, d in metrics.get("morph", {}).items() for src, v in d.items()]
    return head, rows


def repetition_table(metrics: dict) -> Table:
    head = ["model", "mode", "answers", "words/answer", "distinct-1", "distinct-2", "repeated 3-gram rate"]
    rows = [[m, mode, str(v["num_generations"]), _fmt(v["num_words"], 1), _fmt(v["distinct_1"]),
             _fmt(v["distinct_2"]), _fmt(v["repeated_3gram_rate"])]
            for m, modes in metrics.get("generation", {}).items() for mode, v in modes.items()]
    return head, rows


def cost_table(metrics: dict) -> Table:
    head = ["stage", "figure", "value"]
    rows = [[stage, k, _fmt(v)] for stage, d in metrics.get("cost", {}).items() for k, v in d.items()]
    return head, rows


def generations_tables(generations: list[dict], models: list[str]) -> dict[str, Table]:
    """Per mode: one row per prompt, one column per model."""
    out: dict[str, Table] = {}
    for mode in dict.fromkeys(g["mode"] for g in generations):
        by_prompt: dict[str, dict] = {}
        for g in generations:
            if g["mode"] == mode:
                by_prompt.setdefault(g["prompt_id"], {"prompt": g["prompt"], "kind": g["kind"]})[g["model"]] = g["output"]
        head = ["prompt", *models]
        rows = [[f"[{d['kind']}] {d['prompt']}", *[d.get(m, "") for m in models]] for d in by_prompt.values()]
        out[mode] = (head, rows)
    return out


# ----------------------------------------------------------------------------------------------- render

def _html_table(table: Table, gen: bool = False) -> str:
    head, rows = table
    if not rows:
        return '<p class="note">nothing to show</p>'
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            cls = "gen" if gen and i > 0 else ("num" if c[:1].isdigit() or c[:1] in "+-–" else "")
            cells.append(f'<td class="{cls}">{html.escape(c)}</td>' if cls else f"<td>{html.escape(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _md_table(table: Table) -> str:
    head, rows = table
    if not rows:
        return "_nothing to show_\n"
    def esc(c: str) -> str:
        return c.replace("|", "\\|").replace("\n", " ⏎ ")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


SECTIONS = [
    ("Bits per byte", "bpb", bpb_table, ("BPB of each model with its own tokenizer on each text set: NLL in bits over "
                                         "the UTF-8 bytes, so different vocabularies compare fairly. Lower is better.")),
    ("Tokenizer efficiency", "fertility", tokenizer_table, "Words are whitespace-separated; tokens exclude BOS/EOS."),
    ("Parity with English", None, parity_table, ("Tokens for the Azerbaijani side over tokens for the aligned English "
                                                 "side; 1.0 means Azerbaijani costs as much as English.")),
    ("Morpheme alignment", "morph", morph_table, ("Gold boundaries from segmented words, lemma/form pairs and glossed "
                                                  "UD sentences; see docs/eval.md for the method.")),
    ("Vocab size sweep", "sweep", None, "Fertility per vocab size from the tokenizer stage's manifest."),
    ("Training curves", "curves", None, "Loss per step read from the CPT/SFT manifests (or their TensorBoard logs)."),
    ("Cost", None, cost_table, "Time and token counts the upstream stages recorded in their manifests."),
    ("Generation repetition", None, repetition_table, (
        "Means over answers: distinct-n = unique n-grams / n-grams of words in one answer; repeated 3-gram rate = "
        "share of 3-grams that repeat an earlier one in the same answer.")),
]


def write_report(metrics: dict, generations: list[dict], out_dir: Path, title: str) -> dict[str, Path]:
    """report.html (self-contained), report.md and plots/*.png in out_dir; returns the paths."""
    plots = make_plots(metrics, out_dir / "plots")
    models = list(metrics.get("models", {}))
    html_parts = [(f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                   f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>")]
    md = [f"# {title}\n"]

    inv = [("models", ", ".join(f"{k} ({v.get('origin', '')})" for k, v in metrics.get("models", {}).items()) or "none"),
           ("tokenizers", ", ".join(k + (f" (same as {', '.join(v['aliases'])})" if v.get("aliases") else "")
                                    for k, v in metrics.get("tokenizers", {}).items()) or "none"),
           ("text sets", ", ".join(f"{k} ({v['num_docs']} docs, {v['num_bytes']} bytes)"
                                   for k, v in metrics.get("text_sets", {}).items()) or "none")]
    html_parts.append("<ul>" + "".join(f"<li><b>{k}</b>: {html.escape(v)}</li>" for k, v in inv) + "</ul>")
    md += [f"- **{k}**: {v}" for k, v in inv] + [""]
    for note in metrics.get("skipped", []):
        html_parts.append(f'<p class="note">skipped: {html.escape(note)}</p>')
        md.append(f"> skipped: {note}\n")

    for heading, plot_key, table_fn, note in SECTIONS:
        table = table_fn(metrics) if table_fn else None
        plot = plots.get(plot_key) if plot_key else None
        if (table is None or not table[1]) and plot is None:
            continue
        html_parts.append(f"<h2>{heading}</h2><p class='note'>{html.escape(note)}</p>")
        md += [f"## {heading}\n", f"{note}\n"]
        if table is not None and table[1]:
            html_parts.append(_html_table(table))
            md.append(_md_table(table))
        if plot is not None:
            html_parts.append(_img(plot, heading))
            md.append(f"![{heading}](plots/{plot.name})\n")

    gen_tables = generations_tables(generations, models)
    for mode, table in gen_tables.items():
        html_parts.append(f"<h2>Generations ({mode})</h2>" + _html_table(table, gen=True))
        md += [f"## Generations ({mode})\n", _md_table(table)]

    html_parts.append("</body></html>")
    (out_dir / "report.html").write_text("\n".join(html_parts), encoding="utf-8")
    (out_dir / "report.md").write_text("\n".join(md), encoding="utf-8")
    return {"html": out_dir / "report.html", "md": out_dir / "report.md", **{f"plot_{k}": v for k, v in plots.items()}}
