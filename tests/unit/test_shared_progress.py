"""The one progress helper every stage uses (dilforge_shared.progress): without a TTY, log lines at most every
interval with counts, rate and ETA, a `(done)` line only after a pass long enough to have logged, nothing when
disabled (ranks other than 0); on a TTY, a tqdm bar and no log lines."""

from __future__ import annotations

import io
import logging

import pytest
from dilforge_shared import progress as progress_mod
from dilforge_shared.progress import Progress

LOGGER = "test.progress"


@pytest.fixture
def clock(monkeypatch):
    """The helper's clock returns the next value of `clock.times` (seconds)."""

    class Clock:
        times: list[float] = []

        def __call__(self) -> float:
            return self.times.pop(0)

    c = Clock()
    monkeypatch.setattr(progress_mod, "_clock", c)
    return c


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_without_a_tty_lines_come_at_most_every_interval_with_counts_and_eta(caplog, clock):
    clock.times = [float(t) for t in range(0, 120, 10)]  # start, then one update every 10 s, then close
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = Progress("validation flores", 10, unit="batches", every_s=25, log=logging.getLogger(LOGGER), tty=False)
        for _ in range(10):
            p.update(1)
        p.close()
    assert messages(caplog) == [
        "validation flores: 3/10 batches (30%), 30s elapsed, ETA 70s",
        "validation flores: 6/10 batches (60%), 60s elapsed, ETA 40s",
        "validation flores: 9/10 batches (90%), 90s elapsed, ETA 10s",
        # none at the last batch (100 s): the close says it is done
        "validation flores: 10/10 batches (100%), 110s elapsed, ETA 0s (done)",
    ]


def test_a_resumed_pass_counts_its_rate_from_where_it_resumed_and_appends_postfix(caplog, clock):
    clock.times = [0.0, 10.0, 20.0]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = Progress("cpt", 100, unit="steps", initial=50, every_s=5, log=logging.getLogger(LOGGER), tty=False)
        p.update(1, loss=2.5)  # 51 of 100 after 10 s at 0.1 step/s -> 490 s left
        p.update(1, loss=2.25)
    assert messages(caplog) == [
        "cpt: 51/100 steps (51%), 10s elapsed, ETA 490s loss=2.5",
        "cpt: 52/100 steps (52%), 20s elapsed, ETA 480s loss=2.25",
    ]


def test_an_unknown_total_logs_the_count_and_rate(caplog, clock):
    clock.times = [0.0, 40.0]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = Progress("corpus", unit="lines", log=logging.getLogger(LOGGER), tty=False)
        p.update(2000)
    assert messages(caplog) == ["corpus: 2000 lines, 40s elapsed, 50 lines/s"]


def test_a_short_pass_and_a_disabled_one_log_nothing(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        short = Progress("bpb base/flores", 3, every_s=60, log=logging.getLogger(LOGGER), tty=False)
        short.update(3)
        short.close()
        other_rank = Progress("x", 10, every_s=0, log=logging.getLogger(LOGGER), enabled=False, tty=True)
        assert other_rank.bar is None
        for _ in range(5):
            other_rank.update(1)
        other_rank.write("step=1 loss=2")
        other_rank.close()
    assert messages(caplog) == []


def test_on_a_tty_a_tqdm_bar_draws_and_nothing_is_logged(caplog, monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(progress_mod.sys, "stderr", stderr)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = Progress("measure", 4, unit="candidates", every_s=0, log=logging.getLogger(LOGGER), tty=True)
        p.update(2)
        p.write("a message")
        p.close()
    assert messages(caplog) == []
    drawn = stderr.getvalue()
    assert "measure" in drawn and "2/4" in drawn and "a message" in drawn


def test_a_pass_with_no_update_for_the_interval_logs_a_heartbeat_until_closed(caplog):
    """A CPT step longer than the interval (fp32 on a slow CPU) must not leave the log silent: the heartbeat logs
    the current line marked `(in progress)` once per interval; a closed or finished pass says nothing more."""
    import time

    with caplog.at_level(logging.INFO, logger=LOGGER):
        p = Progress("cpt", 10, unit="steps", every_s=0.3, log=logging.getLogger(LOGGER), tty=False)
        p.update(1, loss=2.5)
        time.sleep(1.1)
        beats = messages(caplog)
        p.close()
        closed = len(messages(caplog))
        done = Progress("bpb", 2, every_s=0.3, log=logging.getLogger(LOGGER), tty=False)
        done.update(2)
        time.sleep(0.8)
    assert 2 <= len(beats) <= 4, beats
    assert all(b.startswith("cpt: 1/10 steps (10%)") and b.endswith("loss=2.5 (in progress)") for b in beats), beats
    assert len(messages(caplog)) == closed  # nothing after the close, nothing for a finished pass
    # closed at 1 of 10 (a stop or an error ended the pass): the last line does not claim it is done
    assert messages(caplog)[-1].startswith("cpt: 1/10 steps") and messages(caplog)[-1].endswith("(stopped)")
