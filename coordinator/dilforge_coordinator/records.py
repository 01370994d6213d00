"""The store as the coordinator lays it out (`artifacts/<stage>/<artifact_id>/`, `runs/`) and its run records,
`runs/<run_id>.json`: each stage's artifact (store-relative, so a moved store keeps working) and status, the run's
status and owner. An unreadable record is set aside and a fresh one started; concurrent runs of one id merge
under the record's lock, so `gc --unreferenced` loses nothing either produced; every string written is redacted."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

from dilforge_shared.errors import ConfigError, DilforgeError, field_errors
from dilforge_shared.locks import FileLock
from dilforge_shared.manifest import check_name, check_relative_path
from dilforge_shared.settings import redact_values
from dilforge_shared.store import NotFound, mark_store, open_backend
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from .leases import S3Lease, owner_alive
from .settings import coordinator_settings

log = logging.getLogger("dilforge.coordinator")


class ArtifactStore:
    """Publish and fetch artifacts under a root URI: `<root>/artifacts/<stage>/<artifact_id>/`."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/")
        self.endpoint_url = endpoint_url
        self.backend = open_backend(self.uri, endpoint_url)

    def artifact_uri(self, stage: str, artifact_id: str) -> str:
        return f"{self.backend.uri}/artifacts/{check_name(stage, 'stage')}/{check_name(artifact_id, 'artifact id')}"

    def relative(self, uri: str) -> str:
        """`artifacts/<stage>/<id>` for a URI inside this store: what run records hold."""
        root = self.backend.uri.rstrip("/") + "/"
        if not uri.startswith(root):
            raise DilforgeError(f"{uri} is not in the store {root}")
        return uri.rstrip("/")[len(root) :]

    def resolve(self, address: str) -> str:
        """A run record's artifact address as a URI in this store, wherever it now is."""
        return f"{self.backend.uri}/{check_relative_path(address)}"

    # ---- runs: small mutable records, unlike manifests -------------------------------------
    def run_record_key(self, run_id: str) -> str:
        return f"runs/{check_name(run_id, 'run id')}.json"

    def write_run_record(self, run_id: str, data: bytes) -> None:
        mark_store(self.backend)
        self.backend.write_bytes(self.run_record_key(run_id), data)

    def read_run_record(self, run_id: str) -> bytes:
        return self.backend.read_bytes(self.run_record_key(run_id))


class DamagedRecord(DilforgeError):
    """A run record that is not valid JSON of the record's shape."""


GOOD = ("produced", "reused")
Address = Annotated[str, AfterValidator(check_relative_path)]  # store-relative: artifacts/<stage>/<id>


class StageEntry(BaseModel):
    """One stage in a record; unknown keys are kept (a newer coordinator may add some)."""

    model_config = ConfigDict(extra="allow")
    artifact: Address = Field(description="The stage's artifact.")
    status: str = Field(description="running, produced, reused, failed or cancelled.")
    backend: str | None = None
    error: str | None = None
    last_good: Address | None = Field(
        default=None,
        description="While the stage's latest attempt is running, failed or was cancelled: the artifact its last "
        "good attempt produced or reused, which downstream stages and gc keep using.",
    )
    also: list[Address] = Field(
        default_factory=list,
        description="Good artifacts of this stage that another process running the same run id produced or reused "
        "at the same time: kept referenced, so gc never counts them unreferenced.",
    )

    def addresses(self) -> list[str]:
        """Every artifact this entry keeps referenced: the latest attempt, the last good one, and `also`."""
        return [a for a in (self.artifact, self.last_good, *self.also) if a]


class Witness(BaseModel):
    """One publish of an artifact as a run produced or reused it: what `manifest validate` and every reuse compare
    its manifest against (store.recorded_digest_problem)."""

    model_config = ConfigDict(extra="forbid")
    data_dir: str = Field(description="The manifest's data folder: which publish of the artifact this is.")
    manifest_sha256: str = Field(description="sha256 of that publish's manifest.json.")


class RecordDoc(BaseModel):
    model_config = ConfigDict(extra="allow")
    run_id: str
    status: str = "new"
    owner: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None
    updated_at: str | None = None
    stages: dict[str, StageEntry] = Field(default_factory=dict)
    witnesses: dict[Address, Witness] = Field(
        default_factory=dict,
        description="Store-relative artifact address → the publish this run last produced or reused there; kept "
        "when the stage's entry moves on, so an artifact the run no longer names is still checked against it.",
    )


