"""Content digests of training checkpoints (CPT's and SFT's), torch-free.

A checkpoint folder is complete with one marker per node (`COMPLETE.nodeNNNNN-of-MMMMM`: the size and sha256
of every file that node wrote), written after its files. Before a resume `verify` recomputes them; a damaged
folder is set aside and the previous checkpoint tried, so damage never reaches published weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .manifest import sha256_file

MARKER_PREFIX = "COMPLETE.node"


def marker_name(node: int, num_nodes: int) -> str:
    return f"{MARKER_PREFIX}{node:05d}-of-{num_nodes:05d}"


def checkpoint_files(path: Path) -> list[str]:
    """Every regular file under the folder (relative posix paths, sorted), completion markers excluded."""
    return sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*")
        if p.is_file() and not (p.parent == path and p.name.startswith(MARKER_PREFIX))
    )


def digest(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_marker(path: Path, files: dict[str, dict], step: int, node: int = 0, num_nodes: int = 1) -> Path:
    """This node's completion marker (written to a temporary name and renamed: a marker is whole or absent)."""
    marker = path / marker_name(node, num_nodes)
    tmp = path / f".{marker.name}.tmp"
    tmp.write_text(json.dumps({"step": step, "node": node, "num_nodes": num_nodes, "files": files}))
    os.replace(tmp, marker)
    return marker


def seal(path: Path, step: int) -> Path:
    """One process wrote the whole folder: digest every file in it and write the single marker."""
    return write_marker(path, {name: digest(path / name) for name in checkpoint_files(path)}, step)


def read_markers(path: Path) -> list[dict] | None:
    """Every node's marker, if there is one from each node of the same run; None otherwise: not complete yet (e.g.
    a host's files have not reached this folder); a file missing or of another size after that is damage."""
    infos = []
    for marker in sorted(path.glob(f"{MARKER_PREFIX}*")):
        try:
            infos.append(json.loads(marker.read_text()))
        except (OSError, ValueError):
            return None
    try:
        n = int(infos[0]["num_nodes"])
        if sorted(int(i["node"]) for i in infos) != list(range(n)) or any(int(i["num_nodes"]) != n for i in infos):
            return None
        return infos if all(isinstance(i["files"], dict) for i in infos) else None
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        return None


def verify(path: Path, share: slice = slice(None)) -> str | None:
    """None if the files in `share` of this checkpoint's sorted file list match their digests, else what is wrong.
    Every file in the folder must be listed by a marker: an unlisted file is not verified, so it is refused."""
    infos = read_markers(path)
    if infos is None:
        return f"{path.name}: markers missing or unreadable"
    files = {name: entry for info in infos for name, entry in info["files"].items()}
    if unlisted := sorted(set(checkpoint_files(path)) - set(files)):
        return f"{path.name}: files {unlisted} are not listed by any marker"
    for name in sorted(files)[share]:
        entry = files[name]
        if not isinstance(entry, dict) or "sha256" not in entry:
            return f"{path.name}: {name} has no content digest in its marker"
        f = path / name
        if not f.is_file():
            return f"{path.name}: {name} is missing"
        if f.stat().st_size != int(entry["size"]) or sha256_file(f) != entry["sha256"]:
            return f"{path.name}: {name} does not match its sha256 (damaged)"
    return None


def set_aside(path: Path, name: str | None = None) -> Path | None:
    """Rename a damaged checkpoint (default `<name>.damaged`; kept for inspection, never resumed again); None if
    another process set it aside first."""
    base = name or path.name + ".damaged"
    target, n = path.with_name(base), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{base}-{n}")
    try:
        os.replace(path, target)
    except FileNotFoundError:  # another host's rank set aside the same (shared) folder first
        return None
    return target
