"""Is a published artifact still whole? Checked before every reuse; a damaged one is moved aside to be rebuilt.

Local: every file's size and sha256 (DILFORGE_VERIFY_ON_REUSE=stamp: size, mtime and inode against the last full
check). S3: every object with its size (`fetch` checks sha256). Both: nothing unlisted, and the manifest digest
recorded beside it and by any run record."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

from dilforge_shared.configs import validate_model
from dilforge_shared.errors import DilforgeError, IntegrityError, ManifestError, ManifestNotFound
from dilforge_shared.identity import artifact_id
from dilforge_shared.manifest import MANIFEST_NAME, Manifest
from dilforge_shared.store import (
    NotFound,
    Storage,
    extra_keys,
    manifest_uri_of,
    open_backend,
    read_manifest,
    recorded_digest_problem,
    verify_files,
)

from .config import STAGE_CONFIGS
from .settings import coordinator_settings

STAMP_NAME = ".verified.json"  # local stores: (size, mtime_ns, inode) of each file when last fully verified


def _stamp(manifest: Manifest, digest: str, root: Path) -> dict:
    stats = {}
    for entry in manifest.files:
        st = (root / entry.path).lstat()
        stats[entry.path] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return {"manifest_sha256": digest, "files": stats}


def _stamp_matches(backend: Storage, manifest: Manifest, digest: str, root: Path) -> bool:
    try:
        return json.loads(backend.read_bytes(STAMP_NAME)) == _stamp(manifest, digest, root)
    except (NotFound, OSError, ValueError):
        return False


def recompute_artifact_id(manifest: Manifest) -> str:
    """The artifact id from a published manifest alone: stage, code version, recorded config (validated again, to
    drop its run-only fields) and inputs."""
    config = validate_model(
        STAGE_CONFIGS[manifest.stage], manifest.config, f"manifest config of stage {manifest.stage}"
    )
    return artifact_id(config, manifest.inputs, manifest.code_version)


def identity_problem(manifest: Manifest, folder_id: str, source: str) -> str | None:
    """None if the manifest is the artifact its folder names: its `artifact_id` is the folder's, and the id
    recomputed from its recorded config, code version, inputs and data digests is that id too. Otherwise why not
    (a valid artifact copied into another's folder; a stage that recorded other data than it was planned from)."""
    if manifest.artifact_id != folder_id:
        return f"{source}: manifest says artifact {manifest.artifact_id!r} but it sits in folder {folder_id!r}"
    try:
        recomputed = recompute_artifact_id(manifest)
    except DilforgeError as exc:
        return f"{source}: its recorded config no longer validates ({exc})"
    if recomputed != folder_id:
        return (
            f"{source}: its recorded config, code version {manifest.code_version} and input digests give id "
            f"{recomputed}, not {folder_id}"
        )
    return None


def check_artifact(
    artifact_uri: str, endpoint_url: str | None = None, mode: str | None = None, identity: bool = False
) -> str | None:
    """None if the artifact is whole (see the module doc), else what is wrong; ManifestNotFound if there is none.
    With `identity`, it must also prove it is the artifact its folder names."""
    muri = manifest_uri_of(artifact_uri)
    mode = mode or coordinator_settings().verify_on_reuse
    try:
        manifest, digest = read_manifest(muri, endpoint_url)
    except ManifestNotFound:
        raise
    except ManifestError as exc:
        return str(exc)
    if identity and (problem := identity_problem(manifest, artifact_uri.rstrip("/").rsplit("/", 1)[-1], muri)):
        return problem
    if problem := recorded_digest_problem(artifact_uri, manifest, digest, endpoint_url):
        return problem
    backend = open_backend(artifact_uri, endpoint_url)
    local = backend.local_path(manifest.data_dir)
    try:
        if local is not None:
            fast = mode == "stamp" and _stamp_matches(backend, manifest, digest, local)
            verify_files(manifest, local, muri, full=not fast)
            if mode == "stamp" and not fast:
                backend.write_bytes(STAMP_NAME, json.dumps(_stamp(manifest, digest, local)).encode())
            return None
        if extra := extra_keys(manifest, backend):
            return f"{muri}: {extra[0]} not listed in the manifest: an artifact holds exactly its manifest's files"
        for entry in manifest.files:
            try:
                size = backend.size(f"{manifest.data_dir}/{entry.path}")
            except NotFound:
                return f"{muri}: file {entry.path} listed in the manifest is missing"
            if size != entry.size:
                return f"{muri}: file {entry.path} has {size} bytes, manifest says {entry.size}"
    except IntegrityError as exc:
        return str(exc)
    return None


def move_aside(artifact_uri: str, endpoint_url: str | None = None) -> str:
    """Move a damaged artifact to `<id>.damaged-<utc>` beside it (manifest first gone), so its id can be rebuilt."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    parent_uri, _, name = artifact_uri.rstrip("/").rpartition("/")
    target = f"{name}.damaged-{stamp}"
    parent = open_backend(parent_uri, endpoint_url)
    local = parent.local_path(name)
    if local is not None:
        n = 1
        while local.with_name(target).exists():  # set aside twice within one second
            n += 1
            target = f"{name}.damaged-{stamp}-{n}"
        os.rename(local, local.with_name(target))
    else:
        keys = list(parent.list(name))
        manifest_key = f"{name}/{MANIFEST_NAME}"
        for key in keys:
            parent.copy(key, target + key[len(name) :])
        if manifest_key in keys:
            parent.delete(manifest_key)
        parent.delete_prefix(name)
    return f"{parent_uri}/{target}"