def parse_record(data: bytes, source: str) -> RecordDoc:
    """A record's bytes as a RecordDoc, or DamagedRecord naming `source` and what is wrong, in one line."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DamagedRecord(f"{source}: damaged run record: not valid JSON ({exc})") from None
    try:
        return RecordDoc.model_validate(raw)
    except ValidationError as exc:
        raise DamagedRecord(f"{source}: damaged run record: {field_errors(exc)}") from None


def store_lock(store: ArtifactStore, key: str, poll_s: float = 2.0) -> FileLock | S3Lease:
    """A lock in the store: flock in a local store, a create-only lease object in S3."""
    local = store.backend.local_path("")
    if local is not None:
        return FileLock(local / key)
    return S3Lease(store.backend, key, coordinator_settings().lock_lease_seconds, poll_s)


def record_lock(store: ArtifactStore, run_id: str) -> FileLock | S3Lease:
    """The lock every write of one run record holds."""
    return store_lock(store, f"locks/{store.run_record_key(run_id)}.lock", poll_s=0.2)


def running_owner() -> dict:
    """Who runs a stage, kept in its `running` entry: what tells a live concurrent attempt from a dead one."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _good_addresses(entry: dict) -> list[str]:
    good = [entry["artifact"]] if entry.get("status") in GOOD and entry.get("artifact") else []
    return [*good, *([entry["last_good"]] if entry.get("last_good") else []), *entry.get("also", [])]


