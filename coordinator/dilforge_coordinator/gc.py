"""`coordinator gc`: find (and with --delete remove) what crashes, cancels and damaged artifacts leave behind.

What counts as garbage, and why it is safe to remove:
- `orphan-data`: a `data-*/` folder that no manifest points at (a publish killed before its manifest, or the
  loser of a race). Skipped while the artifact's lock is held or younger than --min-age (a publish in flight).
- `damaged`: an artifact a rerun moved aside (`<id>.damaged-<time>`) before rebuilding it.
- `unreferenced`: a published artifact no run record names (only with --unreferenced: other stores or people
  may still use it by URI).
- `temp`: `*.tmp` / `.partial` / `.old` leftovers of interrupted writes, older than --min-age.
- `work`: a local work folder (`/opt/ml` root) no live process holds; it only serves to resume a failed run.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.errors import DilforgeError, ManifestError
from dilforge_shared.locks import is_locked
from dilforge_shared.manifest import MANIFEST_NAME
from dilforge_shared.store import ArtifactStore, NotFound, parse_manifest
from dilforge_shared.store.artifacts import manifest_digest_key

from .records import DamagedRecord, parse_record

TEMP_NAME = re.compile(r"\.tmp\d*$")  # store writes (`.x.<uuid>.tmp`), CPT token cache (`.tmp<pid>`)


@dataclass
class Garbage:
    kind: str
    uri: str
    why: str
    remove: object  # a callable that deletes it


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


class UnreadableRecords(DilforgeError):
    """--unreferenced cannot be answered while a run record is unreadable: its artifacts would look unreferenced."""


def _referenced(store: ArtifactStore) -> set[str]:
    """URIs, in this store as it is now, of every artifact a run record names (records hold store-relative
    addresses, so a copied or moved store gives the same answer as the original)."""
    refs, damaged = set(), []
    for key in store.backend.list("runs"):
        if not key.endswith(".json"):
            continue
        try:
            doc = parse_record(store.backend.read_bytes(key), f"{store.backend.uri}/{key}")
        except NotFound:
            continue
        except DamagedRecord as exc:
            damaged.append(str(exc))
            continue
        for entry in doc.stages.values():  # every attempt's artifact, and the last good one behind a failed attempt
            refs.update(store.resolve(a).rstrip("/") for a in (entry.artifact, entry.last_good) if a)
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise UnreadableRecords(
            f"{damaged[0]}{more}; --unreferenced would count its artifacts as unreferenced: "
            "rerun that run id (which sets the record aside) or remove it, then gc again"
        )
    return refs


def _lock_held(store: ArtifactStore, stage: str, artifact_id: str) -> bool:
    key = f"locks/{stage}-{artifact_id}.lock"
    local = store.backend.local_path(key)
    if local is not None:
        return is_locked(local)
    try:
        lease = json.loads(store.backend.read_bytes(key))
    except (NotFound, ValueError):
        return False
    return lease.get("expires_at", 0) > time.time()


def find_store_garbage(store: ArtifactStore, min_age_s: float, unreferenced: bool) -> list[Garbage]:
    backend = store.backend
    folders: dict[tuple[str, str], set[str]] = {}
    for key in backend.list("artifacts"):
        parts = key.split("/")
        if len(parts) >= 4:
            folders.setdefault((parts[1], parts[2]), set()).add(parts[3])
    refs = _referenced(store) if unreferenced else set()
    found: list[Garbage] = []
    for (stage, name), entries in sorted(folders.items()):
        prefix = f"artifacts/{stage}/{name}"
        uri = f"{backend.uri}/{prefix}"
        if ".damaged-" in name:
            found.append(
                Garbage(
                    "damaged", uri, "moved aside by a rerun that rebuilt it", lambda p=prefix: backend.delete_prefix(p)
                )
            )
            continue
        data_dir = None
        if MANIFEST_NAME in entries:
            try:
                data_dir = parse_manifest(backend.read_bytes(f"{prefix}/{MANIFEST_NAME}"), uri).data_dir
            except ManifestError:
                data_dir = None
            if unreferenced and uri not in refs:
                found.append(
                    Garbage("unreferenced", uri, "no run record names it", lambda p=prefix: backend.delete_prefix(p))
                )
                continue
        keep = {data_dir, manifest_digest_key(data_dir)} if data_dir else set()
        orphans = sorted(
            e
            for e in entries
            if e not in keep and (e.startswith("data-") or (e.startswith(".data-") and e.endswith(".manifest.sha256")))
        )
        if not orphans or _lock_held(store, stage, name):
            continue
        for entry in orphans:
            local = backend.local_path(f"{prefix}/{entry}")
            if local is not None and _age_s(local) < min_age_s:
                continue
            why = "no manifest points at it (publish interrupted)" if data_dir is None else "not the manifest's data"
            remove = backend.delete if entry.startswith(".") else backend.delete_prefix  # a digest file, a folder
            found.append(Garbage("orphan-data", f"{uri}/{entry}", why, lambda p=f"{prefix}/{entry}", r=remove: r(p)))
    root = backend.local_path("")
    if root is not None:
        found += _temp_files(root, min_age_s)
    return found


def _temp_files(root: Path, min_age_s: float) -> list[Garbage]:
    found = []
    for path in sorted(root.rglob("*")):
        name = path.name
        leftover = TEMP_NAME.search(name) or (name.startswith(".") and name.endswith((".partial", ".old")))
        if leftover and _age_s(path) >= min_age_s:
            found.append(Garbage("temp", str(path), "left by an interrupted write", lambda p=path: _rm(p)))
    return found


def _rm(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def find_work_garbage(workdir: Path, min_age_s: float, cache: Path | None = None) -> list[Garbage]:
    """Work folders no live process holds, and temp files of interrupted downloads in the cache."""
    found = _temp_files(cache, min_age_s) if cache is not None and cache.is_dir() else []
    if not workdir.is_dir():
        return found
    for path in sorted(workdir.iterdir()):
        if path.is_dir() and not path.name.startswith("."):
            if is_locked(workdir / f"{path.name}.lock"):
                continue
            found.append(
                Garbage(
                    "work",
                    str(path),
                    "work folder no live process holds (checkpoints of a failed "
                    "or cancelled run; removing it means the next run starts over)",
                    lambda p=path: _rm(p),
                )
            )
    return found  # temp files inside a work folder go with it; a held one is a live process's business
