"""Local locks: an `fcntl.flock`, dropped by the kernel when its last holder exits, so a crash never leaves a stale
lock. It guards one producer per artifact and one process per work folder (`FileLock`), and marks staging folders
as owned: `.dilforge-<kind>-<pid>-<uuid>`, whose creator holds the flock on its `.owner` file while it lives, so a
later run or `coordinator gc` removes only such folders whose owner is gone, never a user's folder."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self


def owner_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex}


class FileLock:
    """Exclusive flock on `path`; `acquire(wait=True)` blocks, saying once who holds it."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self, wait: bool = True, on_wait=None) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                os.close(fd)
                return False
            if on_wait:
                on_wait(self.holder())
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(owner_info()).encode())
        self.fd = fd
        return True

    def holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closes our description; a child holding an inherited copy keeps the lock
            self.fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_locked(path: Path) -> bool:
    """True while some live process holds the flock on `path`."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


STAGING_NAME = re.compile(r"^\.dilforge-(?P<kind>[a-z]+)-(?P<pid>\d+)-[0-9a-f]{12}$")
OWNER = ".owner"


@contextmanager
def staging_dir(parent: Path, kind: str) -> Iterator[Path]:
    """A fresh staging folder in `parent`, locked by this process and removed on leaving the block."""
    name = f".dilforge-{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    making = parent / f"{name}.new"  # not NAME: invisible to cleanups until locked
    making.mkdir()
    lock = FileLock(making / OWNER)
    lock.acquire(wait=False)
    path = parent / name
    try:
        os.rename(making, path)
        yield path
    finally:
        shutil.rmtree(path if path.exists() else making, ignore_errors=True)
        lock.release()


def abandoned(parent: Path, kind: str | None = None) -> list[Path]:
    """Staging folders in `parent` (of `kind`, or any) whose creator is gone."""
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return []
    found = []
    for path in entries:
        match = STAGING_NAME.match(path.name)
        if not match or (kind is not None and match["kind"] != kind) or path.is_symlink() or not path.is_dir():
            continue
        owner = path / OWNER
        if owner.is_file() and not owner.is_symlink() and not is_locked(owner):
            found.append(path)
    return found


def remove_abandoned(path: Path) -> None:
    """Remove an abandoned staging folder (a real folder, never what a symlink points to)."""
    if STAGING_NAME.match(path.name) and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
