"""`coordinator gc`: find (and with --delete remove) what crashes, cancels and damaged artifacts leave behind:
only what dilforge provably made (a marked store or work folder, a leftover with its writer's exact name), never
inside a published data folder; in-flight work is skipped by its lock or --min-age."""

from __future__ import annotations

import functools
import json
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.errors import DilforgeError, ManifestError
from dilforge_shared.locks import FileLock, abandoned, is_locked, remove_abandoned
from dilforge_shared.manifest import MANIFEST_NAME, STAGES, parse_manifest
from dilforge_shared.store import STORE_MARKER, NotFound, manifest_digest_key

from .backends.local import WORK_MARKER
from .records import ArtifactStore, DamagedRecord, parse_record

# The exact names dilforge's writers give what they leave on a crash; anything else is the user's.
STORE_TEMP = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")  # LocalStorage write_bytes/create_bytes/upload_file
DATA_DIR = re.compile(r"^data-[0-9a-f]{12}$")  # store.publish
DIGEST_FILE = re.compile(r"^\.data-[0-9a-f]{12}\.manifest\.sha256$")  # store.manifest_digest_key
DAMAGED = re.compile(r"\.damaged-\d{8}T\d{6}Z(-\d+)?$")  # integrity.move_aside
ARTIFACT_ID = re.compile(r"^[0-9a-f]{16}$")  # manifest.fingerprint: `artifacts/<stage>/<id>`
# In the download cache, by subfolder: models.open_model → mirror_prefix (`.<key>.<8 hex>.partial|old` beside
# the copy), identity.stamped_sha256 (`<sha256>.<pid>.tmp`), the model stage's recipe wheels (`.download-<uuid>`).
CACHE_LEFTOVERS = {
    "models": re.compile(r"^\.[0-9a-f]{16}\.[0-9a-f]{8}\.(partial|old)$"),
    "digests": re.compile(r"^[0-9a-f]{64}\.\d+\.tmp$"),
    "wheels": re.compile(r"^\.download-[0-9a-f]{32}$"),
}
CACHE_STAGING = ("llama.cpp",)  # export's converter download (dilforge_shared.staging)
WORK_NAME = re.compile(r"^[a-z]+-[0-9a-f]{8,64}$")  # backends.local.work_folder: <stage>-<artifact id>
BACKEND_WORKDIRS = ("compose", "sagemaker-local")  # where the container backends keep theirs, under the work folder


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


class NotOurs(DilforgeError):
    """A --store, --workdir or --export-dir that is no folder, or a store gc cannot prove is dilforge's: nothing
    is removed."""


