"""Figures and tables of the tokenizer stage: the validation sets, per-set metrics, the size rule, sweep.md and
comparison.md."""

from __future__ import annotations

from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import InputError
from dilforge_shared.fertility import measure, tokenizers_encoder
from tabulate import tabulate
from tokenizers import Tokenizer

from .candidates import Candidate
from .config import TokenizerConfig
from .metrics import StrategyRow


def measure_sets(tok: Tokenizer, sets: dict[str, list[str]]) -> dict[str, dict]:
    """Each set measured in one encode_batch call (the sets are small and in memory)."""
    encode = tokenizers_encoder(tok)
    return {
        name: measure(texts, encode, batch_size=max(1, len(texts))).model_dump()
        for name, texts in sets.items()
        if texts
    }


def language_figures(sets: dict[str, dict], names: list[str]) -> dict[str, dict]:
    """The eval report's per-language figures (exactly these three keys per set)."""
    return {
        name: {
            "tokens_per_word": sets[name]["tokens_per_word"],
            "bytes_per_token": sets[name]["bytes_per_token"],
            "frac_words_3plus": sets[name]["share_words_3plus"],
        }
        for name in names
        if name in sets
    }


def select(
    rows: list[dict],
    rule: str,
    tolerance: float,
    set_name: str,
    retain: str | None = None,
    retain_tolerance: float = 0.0,
    base_sets: dict | None = None,
) -> tuple[dict, bool]:
    """The published row by `rule` among the rows keeping `retain` within its bound, and whether any did (if
    none, the row closest to the bound)."""
    rows = sorted(rows, key=lambda r: r["vocab_size"])
    eligible = rows
    if retain is not None and base_sets and retain in base_sets:
        bound = base_sets[retain]["tokens_per_word"] * (1 + retain_tolerance)
        eligible = [r for r in rows if r["sets"][retain]["tokens_per_word"] <= bound]
        if not eligible:
            return min(rows, key=lambda r: r["sets"][retain]["tokens_per_word"]), False
    if rule == "largest":
        return eligible[-1], True
    best = min(r["sets"][set_name]["tokens_per_word"] for r in eligible)
    return next(r for r in eligible if r["sets"][set_name]["tokens_per_word"] <= best * (1 + tolerance)), True


def _figures(tokens_per_word: float, bytes_per_token: float, share_3plus: float) -> list[str]:
    return [f"{tokens_per_word:.3f}", f"{bytes_per_token:.3f}", f"{100 * share_3plus:.1f}%"]


def _set_figures(s: dict) -> list[str]:
    return _figures(s["tokens_per_word"], s["bytes_per_token"], s["share_words_3plus"])


def _markdown(head: list[str], rows: list[list], left: int) -> str:
    """A Markdown table (tabulate): the first `left` columns, the labels, left-aligned; the figures right."""
    return tabulate(rows, head, "pipe", stralign="right", colalign=["left"] * left, disable_numparse=True) + "\n"


def sweep_table(rows: list[dict], base: dict[str, dict] | None, selected: int | None) -> str:
    """The published strategy's sizes on every set, with the base tokenizer's figures beside them."""
    names = ["tokens/word", "bytes/token", "words 3+ tokens"]
    based = [f"base {n}" for n in names] if base else []
    if not rows and base:
        return _markdown(["set", *based], [[name, *_set_figures(s)] for name, s in base.items()], 1)
    body = []
    for row in sorted(rows, key=lambda r: r["vocab_size"]):
        size = f"{row['vocab_size']}{' (selected)' if row['vocab_size'] == selected else ''}"
        for name, s in row["sets"].items():
            body.append([size, name, *_set_figures(s), *(_set_figures(base[name]) if base and name in base else [])])
    return _markdown(["vocab size", "set", *names, *based], body, 2)


def comparison_table(comparison: list[StrategyRow]) -> str:
    """Every strategy and size side by side, one column group per language set."""
    names = list(dict.fromkeys(n for row in comparison for n in row.languages))
    head = ["strategy", "vocab size", "new tokens", "dead new"]
    head += [f"{n} {f}" for n in names for f in ("tokens/word", "bytes/token", "words 3+")]
    body = []
    for row in comparison:
        dead = "-" if row.dead_new_tokens_frac is None else f"{100 * row.dead_new_tokens_frac:.1f}%"
        cells = [f"{row.strategy}{' (selected)' if row.selected else ''}", row.vocab_size, row.num_new_tokens, dead]
        for n in names:
            s = row.languages.get(n)
            cells += _figures(s.tokens_per_word, s.bytes_per_token, s.frac_words_3plus) if s else ["-"] * 3
        body.append(cells)
    return _markdown(head, body, 1)


def read_validation_sets(config: TokenizerConfig, endpoint_url: str | None) -> dict[str, list[str]]:
    """Validation sets are small (dev sets): read whole; an empty one is an error, not a NaN."""
    sets = {}
    for source in config.validation:
        texts = list(
            iter_texts(
                source.uri, source.format, source.text_field, endpoint_url, config.normalization, **source.bounds
            )
        )
        if not texts:
            raise InputError("validation set is empty: no non-blank text in it", path=source.uri)
        sets[source.label] = texts
    return sets


def comparison_rows(candidates: list[Candidate], chosen: Candidate, names: list[str]) -> list[dict]:
    """Every candidate side by side on each language's validation text (the report's strategy table)."""
    return [
        {
            "strategy": c.strategy,
            "vocab_size": c.tok.get_vocab_size(with_added_tokens=True),
            "num_new_tokens": len(c.new_ids),
            "selected": c is chosen,
            "languages": language_figures(c.sets, names),
            "dead_new_tokens_frac": c.audit["dead_new_tokens_frac"],
        }
        for c in candidates
    ]
