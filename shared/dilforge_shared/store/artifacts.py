"""Publish, read, verify and fetch artifacts: `<root>/artifacts/<stage>/<artifact_id>/` with `manifest.json` last."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactExistsError, DilforgeError, IntegrityError, ManifestNotFound
from ..manifest import (
    MANIFEST_NAME,
    FileEntry,
    InputRef,
    Manifest,
    artifact_ref,
    parse_manifest,
    scan_files,
    sha256_bytes,
    sha256_file,
)
from ..paths import confined
from ..settings import cache_root
from .backends import NotFound, Storage, open_backend, read_uri_bytes

log = logging.getLogger("dilforge_shared.store")


STORE_MARKER = ".dilforge-store"  # at a store's root, written by every publish and run record


def mark_store(backend: Storage) -> None:
    """Leave the marker that says this root is a dilforge store (`coordinator gc` works nowhere else)."""
    if not backend.exists(STORE_MARKER):
        backend.create_bytes(STORE_MARKER, b"dilforge artifact store\n")


def manifest_uri_of(uri: str) -> str:
    """Accept either an artifact folder or its manifest.json."""
    uri = uri.rstrip("/")
    return uri if uri.endswith("/" + MANIFEST_NAME) or uri == MANIFEST_NAME else f"{uri}/{MANIFEST_NAME}"


@dataclass
class Artifact:
    """A manifest read from a store, with the local folder holding its verified files."""

    uri: str
    manifest: Manifest
    manifest_sha256: str
    path: Path

    def ref(self, name: str) -> InputRef:
        return artifact_ref(name, self.uri, self.manifest)


def artifact_storage(artifact_uri: str, endpoint_url: str | None = None) -> Storage:
    """The storage rooted at one artifact's folder (manifest.json, its data folder, the reuse stamp): what
    integrity checks read sizes and local paths from."""
    return open_backend(artifact_uri.rstrip("/"), endpoint_url)


# sha256 of the manifest's bytes, written beside it just before the manifest: any later change to manifest.json
# (a flipped byte in its metrics or dates too, which still parses) is caught by every reader. Named after the data
# folder, so of two racing publishers each writes its own (the loser removes its own with its files), and outside
# it, so an artifact's data folder holds exactly the files its manifest lists.
def manifest_digest_key(data_dir: str) -> str:
    return f".{data_dir}.manifest.sha256"


def artifact_exists(artifact_uri: str, endpoint_url: str | None = None) -> bool:
    return artifact_storage(artifact_uri, endpoint_url).exists(MANIFEST_NAME)


def publish(
    artifact_uri: str,
    local_dir: Path,
    manifest: Manifest,
    endpoint_url: str | None = None,
    each: Callable[[list[FileEntry]], Iterable[FileEntry]] = iter,
) -> Manifest:
    """Upload every file of `local_dir`, then create the manifest. Raises ArtifactExistsError if taken.

    `manifest.files` and `manifest.data_dir` are filled in here from what is actually uploaded. The upload loop runs
    over `each(files)`: a stage passes a progress tracker there.
    """
    backend = artifact_storage(artifact_uri, endpoint_url)
    manifest_key = MANIFEST_NAME
    if backend.exists(manifest_key):
        raise ArtifactExistsError(f"{artifact_uri}/{MANIFEST_NAME}")
    files = scan_files(local_dir)
    if not files:
        raise DilforgeError(f"{local_dir}: nothing to publish (empty output folder)")
    root, artifacts, _stage, _id = (artifact_uri.rstrip("/").rsplit("/", 3) + ["", "", ""])[:4]
    # `<store>/artifacts/<stage>/<id>`, as the coordinator's ArtifactStore names it
    if artifacts == "artifacts" and root:
        mark_store(open_backend(root, endpoint_url))
    data_dir = f"data-{uuid.uuid4().hex[:12]}"
    manifest = manifest.model_copy(update={"files": files, "data_dir": data_dir})
    body = manifest.to_json()
    try:
        for entry in each(files):
            backend.upload_file(f"{data_dir}/{entry.path}", local_dir / entry.path)
        backend.write_bytes(manifest_digest_key(data_dir), sha256_bytes(body).encode())
        created = backend.create_bytes(manifest_key, body)
    except BaseException:
        _remove_attempt(backend, data_dir)
        raise
    if not created:
        _remove_attempt(backend, data_dir)
        raise ArtifactExistsError(f"{artifact_uri}/{MANIFEST_NAME}")
    log.info("published %s (%d files)", artifact_uri, len(files))
    return manifest


def _remove_attempt(backend: Storage, data_dir: str) -> None:
    """What a failed or losing publish wrote: its data folder and its manifest digest."""
    backend.delete_prefix(data_dir)
    delete = getattr(backend, "delete", None)
    if delete is not None:
        delete(manifest_digest_key(data_dir))


def read_manifest(uri: str, endpoint_url: str | None = None) -> tuple[Manifest, str]:
    """Return (manifest, sha256 of its bytes) for an artifact folder or manifest URI."""
    muri = manifest_uri_of(uri)
    try:
        data = read_uri_bytes(muri, endpoint_url)
    except NotFound as exc:
        raise ManifestNotFound(f"{muri}: no manifest there ({exc})") from None
    manifest, digest = parse_manifest(data, muri), sha256_bytes(data)
    try:
        recorded = (
            read_uri_bytes(f"{muri[: -len(MANIFEST_NAME)]}{manifest_digest_key(manifest.data_dir)}", endpoint_url)
            .decode("ascii", "replace")
            .strip()
        )
    except NotFound:
        raise IntegrityError(
            f"{muri}: no recorded digest beside the manifest ({manifest_digest_key(manifest.data_dir)} is missing): "
            "an edited manifest cannot be told from the published one; republish the artifact (rerun its stage)"
        ) from None
    if recorded != digest:
        raise IntegrityError(
            f"{muri}: damaged manifest: its sha256 is not the one recorded when it was published "
            f"({manifest_digest_key(manifest.data_dir)})"
        )
    return manifest, digest


def store_of(artifact_uri: str, endpoint_url: str | None = None) -> tuple[str, str] | None:
    """(store root, `artifacts/<stage>/<id>`) of an artifact kept in a store, else None; a local artifact by its
    real path, so a relative one, `//`, `./` or a link to its folder is still in its store."""
    local = artifact_storage(artifact_uri, endpoint_url).local_path("")
    where = local.as_posix() if local is not None else artifact_uri.rstrip("/")
    root, sep, tail = where.rpartition("/artifacts/")
    if not sep or not root or tail.count("/") != 1:
        return None
    return root, f"artifacts/{tail}"


def recorded_digest_problem(artifact_uri: str, manifest: Manifest, digest: str, endpoint_url: str | None) -> str | None:
    """None unless the store's run records witnessed publishes of this artifact (each record keeps, per artifact it
    produced or reused, the manifest's data folder and sha256) and none of them is this one: its manifest was
    edited, or its files were swapped under a new data folder with a new digest beside it, whatever that digest
    says. A rebuild after a damaged artifact is witnessed by the run that rebuilt it. Only artifacts at
    `<store>/artifacts/<stage>/<id>` have records to ask."""
    if (found := store_of(artifact_uri, endpoint_url)) is None:
        return None
    root, address = found
    try:
        store = open_backend(root, endpoint_url)
        keys = [k for k in store.list("runs") if k.endswith(".json")]
    except (NotFound, OSError, DilforgeError):
        return None
    seen: list[tuple[str, dict]] = []
    for key in sorted(keys):
        try:
            witness = (json.loads(store.read_bytes(key)).get("witnesses") or {}).get(address)
        except (NotFound, OSError, ValueError, AttributeError):
            continue  # a damaged record is the coordinator's to report
        if isinstance(witness, dict):
            if (witness.get("data_dir"), witness.get("manifest_sha256")) == (manifest.data_dir, digest):
                return None
            seen.append((key, witness))
    if not seen:
        return None
    key, witness = next(((k, w) for k, w in seen if w.get("data_dir") == manifest.data_dir), seen[-1])
    if witness.get("data_dir") == manifest.data_dir:
        return (
            f"{artifact_uri}/{MANIFEST_NAME}: changed since run record {key} recorded it (sha256 "
            f"{str(witness.get('manifest_sha256'))[:12]}…, now {digest[:12]}…); rerun its stage to rebuild it"
        )
    return (
        f"{artifact_uri}/{MANIFEST_NAME}: its data folder {manifest.data_dir} is no publish a run record witnessed "
        f"({key} recorded {witness.get('data_dir')}): the artifact was replaced after it was made; rerun its stage "
        "to rebuild it"
    )


def extra_keys(manifest: Manifest, backend: Storage) -> list[str]:
    """Objects under a remote artifact's data prefix that its manifest does not list."""
    listed = {f"{manifest.data_dir}/{entry.path}" for entry in manifest.files}
    return sorted(k for k in backend.list(manifest.data_dir) if k not in listed)


