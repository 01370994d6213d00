"""The tokenizer stage, top to bottom.

parse (config, base tokenizer and family, validation sets) → read the corpora once, holding out a slice, and
train each strategy once at its largest size → cut the smaller sizes → measure and audit every (strategy, size)
→ pick the published size → publish (optionally pruned) in the base's family with metrics and reports."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.errors import InputError
from dilforge_shared.families import LLAMA3, Family
from dilforge_shared.metrics.tokenizer import TokenizerMetrics
from dilforge_shared.progress import Progress
from tokenizers import Tokenizer

from . import audit, bpe, continued, family_out, llama3, pretokens
from . import base as base_tok
from .base import Base, check_base, resolve_base
from .candidates import (
    Candidate,
    base_candidate,
    extend_candidates,
    prune_and_refill,
    replace_candidates,
)
from .config import TokenizerConfig
from .family_out import verify_output
from .report import (
    comparison_rows,
    comparison_table,
    language_figures,
    measure_sets,
    read_validation_sets,
    select,
    sweep_table,
)
from .stream import CorpusStream

log = logging.getLogger("dilforge.tokenizer")

HELDOUT = "heldout"


def run(config: TokenizerConfig, ctx: StageContext) -> StageResult:
    t_start = time.perf_counter()
    log_config(
        config,
        {
            "strategies": config.strategies,
            "replace_train_size": max(config.vocab_sizes),
            "extend_num_new_tokens": max(config.num_new_tokens),
        },
    )
    inputs = parse(config, ctx)
    trained = train(config, inputs, tty=sys.stderr.isatty())
    sets = measurement_sets(config, inputs, trained)
    t_metrics = time.perf_counter()
    measured = measure(config, inputs, trained, sets)
    selection = select_size(config, trained, measured)
    published = publish(config, ctx, inputs, trained, measured, selection)
    comparison = comparison_rows(trained.candidates, selection.chosen, list(inputs.validation))
    trained.seconds["measure_and_save"] = round(time.perf_counter() - t_metrics, 2)
    trained.seconds["total"] = round(time.perf_counter() - t_start, 2)
    metrics = tokenizer_metrics(config, inputs, trained, measured, selection, published, comparison)
    write_tables(ctx.opt.model_dir, metrics, measured, selection)
    return StageResult(metrics=metrics.model_dump())


# ---- the steps' results ---------------------------------------------------------------------------------


@dataclass
class Inputs:
    """The base (None for replace alone), the output's family, the validation sets and the corpus stream."""

    base: Base | None
    family: Family
    validation: dict[str, list[str]]
    stream: CorpusStream


@dataclass
class Trained:
    """Every candidate, the corpus's pre-token counts per pre-tokenizer ("base", "replace"), their summary and
    the seconds each part took."""

    candidates: list[Candidate]
    words: dict[str, Counter]
    pretokens: dict
    seconds: dict[str, float]

    def corpus_words(self, strategy: str) -> Counter | None:
        """The pre-token counts a candidate's audit encodes (None: no corpus)."""
        return self.words.get("replace" if strategy == "replace" else "base")


@dataclass
class Measured:
    """Every candidate measured and audited; the sweep rows of the configured strategy."""

    sets: dict[str, list[str]]
    base_metrics: dict | None
    rows: list[dict]


@dataclass
class Selection:
    """The candidate to publish, its size (None for `base`) and whether it keeps the retain bound."""

    chosen: Candidate
    selected: int | None
    retain_met: bool


@dataclass
class Published:
    """What was written: the tokenizer, the tokens pruned, its audit and figures, the checks of the folder."""

    tok: Tokenizer
    num_pruned: int
    audit: dict
    sets: dict
    output: dict


# ---- parse ------------------------------------------------------------------------------------------------


def parse(config: TokenizerConfig, ctx: StageContext) -> Inputs:
    """The base, checked against the strategies before any corpus is read; the validation sets; the stream."""
    base = resolve_base(config, ctx)
    check_base(config, base)
    family = base.family if base is not None and base.family is not None else LLAMA3
    log.info("base: %s (family %s)", base.uri if base else None, family.name)
    validation = read_validation_sets(config, ctx.endpoint_url)
    # one pass over the corpora: unique training lines with how often each was fed (weights), held-out slice
    stream = CorpusStream(
        config.corpora,
        seed=config.seed,
        validation_fraction=config.validation_fraction,
        num_validation_lines=config.num_validation_lines,
        max_lines=config.max_lines,
        dedup=config.dedup,
        normalization=config.normalization,
        endpoint_url=ctx.endpoint_url,
    )
    return Inputs(base=base, family=family, validation=validation, stream=stream)


# ---- train ------------------------------------------------------------------------------------------------


