"""The tokenizer candidates: every (strategy, size) the stage measures, each strategy trained once at its largest
size and the smaller sizes cut from it (replace: a fresh byte-level BPE; extend: the base's BPE continued over its
own segmentation; base: the base itself)."""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

from dilforge_shared.families import LLAMA3, Family
from tokenizers import Tokenizer

from . import audit, bpe, continued, family_out
from .base import Base
from .config import TokenizerConfig

log = logging.getLogger("dilforge.tokenizer")


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


def base_candidate(base: Base) -> Candidate:
    size = base.tok.get_vocab_size(with_added_tokens=True)
    return Candidate("base", size, base.tok, base.doc, set(), size, base.family or LLAMA3)


def size_given(out: list[Candidate], strategy: str, size: int, got: int, min_frequency: int) -> int | None:
    """The size a candidate asked `size` is recorded (and selectable) as: what the corpus gave, never a size that
    does not exist; None when a smaller candidate in `out` already is that tokenizer."""
    if got >= size:
        return size
    same = any(c.size == got for c in out)
    log.warning(
        "%s: size %d asked, but the corpus gives only %d at min_frequency %d; %s",
        strategy,
        size,
        got,
        min_frequency,
        "dropped (the same tokenizer as a smaller size)" if same else f"measured and recorded as {got}",
    )
    return None if same else got


def replace_candidates(
    config: TokenizerConfig, words: Counter, family: Family, base: Base | None, tty: bool
) -> list[Candidate]:
    """One fresh BPE at the largest size, from the corpus's pre-token counts; smaller sizes are its prefixes."""
    largest = max(config.vocab_sizes)
    log.info("replace: training one BPE at %d tokens (serves sizes %s)", largest, sorted(config.vocab_sizes))
    trained = bpe.train_from_counts(words, largest, config.min_frequency, show_progress=tty)
    trained_doc = bpe.model_of(trained)
    out = []
    for size in sorted(config.vocab_sizes):
        doc = bpe.truncate(trained_doc, size)
        size = size_given(out, "replace", size, len(doc["model"]["vocab"]), config.min_frequency)
        if size is None:
            continue
        new_ids = {i for t, i in doc["model"]["vocab"].items() if len(t) > 1}
        tok = family_out.finish(bpe.from_doc(doc), family, base.doc if base else None)
        out.append(Candidate("replace", size, tok, doc, new_ids, min(new_ids, default=size), family))
    return out


def extend_candidates(config: TokenizerConfig, seg: continued.Segmented, base: Base, tty: bool) -> list[Candidate]:
    """One continued training at the largest number of new tokens; smaller ones are prefixes."""
    largest = max(config.num_new_tokens)
    log.info(
        "extend: continuing the base's BPE by %d new tokens over %d unique words (serves %s)",
        largest,
        len(seg.words),
        sorted(config.num_new_tokens),
    )
    barrier = continued.digit_ids(base.doc) if config.digit_tokens == "as_base" else frozenset()
    learned = continued.learn_merges(seg, largest, config.min_frequency, show_progress=tty, barrier=barrier)
    first = max([*base.doc["model"]["vocab"].values(), *(t["id"] for t in base.doc.get("added_tokens", []))]) + 1
    out = []
    for size in sorted(config.num_new_tokens):
        doc, added = continued.extend_doc(base.doc, learned, size)
        size = size_given(out, "extend", size, added, config.min_frequency)
        if size is None:
            continue
        new_ids = set(range(first, first + added))
        out.append(Candidate("extend", size, bpe.from_doc(doc), doc, new_ids, first, base.family, learned=learned))
    return out


def prune_and_refill(cand: Candidate, base: Base, words: Counter, rounds: int = 6) -> tuple[dict, int]:
    """extend + prune_dead: drop the dead new tokens and take further merges in their place, so the published
    tokenizer has up to `size` new tokens that are (nearly) all produced on the corpus.

    Dead tokens go, with intermediates only they need and produced tokens whose uses per row fall below a refill
    row's (`audit.costly_tokens`); further merges fill the places plus a margin, and an overshoot drops the newest.
    Returns (doc, number of new tokens dropped before refilling)."""
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
