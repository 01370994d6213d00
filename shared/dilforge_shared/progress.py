"""Progress of the passes that take minutes: a tqdm bar on a terminal; elsewhere a log line at most every `every_s`
seconds with count, rate and ETA, a heartbeat line when an update is late, `(done)` or `(stopped)` at the end."""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Any

_log = logging.getLogger("dilforge.progress")
_clock = time.monotonic  # module-level so a test can drive it without patching time.monotonic for every thread


class Progress:
    """A pass over `total` units (None: unknown); rate and ETA count from `initial`, not a resume's start."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        *,
        unit: str = "it",
        initial: int = 0,
        every_s: float = 25.0,  # with the heartbeat's polling, a job log is never silent for 30 s
        log: logging.Logger | None = None,
        enabled: bool = True,
        tty: bool | None = None,
    ):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.n = self.initial = initial
        self.log = log or _log
        self.enabled = enabled
        self.logged = False
        self.start = self.last = _clock()
        self.bar = None
        self.postfix: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._logged_at = time.monotonic()  # real time of the last line, for the heartbeat
        self._stop = threading.Event()
        if enabled and (sys.stderr.isatty() if tty is None else tty):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False
            )
        elif enabled and every_s > 0:
            # The thread holds only a weak reference: a pass that is never closed stops beating once collected.
            threading.Thread(
                target=_heartbeat, args=(weakref.ref(self), self._stop, every_s), name=f"progress {desc}", daemon=True
            ).start()
            weakref.finalize(self, self._stop.set)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: fmt_value(v) for k, v in postfix.items()}, refresh=False)
            return
        self.postfix = postfix
        now = _clock()
        if now - self.last >= self.every_s and (self.total is None or self.n < self.total):
            self._emit(now, self.line(now, postfix))

    def batches(self, done: int, total: int) -> None:
        """`done` of `total` batches: the `on_batch` callback of `dilforge_shared.bpb`'s passes."""
        if self.total != total:
            self.total = total
            if self.bar is not None:
                self.bar.total = total
                self.bar.refresh()
        self.update(done - self.n)

    def _emit(self, now: float, text: str) -> None:
        with self._lock:
            self.last, self._logged_at, self.logged = now, time.monotonic(), True
            self.log.info("%s", text)

    def beat(self) -> None:
        """The heartbeat's line, when no line came for `every_s` of real time and the pass is not finished."""
        if time.monotonic() - self._logged_at >= self.every_s and (self.total is None or self.n < self.total):
            now = _clock()
            self._emit(now, f"{self.line(now, self.postfix)} (in progress)")

    def line(self, now: float, postfix: dict | None = None) -> str:
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        extra = "".join(f" {k}={fmt_value(v)}" for k, v in (postfix or {}).items())
        if self.total:
            eta = f"ETA {max(0.0, (self.total - self.n) / rate):.0f}s" if rate > 0 else "ETA ?"
            return (
                f"{self.desc}: {self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%), "
                f"{elapsed:.0f}s elapsed, {eta}{extra}"
            )
        return f"{self.desc}: {self.n} {self.unit}, {elapsed:.0f}s elapsed, {rate:.3g} {self.unit}/s{extra}"

    def write(self, text: str) -> None:
        """A message that does not break the bar (tqdm.write on a TTY, a log line otherwise)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            with self._lock:
                self._logged_at = time.monotonic()
                self.log.info("%s", text)

    def close(self) -> None:
        """Closes the bar, or ends a pass that logged a line with `(done)`, or `(stopped)` short of its total."""
        self._stop.set()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self.logged:
            self.logged = False
            end = "done" if self.total is None or self.n >= self.total else "stopped"
            self.log.info("%s (%s)", self.line(_clock()), end)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _heartbeat(ref: weakref.ref, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(min(every_s / 5, 1.0)):
        progress = ref()
        if progress is None:
            return
        progress.beat()
        del progress


def fmt_value(v: Any) -> str:
    """A metric as progress lines and rows show it: floats to 6 significant digits."""
    return f"{v:.6g}" if isinstance(v, float) else str(v)
