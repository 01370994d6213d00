"""Run records are written under a lock and merged: two processes on one run id (two `run-all`, two `models import`
with the default id) both keep their artifacts, and gc never counts either unreferenced."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import factories
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import PipelineConfig, load_pipeline
from dilforge_coordinator.records import ArtifactStore, RunRecord, record_lock, running_owner
from dilforge_shared.configs import validate_model
from dilforge_shared.store import publish
from test_reliability import PublishingBackend, write_config
from typer.testing import CliRunner


def _config(tmp_path: Path, corpus: str):
    """Run id `demo` in one store, on a corpus of its own (so a different tokenizer artifact)."""
    folder = tmp_path / corpus
    folder.mkdir()
    path = write_config(folder)
    (folder / "corpus.txt").write_text(f"{corpus} bir iki üç\n")
    return load_pipeline(path, {"store.uri": str(tmp_path / "store")})


def _unreferenced(tmp_path: Path) -> str:
    args = ["gc", "--store", str(tmp_path / "store"), "--workdir", str(tmp_path / "w"), "--unreferenced"]
    result = CliRunner().invoke(app, [*args, "--min-age-minutes", "0"])
    assert result.exit_code == 0, result.output
    return result.output


def test_two_concurrent_runs_of_one_run_id_both_keep_their_artifacts(tmp_path):
    a, b = _config(tmp_path, "a"), _config(tmp_path, "b")
    results, errors = {}, []

    def run(name, cfg):
        try:
            results[name] = pl.run_all(cfg, PublishingBackend(delay_s=0.5))["tokenizer"]
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results["a"] != results["b"]
    entry = json.loads((tmp_path / "store" / "runs" / "demo.json").read_text())["stages"]["tokenizer"]
    held = {entry["artifact"], *entry.get("also", [])}
    assert held == {f"artifacts/tokenizer/{u.rsplit('/', 1)[1]}" for u in results.values()}, entry
    out = _unreferenced(tmp_path)
    assert not any(u.rsplit("/", 1)[1] in out for u in results.values()), out


def test_interleaved_saves_merge_instead_of_overwriting(tmp_path):
    """Each writer loaded the record before the other saved: the later save keeps the earlier's artifact."""
    store = ArtifactStore(str(tmp_path / "store"))
    first, second = RunRecord.load(store, "models"), RunRecord.load(store, "models")
    first.set_stage(store, "model", store.artifact_uri("model", "m1"), "produced")
    first.save(store)
    second.set_stage(store, "model", store.artifact_uri("model", "m2"), "produced")
    second.save(store)
    entry = RunRecord.load(store, "models").stages["model"]
    assert entry["artifact"] == "artifacts/model/m2" and entry["also"] == ["artifacts/model/m1"]
    first.status = "succeeded"  # the first writer's last save must not drop the second's artifact either
    first.save(store)
    entry = RunRecord.load(store, "models").stages["model"]
    assert {entry["artifact"], *entry.get("also", [])} == {"artifacts/model/m1", "artifacts/model/m2"}


def test_a_stage_only_a_live_process_changed_keeps_its_entry_and_its_running_state(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    mine, theirs = RunRecord.load(store, "r"), RunRecord.load(store, "r")
    theirs.set_stage(store, "cpt", store.artifact_uri("cpt", "c1"), "running", owner=running_owner())
    theirs.set_stage(
        store, "sft", store.artifact_uri("sft", "s1"), "running", owner={"pid": 2**22 + 7, "host": socket.gethostname()}
    )
    theirs.save(store)
    mine.set_stage(store, "tokenizer", store.artifact_uri("tokenizer", "t1"), "running")
    mine.save(store, close="failed")  # this process stops: its attempt ends, and a dead process's
    stages = RunRecord.load(store, "r").stages
    assert stages["tokenizer"]["status"] == "failed" and stages["cpt"]["status"] == "running"
    assert stages["sft"]["status"] == "failed", "the attempt of a process that is gone ends too"


def test_a_record_write_waits_for_the_records_lock(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    record = RunRecord.load(store, "r")
    record.set_stage(store, "tokenizer", store.artifact_uri("tokenizer", "t1"), "produced")
    lock = record_lock(store, "r")
    lock.acquire()
    writer = threading.Thread(target=record.save, args=(store,))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive() and not (tmp_path / "store" / "runs" / "r.json").exists(), "no write without the lock"
    lock.release()
    writer.join(10)
    assert not writer.is_alive() and (tmp_path / "store" / "runs" / "r.json").exists()


class ModelPublishing:
    """Publishes a small `model` artifact for the job (what the import stage does)."""

    name = "fake"

    def run(self, job):
        out = Path(job.artifact_uri.removeprefix("file://") + ".out")
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"model_type": "llama"}')
        publish(job.artifact_uri, out, factories.job_manifest(job, "model"))


def _import_config(tmp_path: Path, name: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "name": name}))
    (folder / "model.safetensors").write_bytes(b"weights")  # what `models import` takes for a model folder
    raw = {"run_id": "models", "store": {"uri": str(tmp_path / "store")}, "model": {"source": str(folder)}}
    return validate_model(PipelineConfig, raw, "test")


