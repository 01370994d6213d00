"""Issue 12 on a real S3 (SeaweedFS on loopback): leases, content-keyed model cache, damaged artifacts, gc."""

from __future__ import annotations

import json
import time
from pathlib import Path

import factories
from dilforge_coordinator import gc
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_coordinator.leases import S3Lease
from dilforge_coordinator.records import ArtifactStore
from dilforge_shared.manifest import MANIFEST_NAME
from dilforge_shared.models import open_model
from dilforge_shared.store import open_backend, publish


def _put(s3_server, uri: str, key: str, body: bytes) -> None:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/{key}".lstrip("/"), Body=body)


def test_s3_lease_excludes_a_second_owner_and_an_expired_one_is_taken_over(s3_bucket, s3_server):
    backend = open_backend(s3_bucket)
    first = S3Lease(backend, "locks/cpt-1.lock", lease_s=1.5, poll_s=0.1)
    assert first.acquire(wait=False)
    second = S3Lease(backend, "locks/cpt-1.lock", lease_s=1.5, poll_s=0.1)
    assert not second.acquire(wait=False)
    first.release()
    assert second.acquire(wait=False), "a released lock is free at once"
    second._stop.set()  # the owner dies: nobody renews the lease
    third = S3Lease(backend, "locks/cpt-1.lock", lease_s=1.5, poll_s=0.1)
    assert not third.acquire(wait=False), "an unexpired lease blocks until it expires"
    time.sleep(1.6)
    assert third.acquire(wait=False), "an expired lease belongs to a dead owner"
    third.release()


def test_changed_weights_under_the_same_s3_prefix_are_downloaded_again(s3_bucket, s3_server, tmp_path):
    uri = f"{s3_bucket}/models/tiny"
    _put(s3_server, uri, "config.json", b'{"model_type": "llama"}')
    _put(s3_server, uri, "model.safetensors", b"old weights")
    first = open_model(uri, cache_dir=tmp_path / "cache")
    assert (first.path / "model.safetensors").read_bytes() == b"old weights"
    _put(s3_server, uri, "model.safetensors", b"new weights, same size?")
    second = open_model(uri, cache_dir=tmp_path / "cache")
    assert (second.path / "model.safetensors").read_bytes() == b"new weights, same size?"


def _config(tmp_path: Path, store: str) -> Path:
    (tmp_path / "corpus.txt").write_text("bir iki üç\n")
    path = tmp_path / "p.yaml"
    path.write_text(
        f"run_id: s3run\nstore: {{uri: {store}}}\ntokenizer: {{strategy: replace, corpora: "
        f"[{{uri: '{tmp_path / 'corpus.txt'}'}}], vocab_sizes: [1000]}}\n"
    )
    return path


class S3Publishing:
    name = "fake"

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.runs = tmp_path, 0

    def run(self, job):
        self.runs += 1
        out = self.tmp_path / f"out{self.runs}"
        out.mkdir()
        (out / "tokenizer.json").write_text('{"v": 1}')
        publish(job.artifact_uri, out, factories.job_manifest(job, "tokenizer"))


def test_damaged_s3_artifact_is_moved_aside_and_rebuilt_and_gc_finds_orphans(s3_bucket, s3_server, tmp_path):
    cfg = load_pipeline(_config(tmp_path, f"{s3_bucket}/store"))
    backend = S3Publishing(tmp_path)
    uri = pl.run_all(cfg, backend)["tokenizer"]
    art = open_backend(uri)
    manifest = json.loads(art.read_bytes(MANIFEST_NAME))
    art.delete(f"{manifest['data_dir']}/tokenizer.json")
    assert "missing" in check_artifact(uri)
    assert pl.run_all(cfg, backend)["tokenizer"] == uri and backend.runs == 2
    assert check_artifact(uri) is None
    art.write_bytes("data-0badc0ffee00/partial.bin", b"x")  # a publish killed before its manifest
    store = ArtifactStore(f"{s3_bucket}/store")
    found = {(g.kind, g.uri.rsplit("/", 1)[-1]) for g in gc.find_store_garbage(store, 0, unreferenced=False)}
    assert ("orphan-data", "data-0badc0ffee00") in found
    assert any(kind == "damaged" for kind, _ in found)
    for item in gc.find_store_garbage(store, 0, unreferenced=False):
        item.remove()
    assert not gc.find_store_garbage(store, 0, unreferenced=False)
    assert check_artifact(uri) is None