def train(config: TokenizerConfig, inputs: Inputs, tty: bool) -> Trained:
    """Count the corpus's pre-tokens once (under every pre-tokenizer a strategy needs), then train each strategy
    once from them, at its largest size."""
    base, stream = inputs.base, inputs.stream
    replace_tok = llama3.empty_bpe()  # replace's normalizer and pre-tokenizer
    tokenizers: dict[str, Tokenizer] = {}
    if base is not None and {"base", "extend"} & set(config.strategies):
        tokenizers["base"] = base.tok
    shares_base = (
        "base" in tokenizers
        and base.doc.get("pre_tokenizer") == bpe.model_of(replace_tok).get("pre_tokenizer")
        and base.doc.get("normalizer") is None
    )
    if "replace" in config.strategies and not shares_base:
        tokenizers["replace"] = replace_tok
    t0 = time.perf_counter()
    counts = pretokens.count(stream, tokenizers, config.max_pretokens) if config.corpora else None
    words = counts.words if counts is not None else {}
    if "replace" in config.strategies and "replace" not in words and "base" in words:
        words["replace"] = words["base"]
    seconds = {"count_pretokens": round(time.perf_counter() - t0, 2)}
    t_train = time.perf_counter()
    candidates: list[Candidate] = []
    if base is not None and "base" in config.strategies:
        candidates.append(base_candidate(base))
    if "extend" in config.strategies:
        t0 = time.perf_counter()
        seg = continued.segment(words["base"], base.doc)
        candidates += extend_candidates(config, seg, base, tty)
        seconds["train_extend"] = round(time.perf_counter() - t0, 2)
    if "replace" in config.strategies:
        t0 = time.perf_counter()
        candidates += replace_candidates(config, words["replace"], inputs.family, base, tty)
        seconds["train_replace"] = round(time.perf_counter() - t0, 2)
    seconds["train"] = round(time.perf_counter() - t_train, 2)
    return Trained(candidates=candidates, words=words, pretokens=counts.summary() if counts else {}, seconds=seconds)


def measurement_sets(config: TokenizerConfig, inputs: Inputs, trained: Trained) -> dict[str, list[str]]:
    """The held-out slice and the validation sets; refused when there was nothing to train on or measure."""
    stream = inputs.stream
    log.info("corpus: %s", json.dumps(stream.summary()["total"]))
    if config.strategy != "base" and not any(trained.words.values()):
        raise InputError(
            "no training text left after holding out the validation slice"
            + (" and dropping duplicates" if config.dedup else ""),
            path=", ".join(s.uri for s in config.corpora),
        )
    sets = {HELDOUT: stream.heldout, **inputs.validation} if stream.heldout else dict(inputs.validation)
    if not sets:
        raise InputError(
            "nothing to measure: give corpora (for a held-out slice) or validation sets", path="validation"
        )
    return sets


# ---- measure and select -------------------------------------------------------------------------------------


def measure(config: TokenizerConfig, inputs: Inputs, trained: Trained, sets: dict[str, list[str]]) -> Measured:
    """Every (strategy, size) on every set, and its dead-token audit; the configured strategy's sweep rows."""
    base = inputs.base
    base_metrics = measure_sets(base.tok, sets) if base is not None else None
    with Progress("measure", len(trained.candidates), unit="candidates", log=log) as bar:
        for cand in trained.candidates:
            cand.sets = base_metrics if cand.strategy == "base" else measure_sets(cand.tok, sets)
            cand.audit, cand.dead = audit.audit(
                cand.doc, cand.tok, trained.corpus_words(cand.strategy), cand.new_ids, inputs.validation
            )
            bar.update()
    rows = [
        {
            "vocab_size": c.size,
            "vocab_size_total": c.tok.get_vocab_size(with_added_tokens=True),
            **(
                {"vocab_size_regular": c.tok.get_vocab_size(with_added_tokens=False)}
                if c.strategy == "replace"
                else {"num_added_tokens": len(c.new_ids)}
            ),
            "sets": c.sets,
        }
        for c in trained.candidates
        if c.strategy == config.strategy and c.strategy != "base"
    ]
    return Measured(sets=sets, base_metrics=base_metrics, rows=rows)


