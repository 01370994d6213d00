"""Pre-token counts: the corpus as BPE sees it, in memory bounded by its distinct pre-tokens.

One pass: forked workers pre-tokenise line batches under each needed pre-tokenizer; counts are added in batch
order, so they do not depend on the worker count. Over `max_words` the rarest are dropped (fastText's rule)."""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from dilforge_shared.workers import available_cpus, die_with_parent
from tokenizers import Tokenizer

from .stream import CorpusStream

log = logging.getLogger("dilforge.tokenizer")


@dataclass
class PretokenCounts:
    """Pre-token -> times fed, per pre-tokenizer name; what the budget dropped."""

    words: dict[str, Counter]
    pruned: dict[str, dict] = field(default_factory=dict)  # name -> {"threshold": t, "dropped": n}

    def summary(self) -> dict:
        return {
            name: {"distinct": len(c), "total": sum(c.values()), **self.pruned.get(name, {})}
            for name, c in self.words.items()
        }


def count(
    stream: CorpusStream,
    tokenizers: dict[str, Tokenizer],
    max_words: int,
    num_workers: int | None = None,
) -> PretokenCounts:
    """Stream the corpus once and count its pre-tokens under each tokenizer's normalizer and pre-tokenizer.
    `num_workers`: None = the CPUs this process may use; 1 counts in this process."""
    pipes = {name: (tok.normalizer, tok.pre_tokenizer) for name, tok in tokenizers.items()}
    words = {name: Counter() for name in pipes}
    result = PretokenCounts(words)
    workers = num_workers or available_cpus()
    if workers <= 1:
        for batch in stream.batches():
            _add(result, _count_batch(Counter(batch), pipes), max_words)
    else:
        global _PIPES  # noqa: PLW0603 - inherited by the forked workers, never pickled
        _PIPES = pipes
        batches = None
        try:
            # a dead worker raises BrokenProcessPool (a Pool's map would wait forever); at most 2 batches a worker
            # in flight, so memory stays bounded
            with ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("fork"),
                initializer=die_with_parent,  # a stage killed even by -9 leaves no worker behind
                initargs=(os.getpid(),),
            ) as pool:
                pool.submit(int).result()  # forks every worker now, before the stream's read-ahead thread starts
                batches = stream.batches()
                pending: deque = deque()
                for batch in batches:
                    pending.append(pool.submit(_count_in_worker, batch))
                    if len(pending) >= 2 * workers:
                        _add(result, pending.popleft().result(), max_words)
                while pending:
                    _add(result, pending.popleft().result(), max_words)
        finally:
            _PIPES = None
            if batches is not None:
                batches.close()
    # word lists: kept as counts by the stream (never expanded into lines)
    _add(result, _count_batch(stream.fed_words, pipes), max_words)
    return result


_PIPES: dict | None = None


def of_lines(lines: Mapping[str, int], tok: Tokenizer) -> Counter:
    """The pre-token counts of `lines` (line -> times fed) under `tok`'s normalizer and pre-tokenizer."""
    return _count_batch(lines, {"_": (tok.normalizer, tok.pre_tokenizer)})["_"]


def _count_in_worker(batch: list[str]) -> dict[str, Counter]:
    return _count_batch(Counter(batch), _PIPES)


def _count_batch(lines: Mapping[str, int], pipes: dict) -> dict[str, Counter]:
    """Each unique line's pre-tokens under every (normalizer, pre-tokenizer), times the line's count."""
    items = list(lines.items())
    out = {}
    for name, (normalizer, pre) in pipes.items():
        counts: Counter = Counter()
        for line, n in items:
            text = normalizer.normalize_str(line) if normalizer is not None else line
            for word, _ in pre.pre_tokenize_str(text):
                counts[word] += n
        out[name] = counts
    return out


def _add(result: PretokenCounts, part: dict[str, Counter], max_words: int) -> None:
    for name, counts in part.items():
        total = result.words[name]
        total.update(counts)
        if len(total) > max_words:
            _prune(total, max_words, result.pruned.setdefault(name, {"threshold": 0, "dropped": 0}))


def _prune(counts: Counter, max_words: int, record: dict) -> None:
    """Drop every pre-token seen at most t times, t growing from the last threshold, until at most half the
    budget remains."""
    before = len(counts)
    t = 0
    while len(counts) > max_words // 2:
        t += 1
        for word in [w for w, n in counts.items() if n <= t]:
            del counts[word]
    record["threshold"] = max(t, record["threshold"])
    record["dropped"] += before - len(counts)
    log.warning(
        "pre-token budget (max_pretokens %d) reached: dropped the %d pre-tokens seen at most %d times",
        max_words,
        before - len(counts),
        t,
    )