def extra_files(manifest: Manifest, root: Path) -> list[str]:
    """What `root` holds besides the manifest's files (any file, link or special file, at any depth, hidden ones too)."""
    listed = {entry.path for entry in manifest.files}
    extra = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        for name in files + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path = (rel / name).as_posix()
            if path not in listed:
                extra.append(path)
    return sorted(extra)


def verify_files(manifest: Manifest, root: Path, source: str, full: bool = True) -> None:
    """Every listed file present, inside `root` (no symlink leaving it), of its size, and (full) of its sha256; and
    nothing else there: readers read exactly the manifest's files, so a file added later is an error, not data."""
    if extra := extra_files(manifest, root):
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise IntegrityError(
            f"{source}: {root.name}/{extra[0]}{more} not listed in the manifest: an artifact holds exactly its "
            "manifest's files (remove what was added, or rerun its stage)"
        )
    real_root = root.resolve()
    for entry in manifest.files:
        path = root / entry.path
        if path.is_symlink() or not path.resolve().is_relative_to(real_root):
            raise IntegrityError(
                f"{source}: file {entry.path} is a symlink ({path} -> {path.resolve()}); "
                "artifact files must be regular files inside the artifact"
            )
        if not path.is_file():
            raise IntegrityError(f"{source}: file {entry.path} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise IntegrityError(f"{source}: file {entry.path} has {size} bytes, manifest says {entry.size}")
        if full and sha256_file(path) != entry.sha256:
            raise IntegrityError(f"{source}: file {entry.path} does not match its sha256 in the manifest")


def fetch(uri: str, cache_dir: Path | None = None, endpoint_url: str | None = None) -> Artifact:
    """Read a manifest and make its files available locally, verified.

    Local stores are verified in place (no copy); remote ones are downloaded to
    `cache_dir/<artifact_id>-<sha>/` (reused across calls when already complete and verified).
    """
    muri = manifest_uri_of(uri)
    artifact_uri = muri[: -len(MANIFEST_NAME) - 1]
    manifest, digest = read_manifest(muri, endpoint_url)
    if problem := recorded_digest_problem(artifact_uri, manifest, digest, endpoint_url):
        raise IntegrityError(problem)
    backend = artifact_storage(artifact_uri, endpoint_url)
    local = backend.local_path(manifest.data_dir)
    if local is not None:
        verify_files(manifest, local, muri)
    else:
        if extra := extra_keys(manifest, backend):
            raise IntegrityError(
                f"{muri}: {extra[0]} not listed in the manifest: an artifact holds exactly its manifest's files"
            )
        # the cached copy has the artifact's layout (manifest.json beside its data folder), so a reader of the
        # folder finds the manifest that lists its files (corpus_files.artifact_files, a SageMaker channel)
        cache_dir = cache_dir or cache_root() / "artifacts"
        top = confined(cache_dir, f"{manifest.artifact_id}-{digest[:12]}", f"{muri}: artifact_id")
        local = top / manifest.data_dir
        marker = top / ".complete"
        if marker.exists():
            try:
                verify_files(manifest, local, muri)
                return Artifact(uri=artifact_uri, manifest=manifest, manifest_sha256=digest, path=local)
            except IntegrityError:
                log.warning("%s: cached copy at %s is damaged; downloading again", muri, top)
                shutil.rmtree(top)
        for entry in manifest.files:
            try:
                backend.download_file(f"{manifest.data_dir}/{entry.path}", local / entry.path)
            except NotFound:
                raise IntegrityError(f"{muri}: file {entry.path} listed in the manifest is missing") from None
        verify_files(manifest, local, muri)
        backend.download_file(MANIFEST_NAME, top / MANIFEST_NAME)  # as published: a reader can check its digest
        if sha256_file(top / MANIFEST_NAME) != digest:
            raise IntegrityError(f"{muri}: the manifest changed while its artifact was being copied")
        marker.touch()
    return Artifact(uri=artifact_uri, manifest=manifest, manifest_sha256=digest, path=local)