@dataclass
class RunRecord:
    """The run's status is `running` while a coordinator works on it (with its pid and host, so `status` can tell
    when that process is gone) and always ends `succeeded`, `failed` or `cancelled`."""

    run_id: str
    stages: dict[str, dict] = field(default_factory=dict)
    status: str = "new"
    owner: dict = field(default_factory=dict)
    error: str | None = None
    # the stages as last read or written by this process, and the stages it changed: what `save` merges against
    base: dict[str, dict] = field(default_factory=dict, repr=False)
    touched: set[str] = field(default_factory=set, repr=False)
    # a registry of imports (`models import`): a new artifact for a stage keeps the earlier good ones in `also`
    accumulate: bool = field(default=False, repr=False)
    witnesses: dict[str, dict] = field(default_factory=dict)
    witnessed: set[str] = field(default_factory=set, repr=False)  # addresses this process witnessed: ours win a merge

    def __post_init__(self) -> None:
        self.base = copy.deepcopy(self.stages)

    def to_json(self) -> bytes:
        doc = {
            "run_id": self.run_id,
            "updated_at": datetime.now(UTC).isoformat(),
            "status": self.status,
            "owner": self.owner,
            "error": self.error,
            "stages": self.stages,
            "witnesses": self.witnesses,
        }
        return json.dumps(redact_values(doc), indent=2, ensure_ascii=False).encode()

    def set_stage(self, store: ArtifactStore, stage: str, artifact_uri: str, status: str, **extra) -> None:
        """Record an attempt. An attempt that is not (yet) good never replaces the stage's last good artifact:
        it is kept as `last_good`, so downstream stages still find it and gc never counts it unreferenced."""
        address = store.relative(artifact_uri)
        previous = self.stages.get(stage) or {}
        good = previous.get("artifact") if previous.get("status") in GOOD else previous.get("last_good")
        entry = {"artifact": address, "status": status, **extra}
        if status not in GOOD and good and good != address:
            entry["last_good"] = good
        earlier = [*previous.get("also", []), *([good] if self.accumulate and good else [])]
        if also := [a for a in dict.fromkeys(earlier) if a not in (address, entry.get("last_good"))]:
            entry["also"] = also
        self.stages[stage] = entry
        self.touched.add(stage)

    def witness(self, store: ArtifactStore, artifact_uri: str, data_dir: str, manifest_sha256: str) -> None:
        """Record which publish of the artifact this run produced or reused (its data folder and manifest digest)."""
        address = store.relative(artifact_uri)
        self.witnesses[address] = {"data_dir": data_dir, "manifest_sha256": manifest_sha256}
        self.witnessed.add(address)

    def merge(self, disk: RunRecord) -> None:
        """Fold in what other processes wrote since this one last read or wrote the record (see the module doc)."""
        for stage, theirs in disk.stages.items():
            mine, base = self.stages.get(stage), self.base.get(stage)
            if theirs == base:
                continue
            if mine == base:
                self.stages[stage] = theirs
                continue
            keep = {mine["artifact"], mine.get("last_good")}
            also = [a for a in dict.fromkeys([*mine.get("also", []), *_good_addresses(theirs)]) if a not in keep]
            if also:
                mine["also"] = also
        self.witnesses = {**disk.witnesses, **{a: self.witnesses[a] for a in self.witnessed if a in self.witnesses}}

    def save(self, store: ArtifactStore, close: str | None = None) -> None:
        """Write the record under its lock, merged with what is there now (never a lost artifact); `close`: end
        the attempts left running with that status (`close_running`), after the merge."""
        lock = record_lock(store, self.run_id)
        lock.acquire()
        try:
            try:
                data = store.read_run_record(self.run_id)
            except NotFound:
                data = None
            # a damaged record is what `load` sets aside; this write replaces it with a whole one
            with contextlib.suppress(DamagedRecord):
                if data is not None:
                    self.merge(RunRecord.from_doc(parse_record(data, store.run_record_key(self.run_id))))
            if close is not None:
                self.close_running(close)
            self.stages = redact_values(self.stages)  # as written, so the next merge compares like with like
            store.write_run_record(self.run_id, self.to_json())
            self.base = copy.deepcopy(self.stages)
        finally:
            lock.release()

    def close_running(self, status: str) -> None:
        """Attempts left `running` end with `status`: this process's, and those of a process that is gone (killed
        or crashed); a live process's running stage, here or on another host, is its own to end."""
        for name, info in self.stages.items():
            if info.get("status") == "running" and (name in self.touched or not owner_alive(info.get("owner"))):
                info["status"] = status
                info.pop("owner", None)

    @classmethod
    def from_doc(cls, doc: RecordDoc) -> RunRecord:
        return cls(
            run_id=doc.run_id,
            stages={k: v.model_dump(exclude_defaults=True) for k, v in doc.stages.items()},
            status=doc.status,
            owner=doc.owner,
            error=doc.error,
            witnesses={k: v.model_dump() for k, v in doc.witnesses.items()},
        )

    @classmethod
    def load(cls, store: ArtifactStore, run_id: str) -> RunRecord:
        """The record, or a fresh one; a damaged record is reported in one line and moved aside, never raised."""
        key = store.run_record_key(run_id)
        try:
            data = store.backend.read_bytes(key)
        except NotFound:
            return cls(run_id=run_id)
        try:
            return cls.from_doc(parse_record(data, f"{store.backend.uri}/{key}"))
        except DamagedRecord as exc:
            aside = set_aside(store, key, data)
            log.warning("%s; moved to %s, starting a fresh record", exc, aside)
            print(f"warning: {exc}; moved it to {aside}, starting a fresh record", flush=True)
            return cls(run_id=run_id)


def set_aside(store: ArtifactStore, key: str, data: bytes) -> str:
    """Keep a damaged record's bytes beside it (for a post-mortem) and free its key."""
    aside = f"{key}.damaged-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    store.backend.write_bytes(aside, data)
    store.backend.delete(key)
    return f"{store.backend.uri}/{aside}"


def good_artifacts(store: ArtifactStore, run_id: str) -> dict[str, str]:
    """stage → the artifact the run produced or reused (a stage whose latest attempt failed: its last good one), as
    a URI in this store, wherever it now is."""
    stages = RunRecord.load(store, run_id).stages.items()
    good = {name: s["artifact"] if s.get("status") in GOOD else s.get("last_good") for name, s in stages}
    return {name: store.resolve(address) for name, address in good.items() if address}


def run_artifact(run_id: str, store: str, stage: str, endpoint: str | None = None) -> str:
    """The artifact a run produced (or reused) for `stage`, from its run record."""
    found = good_artifacts(ArtifactStore(store, endpoint), run_id)
    if stage not in found:
        raise ConfigError(
            f"run {run_id!r} in store {store} has no {stage} artifact (run the pipeline first, or pass "
            "the artifact URI)"
        )
    return found[stage]  # store-relative in the record: wherever the store now is
