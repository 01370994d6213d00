"""The corpus pass counts pre-tokens, not lines: forked workers give the single-process counts, training from the
counts gives the tokenizer training on the text gives, and the memory budget drops the rarest by a stated rule."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from dilforge_tokenizer import bpe, llama3, pretokens
from dilforge_tokenizer.config import CorpusSource
from dilforge_tokenizer.stream import CorpusStream
from factories import bpe_from_text

LINES = [f"söz{i % 97} kitab{i % 13}lar, {i % 7} Bakı şəhəri {'ə' * (i % 5)}x" for i in range(3000)]


def corpus(tmp_path, lines=LINES, **kwargs) -> CorpusStream:
    path = tmp_path / "a.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return CorpusStream([CorpusSource(uri=str(path), weight=2)], validation_fraction=0.05, progress=False, **kwargs)


def test_forked_workers_count_what_one_process_counts_and_what_the_lines_hold(tmp_path):
    tok = llama3.empty_bpe()
    one = corpus(tmp_path)
    counted = pretokens.count(one, {"llama3": tok}, max_words=10**6, num_workers=1).words["llama3"]
    two = corpus(tmp_path)
    assert pretokens.count(two, {"llama3": tok}, max_words=10**6, num_workers=2).words["llama3"] == counted
    trained_lines = Counter(line for line in LINES if line not in set(one.heldout))
    expected = pretokens.of_lines({line: 2 * n for line, n in trained_lines.items()}, tok)  # weight 2
    assert counted == expected and counted["ĠBak" + "Ä±"] == 2 * sum(trained_lines.values())


@pytest.mark.timeout(60)
def test_a_worker_that_dies_raises_instead_of_leaving_the_count_waiting(tmp_path, monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    monkeypatch.setattr(pretokens, "_count_batch", lambda *_: os._exit(3))  # inherited by the forked workers
    with pytest.raises(BrokenProcessPool):
        pretokens.count(corpus(tmp_path), {"x": llama3.empty_bpe()}, max_words=10**6, num_workers=2)
    assert pretokens._PIPES is None


def test_training_from_the_counts_gives_the_tokenizer_training_on_the_text_gives():
    lines = [line for line in LINES for _ in range(2)]
    from_text = bpe.model_of(bpe_from_text([lines], 900, 2))
    from_counts = bpe.model_of(bpe.train_from_counts(pretokens.of_lines(Counter(lines), llama3.empty_bpe()), 900, 2))
    assert from_counts == from_text and len(from_text["model"]["merges"]) > 100


def test_the_budget_drops_the_rarest_pre_tokens_and_says_so(tmp_path):
    def letters(i: int) -> str:
        return "".join("abcdefghij"[int(d)] for d in str(i))

    common = ["kitab", "ev", "şəhər", "dil", "söz"]
    lines = [f"{common[i % 5]} q{letters(i)}" for i in range(4000)]  # 5 frequent words, 4,000 seen once each
    result = pretokens.count(corpus(tmp_path, lines), {"x": llama3.empty_bpe()}, max_words=1000, num_workers=1)
    words = result.words["x"]
    assert len(words) <= 1000
    assert all(words[bpe_word] > 100 for bpe_word in pretokens.of_lines(dict.fromkeys(common, 1), llama3.empty_bpe()))
    assert result.pruned["x"]["threshold"] == 2 and result.pruned["x"]["dropped"] > 3000  # weight 2: seen twice
    assert result.summary()["x"]["distinct"] == len(words)
    unbounded = pretokens.count(corpus(tmp_path, lines), {"x": llama3.empty_bpe()}, max_words=10**6, num_workers=1)
    assert "x" not in unbounded.pruned and len(unbounded.words["x"]) > 3000


@pytest.mark.timeout(60)
def test_a_counting_process_killed_by_sigkill_leaves_no_worker_behind(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    import psutil

    path = tmp_path / "a.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    script = f"""
import time
from dilforge_tokenizer.config import CorpusSource
from dilforge_tokenizer import llama3, pretokens
from dilforge_tokenizer.stream import CorpusStream
pretokens._count_batch = lambda *_: time.sleep(600)  # workers busy when the counting process is killed
stream = CorpusStream([CorpusSource(uri={str(path)!r})], progress=False)
pretokens.count(stream, {{"x": llama3.empty_bpe()}}, max_words=10**6, num_workers=2)
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 30
    while len(parent.children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = parent.children()
    assert len(workers) >= 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.pid for p in alive]


def test_repetitions_are_fed_in_small_strings_holding_every_occurrence():
    """A frequent pre-token is split over many strings (the trainer holds 16 bytes per byte of each string)."""
    items = [("Ġvə", 100_000), ("Ġkitab", 3), ("x", 0)]
    pieces = list(bpe.repeated(items, batch_chars=1000))
    assert max(len(p) for p in pieces) <= 1000 and len(pieces) > 300
    assert Counter(" ".join(pieces).split()) == Counter({"Ġvə": 100_000, "Ġkitab": 3})
