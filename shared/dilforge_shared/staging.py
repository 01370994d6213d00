"""Staging folders that a later run or `coordinator gc` can prove are dilforge's and abandoned.

`.dilforge-<kind>-<pid>-<uuid>`, whose creator holds an flock on its `.owner` file while it lives; it is made
under another name and renamed once locked. Cleanup removes only folders of that name whose owner file is
unlocked, never a user's folder."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .locks import FileLock, is_locked

NAME = re.compile(r"^\.dilforge-(?P<kind>[a-z]+)-(?P<pid>\d+)-[0-9a-f]{12}$")
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
        match = NAME.match(path.name)
        if not match or (kind is not None and match["kind"] != kind) or path.is_symlink() or not path.is_dir():
            continue
        owner = path / OWNER
        if owner.is_file() and not owner.is_symlink() and not is_locked(owner):
            found.append(path)
    return found


def remove(path: Path) -> None:
    """Remove an abandoned staging folder (a real folder, never what a symlink points to)."""
    if NAME.match(path.name) and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
