"""The report's plots: PNG files drawn with matplotlib (Agg), embedded in the HTML and linked from the Markdown."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
# labels are user text (set, model, tokenizer names): a `$` in one must not be parsed as mathtext (ValueError)
matplotlib.rcParams["text.parse_math"] = False
import matplotlib.pyplot as plt  # noqa: E402 - after the rcParams change above

from .metrics import EvalMetrics, VocabSweep  # noqa: E402


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
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def sweep_plot(sweep: VocabSweep | None, path: Path) -> Path | None:
    if sweep is None or not sweep.rows:
        return None
    rows = sweep.rows
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for s in sorted({s for r in rows for s in r["sets"]}):
        pts = sorted((r["vocab_size"], r["sets"][s]["tokens_per_word"]) for r in rows if s in r["sets"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        if base := sweep.base["sets"].get(s) if sweep.base else None:
            colour, label = ax.lines[-1].get_color(), f"{s} (base tokenizer)"
            ax.axhline(base["tokens_per_word"], linestyle="--", linewidth=1, color=colour, label=label)
    if sweep.selected:
        ax.axvline(sweep.selected, color="grey", linestyle=":", label=f"selected {sweep.selected}")
    sizes = sorted({r["vocab_size"] for r in rows})
    if len(sizes) > 1 and sizes[-1] / sizes[0] > 4:
        ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes], rotation=30)
    ax.minorticks_off()
    ax.set(xlabel="vocab size (regular tokens)", ylabel="tokens per word")
    ax.set_title("Fertility per vocab size (tokenizer stage sweep)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def curves_plot(curves: dict[str, dict[str, list]], path: Path) -> Path | None:
    panels = [(stage, s) for stage, s in curves.items() if s]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (stage, series) in zip(axes[0], panels, strict=False):
        for name, pts in sorted(series.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, marker="." if len(pts) < 30 else None)
        ax.set(title=f"{stage} training curves", xlabel="step", ylabel="loss")
        ax.legend(fontsize=8)
    return _save(fig, path)


def make_plots(metrics: EvalMetrics, plot_dir: Path) -> dict[str, Path]:
    """The report's plots by section key (a plot without data is left out)."""
    fert = {tok: {s: v.tokens_per_word for s, v in sets.items()} for tok, sets in metrics.tokenizer_metrics.items()}
    bpb = {m: {s: v.bpb for s, v in sets.items()} for m, sets in metrics.bpb.items()}
    morph = {
        tok: {src: v.boundary_recall for src, v in d.items() if v.boundary_recall is not None}
        for tok, d in metrics.morph.items()
    }
    bars = {  # section key: data, title, y label, file
        "fertility": (fert, "Fertility per tokenizer (lower is better)", "tokens per word", "fertility_per_tokenizer"),
        "bpb": (bpb, "Bits per byte per model and domain (lower is better)", "bits per byte", "bpb_per_model"),
        "morph": (morph, "Morpheme boundary recall (higher is better)", "boundary recall", "morpheme_boundary_recall"),
    }
    plots = {key: grouped_bars(d, title, y, plot_dir / f"{name}.png") for key, (d, title, y, name) in bars.items()}
    plots["sweep"] = sweep_plot(metrics.vocab_sweep, plot_dir / "fertility_per_vocab_size.png")
    plots["curves"] = curves_plot(metrics.curves, plot_dir / "training_curves.png")
    return {key: p for key, p in plots.items() if p is not None}
