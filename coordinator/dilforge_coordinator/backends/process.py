"""Run a stage process the coordinator owns: stdin /dev/null (no prompt can block), its own session (Ctrl-C
reaches the coordinator, which forwards SIGTERM, then SIGKILL), and it dies with the coordinator (no orphan)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import threading
from collections.abc import Sequence

from dilforge_shared.processes import die_with_parent


def run_child(cmd: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = ()) -> tuple[int, int | None]:
    """Run to completion; returns (exit code, the first signal that asked us to stop, or None)."""
    proc = subprocess.Popen(
        list(cmd),
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),  # noqa: PLW1509 - prctl only
    )
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        while True:
            try:
                returncode = proc.wait()
                break
            except KeyboardInterrupt:  # a SIGINT that raced the handler install
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return returncode, (received[0] if received else None)