def test_models_imported_one_after_another_under_the_default_run_id_all_stay_referenced(tmp_path):
    uris = [pl.run_one(_import_config(tmp_path, n), "model", ModelPublishing(), {}, accumulate=True) for n in "ab"]
    entry = json.loads((tmp_path / "store" / "runs" / "models.json").read_text())["stages"]["model"]
    assert {entry["artifact"], *entry.get("also", [])} == {f"artifacts/model/{u.rsplit('/', 1)[1]}" for u in uris}
    out = _unreferenced(tmp_path)
    assert not any(u.rsplit("/", 1)[1] in out for u in uris), out
    status = CliRunner().invoke(app, ["status", "models", "--store", str(tmp_path / "store")])
    assert status.exit_code == 0 and all(u.rsplit("/", 1)[1] in status.output for u in uris), status.output


def test_a_pipeline_run_still_replaces_its_stages_artifact(tmp_path):
    """Only a registry accumulates: a run whose config changed leaves its old artifact unreferenced, for gc."""
    first = pl.run_one(_import_config(tmp_path, "a"), "model", ModelPublishing(), {})
    pl.run_one(_import_config(tmp_path, "b"), "model", ModelPublishing(), {})
    assert first.rsplit("/", 1)[1] in _unreferenced(tmp_path)


def test_a_redacted_error_is_not_taken_for_another_writers_change(tmp_path, monkeypatch):
    """The record is written redacted; the next save compares against what was written, so an attempt whose
    error held a secret does not leave its last good artifact behind as another writer's."""
    monkeypatch.setenv("ACME_TOKEN", "tok-0123456789-secret")
    store = ArtifactStore(str(tmp_path / "store"))
    record = RunRecord.load(store, "r")
    record.set_stage(store, "tokenizer", store.artifact_uri("tokenizer", "t1"), "produced")
    record.save(store)
    record.set_stage(store, "tokenizer", store.artifact_uri("tokenizer", "t2"), "failed", error="tok-0123456789-secret")
    record.save(store)
    record.set_stage(store, "tokenizer", store.artifact_uri("tokenizer", "t2"), "produced")
    record.save(store)
    entry = RunRecord.load(store, "r").stages["tokenizer"]
    assert entry == {"artifact": "artifacts/tokenizer/t2", "status": "produced"}


def test_a_lease_of_a_killed_process_on_this_host_is_taken_over_at_once(s3_bucket):
    """An S3 store's locks are lease objects: a coordinator killed by `kill -9` renews nothing, and a rerun on the
    same host takes its artifact and record leases at once instead of waiting out the lease; a live process's, or
    another host's, it waits for."""
    import os
    import subprocess
    import sys
    import time

    from dilforge_coordinator.leases import S3Lease
    from dilforge_shared.store import open_backend

    backend = open_backend(s3_bucket)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for owner, taken in [
        ({"pid": dead.pid, "host": socket.gethostname()}, True),
        ({"pid": dead.pid, "host": "another-host"}, False),
        ({"pid": os.getppid(), "host": socket.gethostname()}, False),
    ]:
        backend.write_bytes(
            "locks/a.lock", json.dumps({**owner, "token": "t", "expires_at": time.time() + 3600}).encode()
        )
        lease = S3Lease(backend, "locks/a.lock", 3600)
        assert lease.acquire(wait=False) is taken, owner
        if taken:
            assert json.loads(backend.read_bytes("locks/a.lock"))["token"] == lease.owner["token"]
            lease.release()


def test_of_two_waiters_taking_over_one_expired_lease_exactly_one_holds_it(s3_bucket):
    """Taking over is one compare-and-swap of the version judged over, not a delete then a create: a waiter that
    read the expired lease before another took it over cannot delete the new holder's lease."""
    from dilforge_coordinator.leases import S3Lease
    from dilforge_shared.store import open_backend

    backend = open_backend(s3_bucket)
    backend.write_bytes("locks/a.lock", json.dumps({"token": "old", "host": "h", "expires_at": 0}).encode())
    stale = backend.read_versioned("locks/a.lock")[1]
    first, second = S3Lease(backend, "locks/a.lock", 3600), S3Lease(backend, "locks/a.lock", 3600)
    assert first.acquire(wait=False)
    # the second read the expired lease before the first replaced it: its takeover must fail, not win too
    assert not backend.replace_bytes("locks/a.lock", second._body(), stale)
    assert not second.acquire(wait=False)
    assert json.loads(backend.read_bytes("locks/a.lock"))["token"] == first.owner["token"]
    first.release()
