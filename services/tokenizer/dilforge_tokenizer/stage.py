"""The tokenizer stage, top to bottom.

parse (config, base tokenizer from `base_tokenizer` or the upstream `model` artifact, its family,
validation sets) → read the corpora once (held-out slice on the way) → train each strategy once at its
largest size (replace: a fresh byte-level BPE; extend: continued BPE over the base's own segmentation)
→ cut every smaller size from it → measure every (strategy, size) on every set and audit its dead
tokens → pick the published size by the config's rule (with the retain bound) → optionally prune dead
tokens → write the tokenizer folder (in the base's family), metrics.json, sweep.md and comparison.md.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dilforge_shared.configs.tokenizer import TokenizerConfig
from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import ConfigError, DilforgeError, InputError
from dilforge_shared.families import LLAMA3, Family, detect_family
from dilforge_shared.models import choose, resolve
from dilforge_shared.progress import track
from tokenizers import Tokenizer

from . import audit, bpe, continued, family_out
from . import base as base_tok
from .report import comparison_table, language_figures, measure_sets, select, sweep_table
from .stream import CorpusStream

log = logging.getLogger("dilforge.tokenizer")

HELDOUT = "heldout"


@dataclass
class Base:
    """The base tokenizer, wherever it came from, and its family (None when unknown)."""

    folder: Path
    uri: str
    tok: Tokenizer
    doc: dict
    family: Family | None
    family_error: InputError | None = None


@dataclass
class Candidate:
    """One (strategy, size): its tokenizer, regular-vocab doc (for the audit), and which ids are new."""

    strategy: str
    size: int
    tok: Tokenizer
    doc: dict
    new_ids: set[int]
    first_new_id: int
    family: Family
    sets: dict = field(default_factory=dict)
    audit: dict = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    learned: list | None = None  # extend: the whole continued merge list (for prune-and-refill)


def resolve_base(config: TokenizerConfig, ctx: StageContext) -> Base | None:
    """The base by the shared precedence rule (`models.choose`): `base_tokenizer` when set, else the upstream
    `model` artifact's tokenizer, else None. Lineage: an input is recorded as upstream, base_tokenizer by the
    ref the coordinator fingerprinted (shared identity.config_refs), so no extra refs here."""
    choice = choose("base_tokenizer", config.base_tokenizer, ctx.request.inputs, order=("model",))
    if choice is None:
        return None
    uri = choice.uri
    source = ctx.input(choice.input) if choice.input else uri
    try:
        folder = resolve(source, "tokenizer", endpoint_url=ctx.endpoint_url, cache_dir=ctx.checkpoint_dir / "base").path
    except ConfigError as exc:
        raise InputError(f"{choice.field}: {str(exc).removeprefix(f'{uri}: ')}", path=uri) from None
    if folder.is_file():
        raise InputError(f"{choice.field}: a folder (or artifact) with tokenizer.json is needed, not a file", path=uri)
    tok, doc = base_tok.load(folder, uri)
    try:
        family, error = detect_family(base_tok.vocab_tokens(doc), uri), None
    except InputError as exc:
        family, error = None, exc
    return Base(folder=folder, uri=uri, tok=tok, doc=doc, family=family, family_error=error)


def check_base(config: TokenizerConfig, base: Base | None) -> None:
    """Refuse, before reading any corpus, a strategy that needs a base it cannot use."""
    for strategy in config.strategies:
        if strategy in ("base", "extend") and base is None:
            raise ConfigError(
                f"tokenizer.base_tokenizer: strategy {strategy!r} needs a base tokenizer: set "
                "base_tokenizer or run a model stage upstream (input 'model')"
            )
    if "extend" in config.strategies:
        base_tok.check_extendable(base.doc, f"{base.uri.rstrip('/')}/tokenizer.json")
        if base.family is None:
            raise base.family_error


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


def expanded(lines: Counter, batch: int = 4096) -> Iterator[list[str]]:
    """The training lines, each as often as it was fed (weights), in lists for the trainer."""
    out: list[str] = []
    for line, n in lines.items():
        out.extend([line] * n)
        if len(out) >= batch:
            yield out
            out = []
    if out:
        yield out


def verify_output(out: Path, tok: Tokenizer | None) -> dict:
    """Check what is about to be published: the tokenizer round-trips text and the special-token roles
    named in tokenizer_config.json exist. `tok` is the tokenizer just saved (reloading a 50k-vocab
    file costs ~0.2 s; the tests load every strategy's output with both libraries instead)."""
    sample = "Azərbaycan dili türk dillərinin oğuz qrupuna daxildir. Hello world!"
    config_file = out / "tokenizer_config.json"
    try:
        raw = tok or Tokenizer.from_file(str(out / "tokenizer.json"))
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise DilforgeError(f"output tokenizer in {out} does not load: {exc}") from None
    ids = raw.encode(sample, add_special_tokens=False).ids
    if raw.decode(ids) != sample:
        raise DilforgeError(f"output tokenizer in {out} does not round-trip text")
    roles = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token")}
    for role, token in roles.items():
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and raw.token_to_id(content) is None:
            raise DilforgeError(f"{config_file}: {role} {content!r} is not in the vocabulary")
    return {
        "vocab_size_total": raw.get_vocab_size(with_added_tokens=True),
        **roles,
        "has_chat_template": (out / "chat_template.jinja").exists() or "chat_template" in config,
    }


def base_candidate(base: Base) -> Candidate:
    size = base.tok.get_vocab_size(with_added_tokens=True)
    return Candidate("base", size, base.tok, base.doc, set(), size, base.family or LLAMA3)


def counted(stream: CorpusStream, lines: Counter) -> Iterator[list[str]]:
    """The stream's batches, each also counted into `lines` (for the audit) as the trainer pulls it; then the
    word lists' words (read last, kept as counts by the stream), each as often as it was fed."""
    for batch in stream.batches():
        lines.update(batch)
        yield batch
    lines.update(stream.fed_words)
    yield from expanded(stream.fed_words)


def replace_candidates(
    config: TokenizerConfig, batches: Iterator[list[str]], family: Family, base: Base | None, tty: bool
) -> tuple[list[Candidate], dict]:
    """One fresh BPE at the largest size; smaller sizes are its prefixes. Also returns its doc."""
    largest = max(config.vocab_sizes)
    log.info("replace: training one BPE at %d tokens (serves sizes %s)", largest, sorted(config.vocab_sizes))
    trained = bpe.train(batches, largest, config.min_frequency, show_progress=tty)
    trained_doc = bpe.model_of(trained)
    out = []
    for size in sorted(config.vocab_sizes):
        doc = bpe.truncate(trained_doc, size)
        produced = len(doc["model"]["vocab"])
        if produced < size:  # the corpus ran out of merges: never report (or select) a size that does not exist
            if any(c.size == produced for c in out):
                log.warning(
                    "replace: vocab size %d asked, but the corpus gives only %d tokens at min_frequency %d; "
                    "dropped (same tokenizer as size %d)",
                    size,
                    produced,
                    config.min_frequency,
                    produced,
                )
                continue
            log.warning(
                "replace: vocab size %d asked, but the corpus gives only %d tokens at min_frequency %d; "
                "measured and recorded as %d",
                size,
                produced,
                config.min_frequency,
                produced,
            )
            size = produced
        new_ids = {i for t, i in doc["model"]["vocab"].items() if len(t) > 1}
        tok = family_out.finish(bpe.from_doc(doc), family, base.doc if base else None)
        out.append(Candidate("replace", size, tok, doc, new_ids, min(new_ids, default=size), family))
    return out, trained_doc


def extend_candidates(config: TokenizerConfig, seg: continued.Segmented, base: Base, tty: bool) -> list[Candidate]:
    """One continued training at the largest number of new tokens; smaller ones are prefixes."""
    largest = max(config.num_new_tokens)
    log.info(
        "extend: continuing the base's BPE by %d new tokens over %d unique words (serves %s)",
        largest,
        len(seg.words),
        sorted(config.num_new_tokens),
    )
    learned = continued.learn_merges(seg, largest, config.min_frequency, show_progress=tty)
    out = []
    for size in sorted(config.num_new_tokens):
        doc, added = continued.extend_doc(base.doc, learned, size)
        if added < size:  # recorded (and selectable) as what exists, never as the size asked for
            if any(c.size == added for c in out):
                log.warning(
                    "extend: the corpus supports only %d new tokens at min_frequency %d (asked %d); dropped "
                    "(same tokenizer as %d new tokens)",
                    added,
                    config.min_frequency,
                    size,
                    added,
                )
                continue
            log.warning(
                "extend: the corpus supports only %d new tokens at min_frequency %d (asked %d); recorded as %d",
                added,
                config.min_frequency,
                size,
                added,
            )
            size = added
        first = max(base.doc["model"]["vocab"].values()) + 1
        first = max([first, *(t["id"] + 1 for t in base.doc.get("added_tokens", []))])
        new_ids = set(range(first, first + added))
        out.append(Candidate("extend", size, bpe.from_doc(doc), doc, new_ids, first, base.family, learned=learned))
    return out


def prune_and_refill(cand: Candidate, base: Base, words: Counter, rounds: int = 6) -> tuple[dict, int]:
    """extend + prune_dead: drop the dead new tokens and take further merges in their place, so the
    published tokenizer has up to `size` new tokens that are all (or nearly all) produced on the corpus.

    1. Dead new tokens go. With `ignore_merges` a token the corpus only produces as a whole word keeps no
       chain of intermediate tokens (`audit.corpus_use`), so those intermediates go too. What stays dead
       are intermediates that produced tokens are built from: a produced token that alone holds k of them
       costs 1 + k rows, and when its uses per row fall below what a refill row buys (the median uses of
       the newest `size / 50` tokens) it goes too, with its dead parts (`audit.costly_tokens`).
    2. Refill: further learned merges (never the dropped tokens) take the free places, plus a margin of
       the dead share seen so far (they die at about that rate too); on an overshoot the newest tokens
       beyond `size` are dropped (a token's parts are always older than it, so nothing kept loses its
       chain). Usually one round.
    A round encodes the corpus words once (not the full audit: the published tokenizer is audited afterwards).
    Returns (doc, number of new tokens dropped from the candidate before refilling)."""
    first, size = cand.first_new_id, cand.size
    num_fixed = len(base.doc["model"]["merges"])  # the base's merges: never touched by pruning

    def pruned(doc: dict, drop: set[int] = frozenset()) -> dict:
        """`doc` without its dead new tokens (and `drop`), after one encode of the corpus words."""
        counts, parts_needed = audit.corpus_use(doc, words, first)
        dead = {i for i in doc["model"]["vocab"].values() if i >= first and i not in counts}
        return audit.prune(doc, first, dead | drop, parts_needed, num_fixed)[0]

    def num_live(doc: dict) -> int:
        return len(doc["model"]["vocab"]) - first

    counts, parts_needed = audit.corpus_use(cand.doc, words, first)
    vocab = cand.doc["model"]["vocab"]
    newest = sorted(i for i in vocab.values() if i >= first)[-max(1, size // 50) :]
    price = statistics.median(counts.get(i, 0) for i in newest)
    costly = audit.costly_tokens(cand.doc, first, counts, price, parts_needed, num_fixed)
    dead = {i for i in vocab.values() if i >= first and i not in counts}
    best = audit.prune(cand.doc, first, dead | costly, parts_needed, num_fixed)[0]
    num_pruned = num_live(cand.doc) - num_live(best)
    if costly:
        log.info(
            "prune_dead: %d produced tokens were the only ones built from dead intermediates and had fewer "
            "uses per row than %.1f (the newest tokens' median): dropped with those intermediates",
            len(costly),
            price,
        )
    exclude = {t for t, i in vocab.items() if i in costly}
    take = size
    for _ in range(rounds):
        live = num_live(best)
        if live >= size or cand.learned is None:
            break
        take += math.ceil((size - live) * take / max(1, live))
        doc, added = continued.extend_doc(base.doc, cand.learned, take, exclude)
        best = pruned(doc)
        if num_live(best) > size:
            newest_ids = {i for i in best["model"]["vocab"].values() if i >= first + size}
            best = pruned(best, newest_ids)
            break
        if added < take:  # the learned merge list is exhausted
            break
    return best, num_pruned


def run(config: TokenizerConfig, ctx: StageContext) -> StageResult:
    t_start = time.perf_counter()
    tty = sys.stderr.isatty()
    log_config(
        config,
        {
            "strategies": config.strategies,
            "replace_train_size": max(config.vocab_sizes),
            "extend_num_new_tokens": max(config.num_new_tokens),
        },
    )
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
    lines: Counter = Counter()
    # replace alone streams the corpus straight into its trainer (reading overlaps training), counting
    # the lines on the way for the audit; extend needs every word count before it trains: read first
    stream_into_replace = config.strategies == ["replace"] or set(config.strategies) == {"replace", "base"}
    if config.corpora and not stream_into_replace:
        lines = stream.line_counts()

    # train: each strategy once, at its largest size
    t_train = time.perf_counter()
    seconds: dict[str, float] = {}
    words: dict[str, Counter] = {}  # unique training words per pre-tokenizer, for extend and the audit
    if "extend" in config.strategies:  # the other strategies' audits encode whole lines instead
        words["base"] = continued.word_counts(lines.items(), base.tok)
        seconds["pre_tokenize"] = round(time.perf_counter() - t_train, 2)
    candidates: list[Candidate] = []
    if base is not None and "base" in config.strategies:
        candidates.append(base_candidate(base))
    if "extend" in config.strategies:
        t0 = time.perf_counter()
        seg = continued.segment(words["base"], base.doc)
        candidates += extend_candidates(config, seg, base, tty)
        seconds["train_extend"] = round(time.perf_counter() - t0, 2)  # + pre_tokenize
    if "replace" in config.strategies:
        t0 = time.perf_counter()
        batches = counted(stream, lines) if stream_into_replace else expanded(lines)
        replaced, trained_doc = replace_candidates(config, batches, family, base, tty)
        candidates += replaced
        seconds["train_replace"] = round(time.perf_counter() - t0, 2)
        same = (
            base is not None
            and base.doc.get("pre_tokenizer") == trained_doc.get("pre_tokenizer")
            and base.doc.get("normalizer") is None
        )
        if same and "base" in words:
            words["replace"] = words["base"]
    seconds["train"] = round(time.perf_counter() - t_train, 2)
    log.info("corpus: %s", json.dumps(stream.summary()["total"]))
    if config.strategy != "base" and not lines:
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

    # measure and audit every (strategy, size)
    t_metrics = time.perf_counter()
    unique_lines = list(lines)
    base_metrics = measure_sets(base.tok, sets) if base is not None else None
    for cand in track(candidates, "measure", unit="candidates", log=log):
        cand.sets = base_metrics if cand.strategy == "base" else measure_sets(cand.tok, sets)
        corpus_words = words.get("replace" if cand.strategy == "replace" else "base")
        cand.audit, cand.dead = audit.audit(
            cand.doc,
            cand.tok,
            corpus_words,
            cand.new_ids,
            validation,
            lines=unique_lines if corpus_words is None else None,
        )
    rows = [
        {
            "vocab_size": c.size,
            "vocab_size_total": bpe.vocab_size_with_specials(c.tok),
            **(
                {"vocab_size_regular": c.tok.get_vocab_size(with_added_tokens=False)}
                if c.strategy == "replace"
                else {"num_added_tokens": len(c.new_ids)}
            ),
            "sets": c.sets,
        }
        for c in candidates
        if c.strategy == config.strategy and c.strategy != "base"
    ]
    if config.strategy == "base":
        chosen, retain_met = next(c for c in candidates if c.strategy == "base"), True
        selected = None
    else:
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
        chosen = next(c for c in candidates if c.strategy == config.strategy and c.size == selected)
        if not retain_met:
            log.warning(
                "no size keeps %s within %.1f %% of the base; publishing the closest (%d)",
                config.retain_set,
                100 * config.retain_tolerance,
                selected,
            )

    # publish: prune (optional), write in the base's family, verify
    names = list(validation)
    published, pruned, published_audit = chosen.tok, 0, chosen.audit
    if config.prune_dead and chosen.dead and chosen.strategy != "base":  # extend: also intermediates (ignore_merges)
        doc, pruned = (
            prune_and_refill(chosen, base, words["base"])
            if chosen.strategy == "extend"
            else audit.prune(chosen.doc, chosen.first_new_id, chosen.dead)
        )
        published = bpe.from_doc(doc)
        if chosen.strategy == "replace":
            published = family_out.finish(published, family, base.doc if base else None)
        new_ids = {i for i in doc["model"]["vocab"].values() if i >= chosen.first_new_id}
        corpus_words = words.get("replace" if chosen.strategy == "replace" else "base")
        published_audit, _ = audit.audit(
            doc, published, corpus_words, new_ids, validation, lines=unique_lines if corpus_words is None else None
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
        base_tok.copy_folder(base.folder, ctx.model_dir)
    else:
        family_out.write_folder(published, ctx.model_dir, chosen.family)
    output = verify_output(ctx.model_dir, published)
    published_sets = chosen.sets if published is chosen.tok else measure_sets(published, sets)
    comparison = [
        {
            "strategy": c.strategy,
            "vocab_size": bpe.vocab_size_with_specials(c.tok),
            "num_new_tokens": len(c.new_ids),
            "selected": c is chosen,
            "languages": language_figures(c.sets, names),
            "dead_new_tokens_frac": c.audit["dead_new_tokens_frac"],
        }
        for c in candidates
    ]
    seconds["measure_and_save"] = round(time.perf_counter() - t_metrics, 2)
    seconds["total"] = round(time.perf_counter() - t_start, 2)

    metrics = {
        "strategy": config.strategy,
        "family": chosen.family.name,
        "selected_vocab_size": selected,
        "selection": {
            "rule": config.selection,
            "tolerance": config.selection_tolerance,
            "set": config.selection_set,
            "retain_set": config.retain_set,
            "retain_tolerance": config.retain_tolerance,
            "retain_met": retain_met,
        },
        "word_definition": "whitespace-separated (str.split); tokens without BOS/EOS; fertility = sum tokens / sum words",
        "comparison": comparison,
        "languages": language_figures(published_sets, names),
        "dead_tokens": {**published_audit, "num_pruned": pruned},
        "sweep": rows,
        "base": {"uri": base.uri, "sets": base_metrics} if base_metrics is not None else None,
        "output": output,
        "corpus": stream.summary(),
        "seconds": seconds,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    table = sweep_table(rows, base_metrics, selected)
    compared = comparison_table(comparison)
    log.info("sweep (selected %s):\n%s\ncomparison:\n%s", selected, table, compared)
    (ctx.model_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (ctx.model_dir / "sweep.md").write_text(table)
    (ctx.model_dir / "comparison.md").write_text(compared)
    return StageResult(metrics=metrics)
