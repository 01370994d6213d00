"""The run lock on an S3 store: a create-only lock object with an owner and a lease the owner renews; an expired
lease, or one whose owner is a process on this host that is gone, is taken over. A local store's run lock is
`dilforge_shared.locks.FileLock`."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from dilforge_shared.locks import owner_info
from dilforge_shared.store import NotFound

log = logging.getLogger(__name__)


def owner_alive(owner: dict | None) -> bool:
    """False for an owner that is a process on this host that is gone, or no owner; True otherwise (another
    host's process cannot be told from here)."""
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


class S3Lease:
    """A create-only lock object with a lease, renewed by a daemon thread while held."""

    def __init__(self, backend, key: str, lease_s: float, poll_s: float = 2.0):
        self.backend, self.key, self.lease_s, self.poll_s = backend, key, lease_s, poll_s
        self.owner = owner_info()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({**self.owner, "expires_at": time.time() + self.lease_s}).encode()

    def _current(self) -> tuple[dict | None, str | None]:
        """The lease object and its version (the ETag on S3), or (None, None) when there is none."""
        try:
            data, version = self.backend.read_versioned(self.key)
        except NotFound:
            return None, None
        try:
            return json.loads(data), version
        except ValueError:
            return {"expires_at": 0}, version

    def acquire(self, wait: bool = True, on_wait=None) -> bool:
        told = False
        while True:
            if self.backend.create_bytes(self.key, self._body()):
                break
            current, version = self._current()
            if current is not None and (current.get("expires_at", 0) < time.time() or not owner_alive(current)):
                # a holder killed on this host (`kill -9`) renews nothing: its lease is over now, not when it expires
                why = "expired" if current.get("expires_at", 0) < time.time() else "held by a process that is gone"
                log.warning("lock %s: lease of %s %s; taking it over", self.key, current, why)
                # one step: only the version judged over is replaced, so of two waiters taking it over one wins
                if self.backend.replace_bytes(self.key, self._body(), version):
                    break
                continue
            if not wait:
                return False
            if not told and on_wait:
                on_wait(current or {})
                told = True
            time.sleep(self.poll_s)
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            current, version = self._current()
            if (
                current is None
                or current.get("token") != self.owner["token"]
                or not self.backend.replace_bytes(self.key, self._body(), version)
            ):
                log.error("lock %s: lost (now %s)", self.key, current)
                return

    def release(self) -> None:
        self._stop.set()
        current, _ = self._current()
        if current is not None and current.get("token") == self.owner["token"]:
            self.backend.delete(self.key)
