"""The report's tables of what the text looks like: tokenizer strategies and efficiency, the dead-token audit,
parity with English, morpheme alignment, generation repetition and the generations side by side."""

from __future__ import annotations

from typing import Any

from .metrics import EvalMetrics
from .tables import Cell, Table, fmt, pct


def strategy_table(metrics: EvalMetrics) -> Table:
    """The tokenizer strategies side by side, every language's figures in the same row."""
    comp = metrics.tokenizer_comparison
    if comp is None:
        return [], []
    head = ["strategy", "vocab size", "new tokens", "selected"]
    for lang in comp.languages:
        head += [f"{lang} tokens/word", f"{lang} bytes/token", f"{lang} words in 3+ tokens"]
    head.append("dead new tokens")
    rows = []
    for r in comp.rows:
        row: list[str | Cell] = [
            r.strategy,
            Cell(fmt(r.vocab_size), "num"),
            Cell(fmt(r.num_new_tokens), "num"),
            "yes" if r.selected else "",
        ]
        for lang in comp.languages:
            v = r.languages.get(lang)
            row += [
                Cell(fmt(v.tokens_per_word if v else None), "num"),
                Cell(fmt(v.bytes_per_token if v else None), "num"),
                Cell(pct(v.frac_words_3plus if v else None), "num"),
            ]
        row.append(Cell(pct(r.dead_new_tokens_frac), "num"))
        rows.append(row)
    return head, rows


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out += _flatten(v, f"{key}.") if isinstance(v, dict) else [(key, v)]
    return out


def dead_tokens_table(metrics: EvalMetrics) -> Table:
    """The tokenizer stage's dead-token audit, every figure it published (a free-form section: flattened)."""
    dead = (metrics.tokenizer_comparison.dead_tokens if metrics.tokenizer_comparison else None) or {}
    rows = [
        [k, Cell(fmt(v, 4) if isinstance(v, float) else fmt(v if not isinstance(v, list) else len(v)), "num")]
        for k, v in _flatten(dead)
    ]
    return ["figure", "value"], rows


def tokenizer_table(metrics: EvalMetrics) -> Table:
    head = ["tokenizer", "text set", "language", "tokens/word", "bytes/token", "words in 3+ tokens", "tokens", "words"]
    langs = {k: v.language for k, v in metrics.text_sets.items()}
    rows = [
        [
            tok,
            s,
            langs.get(s) or "–",
            Cell(fmt(v.tokens_per_word), "num"),
            Cell(fmt(v.bytes_per_token), "num"),
            Cell(pct(v.share_words_3plus), "num"),
            Cell(str(v.num_tokens), "num"),
            Cell(str(v.num_words), "num"),
        ]
        for tok, sets in metrics.tokenizer_metrics.items()
        for s, v in sets.items()
    ]
    return head, rows


def parity_table(metrics: EvalMetrics) -> Table:
    head = ["tokenizer", "aligned set", "tokens az", "tokens en", "parity (az/en)", "pairs"]
    rows = [
        [
            tok,
            s,
            Cell(str(v.tokens_az), "num"),
            Cell(str(v.tokens_en), "num"),
            Cell(fmt(v.parity), "num"),
            Cell(str(v.num_pairs), "num"),
        ]
        for tok, sets in metrics.parity.items()
        for s, v in sets.items()
    ]
    return head, rows


def morph_table(metrics: EvalMetrics) -> Table:
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
            Cell(str(v.num_words), "num"),
            Cell(str(v.num_gold_boundaries), "num"),
            Cell(pct(v.boundary_recall), "num"),
            Cell(pct(v.inside_morpheme_rate), "num"),
            Cell(pct(v.exact_segmentation_rate), "num"),
        ]
        for tok, d in metrics.morph.items()
        for src, v in d.items()
    ]
    return head, rows


def repetition_table(metrics: EvalMetrics) -> Table:
    head = ["model", "mode", "answers", "words/answer", "distinct-1", "distinct-2", "repeated 3-gram rate"]
    rows = [
        [
            m,
            mode,
            Cell(str(v.num_generations), "num"),
            Cell(fmt(v.num_words, 1), "num"),
            Cell(fmt(v.distinct_1), "num"),
            Cell(fmt(v.distinct_2), "num"),
            Cell(fmt(v.repeated_3gram_rate), "num"),
        ]
        for m, modes in metrics.generation.items()
        for mode, v in modes.items()
    ]
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
