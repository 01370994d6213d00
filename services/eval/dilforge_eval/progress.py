"""Progress with an ETA for the passes that take minutes on CPU (BPB per model and set, generation).

On a terminal: a tqdm bar. Without one (SageMaker, compose, a CI log): a log line at most every
`log_every_s` seconds with the same counts and ETA, so logs stay readable and a stuck pass is visible.
The BPB pass is counted by a forward hook on the model's decoder (one call per batch of windows), so it
does not depend on how the BPB code loops.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

log = logging.getLogger("dilforge.eval")


class LogProgress:
    """tqdm's update/close interface, written as periodic log lines (for non-TTY output)."""

    def __init__(self, total: int | None, desc: str, unit: str, log_every_s: float):
        self.total, self.desc, self.unit, self.every = total, desc, unit, log_every_s
        self.n = 0
        self.start = self.last = time.monotonic()
        self.logged = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.logged = True
            log.info("%s", self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        if self.total and rate > 0:
            eta = max(0.0, (self.total - self.n) / rate)
            return (
                f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%), "
                f"{elapsed:.0f}s elapsed, ETA {eta:.0f}s"
            )
        return f"{self.desc}: {self.n} {self.unit}, {elapsed:.0f}s elapsed"

    def close(self) -> None:
        """A final line only for passes long enough to have logged one (short ones stay quiet)."""
        if self.logged:
            log.info("%s (done)", self.line(time.monotonic()))


def bar(total: int | None, desc: str, unit: str = "it", log_every_s: float = 30.0, tty: bool | None = None):
    """A tqdm bar on a TTY (stderr), else a LogProgress; both have update(n) and close()."""
    if tty is None:
        tty = sys.stderr.isatty()
    if tty:
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
    return LogProgress(total, desc, unit, log_every_s)


def num_bpb_batches(num_tokens: int, window: int, stride: int, batch_size: int) -> int:
    """Forward passes of a sliding-window BPB pass over num_tokens (+ BOS): an estimate for the ETA only."""
    stride = max(1, min(stride, window - 1))
    windows = 1 + max(0, math.ceil((num_tokens + 1 - window) / stride))
    return math.ceil(windows / batch_size)


@contextmanager
def forward_progress(model, total: int | None, desc: str, **kwargs) -> Iterator[object]:
    """Ticks a bar once per forward of the model's decoder (or of the model when it has none)."""
    module = model.get_decoder() if hasattr(model, "get_decoder") else model
    progress = bar(total, desc, unit="batch", **kwargs)
    handle = module.register_forward_hook(lambda *_: progress.update(1))
    try:
        yield progress
    finally:
        handle.remove()
        progress.close()