def check_store(store: ArtifactStore) -> None:
    """The store exists as a folder (or prefix) and carries the marker its writers leave; else NotOurs."""
    where = store.backend.uri
    root = store.backend.local_path("")
    if root is not None and not root.is_dir():
        what = "is a file, not a store folder" if root.exists() else "does not exist"
        raise NotOurs(f"--store {root} {what}: nothing to collect")
    if not store.backend.exists(STORE_MARKER):
        raise NotOurs(
            f"--store {where} is not a dilforge artifact store (no {STORE_MARKER}, which every publish and run record "
            "writes): gc removes nothing where it cannot prove the files are dilforge's"
        )


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
        for entry in doc.stages.values():  # every attempt's artifact, the last good one, a concurrent run's (also)
            refs.update(store.resolve(a).rstrip("/") for a in entry.addresses())
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
    check_store(store)
    backend = store.backend
    folders: dict[tuple[str, str], set[str]] = {}
    for key in backend.list("artifacts"):
        parts = key.split("/")  # only `artifacts/<a stage>/<an artifact id>[.damaged-…]`: the rest is not ours
        if len(parts) >= 4 and parts[1] in STAGES and ARTIFACT_ID.match(DAMAGED.sub("", parts[2])):
            folders.setdefault((parts[1], parts[2]), set()).add(parts[3])
    refs = _referenced(store) if unreferenced else set()
    found: list[Garbage] = []
    for (stage, name), entries in sorted(folders.items()):
        prefix = f"artifacts/{stage}/{name}"
        uri = f"{backend.uri}/{prefix}"
        remove_folder = functools.partial(backend.delete_prefix, prefix)
        if DAMAGED.search(name):
            found.append(Garbage("damaged", uri, "moved aside by a rerun that rebuilt it", remove_folder))
            continue
        data_dir = None
        if MANIFEST_NAME in entries:
            try:
                manifest = parse_manifest(backend.read_bytes(f"{prefix}/{MANIFEST_NAME}"), uri)
            except ManifestError:
                continue  # not a manifest dilforge can read: `manifest validate` reports it, gc proves nothing
            if (manifest.stage, manifest.artifact_id) != (stage, name):
                continue  # a manifest of another place: not the artifact this folder's name says
            data_dir = manifest.data_dir
            if unreferenced and uri not in refs:
                found.append(Garbage("unreferenced", uri, "no run record names it", remove_folder))
                continue
        keep = {data_dir, manifest_digest_key(data_dir)} if data_dir else set()
        orphans = sorted(e for e in entries if e not in keep and (DATA_DIR.match(e) or DIGEST_FILE.match(e)))
        if not orphans or _lock_held(store, stage, name):
            continue
        for entry in orphans:
            local = backend.local_path(f"{prefix}/{entry}")
            if local is not None and (local.is_symlink() or _age_s(local) < min_age_s):
                continue  # a link is not what publish writes; a young one may be a publish in flight
            why = "no manifest points at it (publish interrupted)" if data_dir is None else "not the manifest's data"
            remove = backend.delete if entry.startswith(".") else backend.delete_prefix  # a digest file, a folder
            found.append(Garbage("orphan-data", f"{uri}/{entry}", why, functools.partial(remove, f"{prefix}/{entry}")))
    root = backend.local_path("")
    if root is not None:  # where the store writes through a temp file: beside manifests, records, locks
        folders = [f for f in (root, root / "runs", root / "locks") if not f.is_symlink()]
        folders += [a for s in _subfolders(root / "artifacts") for a in _subfolders(s)]
        found += [g for folder in folders for g in _leftovers(folder, (STORE_TEMP,), min_age_s)]
    return found


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _leftovers(folder: Path, patterns: tuple[re.Pattern, ...], min_age_s: float) -> list[Garbage]:
    """Entries directly in `folder` named exactly as a dilforge writer names its temp files, older than min_age_s."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    return [
        Garbage("temp", str(path), "left by an interrupted write", functools.partial(_rm, path))
        for path in entries
        if any(pat.match(path.name) for pat in patterns) and _age_s(path) >= min_age_s
    ]


def _cache_leftovers(cache: Path, min_age_s: float) -> list[Garbage]:
    """Interrupted downloads and digests in the cache's own subfolders, and staging folders whose process is gone;
    nothing else in the cache (which may be any folder DILFORGE_CACHE names) is looked at."""
    found: list[Garbage] = []
    for sub, pattern in CACHE_LEFTOVERS.items():
        found += _leftovers(cache / sub, (pattern,), min_age_s)
    for sub in CACHE_STAGING:
        found += [_staging(p, "a process that is gone") for p in abandoned(cache / sub)]
    return found


def _staging(path: Path, whose: str) -> Garbage:
    return Garbage("staging", str(path), f"staging folder of {whose}", functools.partial(remove_abandoned, path))


def find_staging_garbage(folder: Path) -> list[Garbage]:
    """Staging folders a killed export left in its --out folder."""
    if not folder.is_dir():
        raise NotOurs(f"--export-dir {folder} is not a folder")
    return [_staging(p, "an export that was killed") for p in abandoned(folder)]


def _rm(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _rm_work(path: Path) -> None:
    """Remove a work folder while holding its lock, so a run that started since it was listed keeps it."""
    lock = FileLock(path.with_name(f"{path.name}.lock"))
    if lock.acquire(wait=False):
        try:
            _rm(path)
        finally:
            lock.release()


def find_work_garbage(workdir: Path, min_age_s: float, caches: Iterable[Path] = ()) -> list[Garbage]:
    """Work folders the local backend made that no live process holds, and what interrupted downloads left in
    the caches."""
    found: list[Garbage] = []
    for cache in dict.fromkeys(c.resolve() for c in caches):
        if cache.is_dir():
            found += _cache_leftovers(cache, min_age_s)
    if workdir.exists() and not workdir.is_dir():
        raise NotOurs(f"--workdir {workdir} is a file, not a folder")
    folders = [workdir, *(workdir / b for b in BACKEND_WORKDIRS if not (workdir / b).is_symlink())]
    for path in (p for folder in folders for p in _subfolders(folder)):
        if WORK_NAME.match(path.name) and (path / WORK_MARKER).is_file():
            if is_locked(path.with_name(f"{path.name}.lock")):
                continue
            why = "work folder no live process holds (checkpoints of a failed or cancelled run; removing it means "
            why += "the next run starts over)"
            found.append(Garbage("work", str(path), why, functools.partial(_rm_work, path)))
    return found  # temp files inside a work folder go with it; a held one is a live process's business