def select_size(config: TokenizerConfig, trained: Trained, measured: Measured) -> Selection:
    """The size to publish by the config's rule and retain bound (`report.select`); `base` publishes the base."""
    candidates = trained.candidates
    if config.strategy == "base":
        return Selection(chosen=next(c for c in candidates if c.strategy == "base"), selected=None, retain_met=True)
    rows = measured.rows
    if config.selection_set not in rows[0]["sets"]:
        raise InputError(
            f"selection_set {config.selection_set!r} has no text to measure (empty held-out slice?)",
            path="selection_set",
        )
    row, retain_met = select(
        rows,
        config.selection,
        config.selection_tolerance,
        config.selection_set,
        config.retain_set,
        config.retain_tolerance,
        measured.base_metrics,
    )
    selected = row["vocab_size"]
    chosen = next(c for c in candidates if c.strategy == config.strategy and c.size == selected)
    if not retain_met:
        log.warning(
            "no size keeps %s within %.1f %% of the base; publishing the closest (%d)",
            config.retain_set,
            100 * config.retain_tolerance,
            selected,
        )
    return Selection(chosen=chosen, selected=selected, retain_met=retain_met)


# ---- publish ------------------------------------------------------------------------------------------------


def publish(
    config: TokenizerConfig,
    ctx: StageContext,
    inputs: Inputs,
    trained: Trained,
    measured: Measured,
    selection: Selection,
) -> Published:
    """Prune (optional), write the folder in the base's family, verify it and measure what was written."""
    chosen, base = selection.chosen, inputs.base
    published, pruned, published_audit = chosen.tok, 0, chosen.audit
    if config.prune_dead and chosen.dead and chosen.strategy != "base":  # extend: also intermediates (ignore_merges)
        doc, pruned = (
            prune_and_refill(chosen, base, trained.words["base"])
            if chosen.strategy == "extend"
            else audit.prune(chosen.doc, chosen.first_new_id, chosen.dead)
        )
        published = bpe.from_doc(doc)
        if chosen.strategy == "replace":
            published = family_out.finish(published, inputs.family, base.doc if base else None)
        new_ids = {i for i in doc["model"]["vocab"].values() if i >= chosen.first_new_id}
        published_audit, _ = audit.audit(
            doc, published, trained.corpus_words(chosen.strategy), new_ids, inputs.validation
        )
        log.info(
            "pruned %d new tokens (%s); %d new tokens published",
            pruned,
            "dead, or rarely used holders of dead intermediates; refilled with further merges"
            if chosen.strategy == "extend"
            else "dead; kept ones are built from the rest",
            published.get_vocab_size(with_added_tokens=True) - chosen.first_new_id
            if chosen.strategy == "extend"
            else len(doc["model"]["vocab"]) - chosen.first_new_id,
        )
    if chosen.strategy == "base":
        base_tok.copy_folder(base.folder, ctx.opt.model_dir)
    else:
        family_out.write_folder(published, ctx.opt.model_dir, chosen.family)
    output = verify_output(ctx.opt.model_dir, published)
    published_sets = chosen.sets if published is chosen.tok else measure_sets(published, measured.sets)
    return Published(tok=published, num_pruned=pruned, audit=published_audit, sets=published_sets, output=output)


def tokenizer_metrics(
    config: TokenizerConfig,
    inputs: Inputs,
    trained: Trained,
    measured: Measured,
    selection: Selection,
    published: Published,
    comparison: list[dict],
) -> TokenizerMetrics:
    """The manifest's metrics, as the typed model (a misnamed or missing figure fails here)."""
    base_metrics = measured.base_metrics
    return TokenizerMetrics(
        strategy=config.strategy,
        family=selection.chosen.family.name,
        selected_vocab_size=selection.selected,
        selection={
            "rule": config.selection,
            "tolerance": config.selection_tolerance,
            "set": config.selection_set,
            "retain_set": config.retain_set,
            "retain_tolerance": config.retain_tolerance,
            "retain_met": selection.retain_met,
        },
        word_definition="whitespace-separated (str.split); tokens without BOS/EOS; fertility = sum tokens / sum words",
        comparison=comparison,
        languages=language_figures(published.sets, list(inputs.validation)),
        dead_tokens={**published.audit, "num_pruned": published.num_pruned},
        sweep=measured.rows,
        base={"uri": inputs.base.uri, "sets": base_metrics} if base_metrics is not None else None,
        output=published.output,
        corpus={**inputs.stream.summary(), "pretokens": trained.pretokens},
        seconds=trained.seconds,
        # this process or its largest pre-tokenizing worker
        peak_rss_mib=round(
            max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024,
            1,
        ),
    )


def write_tables(out: Path, metrics: TokenizerMetrics, measured: Measured, selection: Selection) -> None:
    """metrics.json, sweep.md and comparison.md next to the tokenizer (the sweep line is also logged)."""
    table = sweep_table(measured.rows, measured.base_metrics, selection.selected)
    compared = comparison_table(metrics.comparison)
    log.info("sweep (selected %s):\n%s\ncomparison:\n%s", selection.selected, table, compared)
    (out / "metrics.json").write_text(json.dumps(metrics.model_dump(), indent=2))
    (out / "sweep.md").write_text(table)
    (out / "comparison.md").write_text(compared)
