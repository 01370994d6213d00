"""The tokenizer stage, top to bottom.

The base and validation sets → read the corpora once, holding out a slice, counting their pre-tokens → train each
strategy once at its largest size, cut the smaller sizes → measure and audit every (strategy, size) → pick the
published size → publish (optionally pruned) in the base's family with metrics and reports."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections import Counter

from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.errors import InputError
from dilforge_shared.families import LLAMA3, Family
from dilforge_shared.progress import Progress
from tokenizers import Tokenizer

from . import audit, bpe, continued, family_out, llama3, pretokens
from . import base as base_tok
from .base import Base, resolve_base
from .candidates import Candidate, base_candidate, extend_candidates, prune_and_refill, replace_candidates
from .config import TokenizerConfig
from .metrics import TokenizerMetrics
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
    base = resolve_base(config, ctx)  # refused here, before any corpus is read, when it does not fit the strategies
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
    t0 = time.perf_counter()
    counts = count_pretokens(config, base, stream)
    seconds = {"count_pretokens": round(time.perf_counter() - t0, 2)}
    counted = counts.words if counts is not None else {}
    # the pre-token counts each strategy's training and audit read (replace's are the base's when it shares them)
    words = {"base": counted.get("base"), "extend": counted.get("base")}
    words["replace"] = counted.get("replace", words["base"])
    candidates = train(config, base, family, words, seconds)
    sets = measurement_sets(config, stream, validation, counted)

    t_metrics = time.perf_counter()
    base_metrics = measure(candidates, base, words, sets, validation)
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
        for c in candidates
        if c.strategy == config.strategy != "base"
    ]
    chosen, selected, retain_met = select_size(config, candidates, rows, base_metrics)
    published, num_pruned, published_audit = publish(config, ctx, chosen, base, family, words, validation)
    output = family_out.verify_output(ctx.opt.model_dir, published)
    published_sets = chosen.sets if published is chosen.tok else measure_sets(published, sets)
    seconds["measure_and_save"] = round(time.perf_counter() - t_metrics, 2)
    seconds["total"] = round(time.perf_counter() - t_start, 2)
    metrics = TokenizerMetrics(
        strategy=config.strategy,
        family=chosen.family.name,
        selected_vocab_size=selected,
        selection={
            "rule": config.selection,
            "tolerance": config.selection_tolerance,
            "set": config.selection_set,
            "retain_set": config.retain_set,
            "retain_tolerance": config.retain_tolerance,
            "retain_met": retain_met,
        },
        word_definition="whitespace-separated (str.split); tokens without BOS/EOS; fertility = sum tokens / sum words",
        comparison=comparison_rows(candidates, chosen, list(validation)),
        languages=language_figures(published_sets, list(validation)),
        dead_tokens={**published_audit, "num_pruned": num_pruned},
        sweep=rows,
        base={"uri": base.uri, "sets": base_metrics} if base_metrics is not None else None,
        output=output,
        corpus={**stream.summary(), "pretokens": counts.summary() if counts else {}},
        seconds=seconds,
        # this process or its largest pre-tokenizing worker
        peak_rss_mib=round(
            max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024,
            1,
        ),
    )
    # metrics.json, sweep.md and comparison.md next to the tokenizer (the tables are also logged)
    table, compared = sweep_table(rows, base_metrics, selected), comparison_table(metrics.comparison)
    log.info("sweep (selected %s):\n%s\ncomparison:\n%s", selected, table, compared)
    (ctx.opt.model_dir / "metrics.json").write_text(json.dumps(metrics.model_dump(), indent=2))
    (ctx.opt.model_dir / "sweep.md").write_text(table)
    (ctx.opt.model_dir / "comparison.md").write_text(compared)
    return StageResult(metrics=metrics.model_dump())


def count_pretokens(
    config: TokenizerConfig, base: Base | None, stream: CorpusStream
) -> pretokens.PretokenCounts | None:
    """The corpus's pre-token counts (None without corpora), once under each pre-tokenizer a strategy needs: the
    base's ("base") and replace's ("replace", left out when it is the base's)."""
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
    return pretokens.count(stream, tokenizers, config.max_pretokens) if config.corpora else None


def train(
    config: TokenizerConfig, base: Base | None, family: Family, words: dict, seconds: dict[str, float]
) -> list[Candidate]:
    """Every candidate: each strategy trained once from the pre-token counts, at its largest size."""
    tty = sys.stderr.isatty()
    t_train = time.perf_counter()
    candidates: list[Candidate] = []
    if base is not None and "base" in config.strategies:
        candidates.append(base_candidate(base))
    if "extend" in config.strategies:
        t0 = time.perf_counter()
        candidates += extend_candidates(config, continued.segment(words["extend"], base.doc), base, tty)
        seconds["train_extend"] = round(time.perf_counter() - t0, 2)
    if "replace" in config.strategies:
        t0 = time.perf_counter()
        candidates += replace_candidates(config, words["replace"], family, base, tty)
        seconds["train_replace"] = round(time.perf_counter() - t0, 2)
    seconds["train"] = round(time.perf_counter() - t_train, 2)
    return candidates


def measurement_sets(
    config: TokenizerConfig, stream: CorpusStream, validation: dict[str, list[str]], counted: dict[str, Counter]
) -> dict[str, list[str]]:
    """The held-out slice and the validation sets; refused when there was nothing to train on or measure."""
    log.info("corpus: %s", json.dumps(stream.summary()["total"]))
    if config.strategy != "base" and not any(counted.values()):
        raise InputError(
            "no training text left after holding out the validation slice"
            + (" and dropping duplicates" if config.dedup else ""),
            path=", ".join(s.uri for s in config.corpora),
        )
    sets = {HELDOUT: stream.heldout, **validation} if stream.heldout else dict(validation)
    if not sets:
        raise InputError(
            "nothing to measure: give corpora (for a held-out slice) or validation sets", path="validation"
        )
    return sets


def measure(
    candidates: list[Candidate],
    base: Base | None,
    words: dict,
    sets: dict[str, list[str]],
    validation: dict[str, list[str]],
) -> dict | None:
    """Every candidate on every set, and its dead-token audit; returns the base's figures (None without a base)."""
    base_metrics = measure_sets(base.tok, sets) if base is not None else None
    with Progress("measure", len(candidates), unit="candidates", log=log) as bar:
        for cand in candidates:
            cand.sets = base_metrics if cand.strategy == "base" else measure_sets(cand.tok, sets)
            cand.audit, cand.dead = audit.audit(cand.doc, cand.tok, words[cand.strategy], cand.new_ids, validation)
            bar.update()
    return base_metrics


def select_size(
    config: TokenizerConfig, candidates: list[Candidate], rows: list[dict], base_metrics: dict | None
) -> tuple[Candidate, int | None, bool]:
    """(the candidate to publish, its size, whether it keeps the retain bound) by the config's rule (`report.select`);
    `base` publishes the base (size None)."""
    if config.strategy == "base":
        return next(c for c in candidates if c.strategy == "base"), None, True
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
        base_metrics,
    )
    selected = row["vocab_size"]
    if not retain_met:
        log.warning(
            "no size keeps %s within %.1f %% of the base; publishing the closest (%d)",
            config.retain_set,
            100 * config.retain_tolerance,
            selected,
        )
    return next(c for c in candidates if c.strategy == config.strategy and c.size == selected), selected, retain_met


def publish(
    config: TokenizerConfig,
    ctx: StageContext,
    chosen: Candidate,
    base: Base | None,
    family: Family,
    words: dict,
    validation: dict[str, list[str]],
) -> tuple[Tokenizer, int, dict]:
    """Prune (optional) and write the folder in the base's family: (the tokenizer written, the tokens pruned, its
    audit)."""
    published, pruned, published_audit = chosen.tok, 0, chosen.audit
    if config.prune_dead and chosen.dead and chosen.strategy != "base":  # extend: also intermediates (ignore_merges)
        doc, pruned = (
            prune_and_refill(chosen, base, words["extend"])
            if chosen.strategy == "extend"
            else audit.prune(chosen.doc, chosen.first_new_id, chosen.dead)
        )
        published = bpe.from_doc(doc)
        if chosen.strategy == "replace":
            published = family_out.finish(published, family, base.doc if base else None)
        new_ids = {i for i in doc["model"]["vocab"].values() if i >= chosen.first_new_id}
        published_audit, _ = audit.audit(doc, published, words[chosen.strategy], new_ids, validation)
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
    return published, pruned, published_audit
