"""Progress of long passes: without a TTY, periodic log lines with an ETA; nothing on other ranks."""

from __future__ import annotations

import logging


def test_progress_without_tty_logs_eta_lines_at_most_every_interval(caplog, monkeypatch):
    from dilforge_cpt import reporting
    from dilforge_cpt.runtime import Runtime

    clock = iter(float(t) for t in range(0, 1000, 10))  # each call 10 s later
    monkeypatch.setattr(reporting.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(reporting.sys.stderr, "isatty", lambda: False, raising=False)
    with caplog.at_level(logging.INFO, logger="dilforge.cpt"):
        progress = reporting.Progress("validation flores", 10, Runtime(), every_s=25)
        for _ in range(10):
            progress.update(1)
        progress.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation flores")]
    assert len(lines) == 3, lines  # at 30, 60, 90 s; none after the last batch
    assert lines[0] == "validation flores: 3/10 batches (30%), 30 s elapsed, ETA 70 s"
    other = reporting.Progress("x", 10, Runtime(rank=1, world=2), every_s=0)
    other.update(5)
    assert other.done == 0
