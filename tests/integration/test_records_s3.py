"""On a real S3 (SeaweedFS on loopback): run records merge under the record's lease object, an object added to a
published artifact's data prefix makes it invalid, and a manifest edited with its digest is caught by the record."""

from __future__ import annotations

import json
import threading

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_coordinator.records import ArtifactStore, RunRecord, record_lock
from dilforge_shared.errors import IntegrityError
from dilforge_shared.manifest import MANIFEST_NAME, sha256_bytes
from dilforge_shared.store import fetch, manifest_digest_key, open_backend
from test_reliability_s3 import S3Publishing, _config


def test_interleaved_record_saves_on_s3_merge_under_the_lease(s3_bucket):
    store = ArtifactStore(f"{s3_bucket}/store")
    first, second = RunRecord.load(store, "models"), RunRecord.load(store, "models")
    first.set_stage(store, "model", store.artifact_uri("model", "m1"), "produced")
    second.set_stage(store, "model", store.artifact_uri("model", "m2"), "produced")
    lock = record_lock(store, "models")
    assert lock.acquire(wait=False)
    writers = [threading.Thread(target=r.save, args=(store,)) for r in (first, second)]
    for w in writers:
        w.start()
    writers[0].join(0.5)
    assert writers[0].is_alive(), "a save waits for the record's lease"
    lock.release()
    for w in writers:
        w.join(120)  # a 2 s lease poll each; slow only on a loaded machine
    entry = RunRecord.load(store, "models").stages["model"]
    assert {entry["artifact"], *entry.get("also", [])} == {"artifacts/model/m1", "artifacts/model/m2"}


def test_an_object_added_to_an_s3_artifact_or_an_edited_manifest_is_caught(s3_bucket, tmp_path):
    cfg = load_pipeline(_config(tmp_path, f"{s3_bucket}/store"))
    uri = pl.run_all(cfg, S3Publishing(tmp_path))["tokenizer"]
    art = open_backend(uri)
    raw = json.loads(art.read_bytes(MANIFEST_NAME))
    art.write_bytes(f"{raw['data_dir']}/sub/zz-injected.jsonl", b'{"text": "POISON"}\n')
    assert "zz-injected.jsonl not listed in the manifest" in check_artifact(uri)
    with pytest.raises(IntegrityError, match="zz-injected.jsonl not listed in the manifest"):
        fetch(uri, cache_dir=tmp_path / "cache")  # what `manifest validate` runs
    art.delete(f"{raw['data_dir']}/sub/zz-injected.jsonl")
    assert check_artifact(uri) is None
    raw["metrics"] = {"edited": True}
    body = json.dumps(raw).encode()
    art.write_bytes(MANIFEST_NAME, body)
    art.write_bytes(manifest_digest_key(raw["data_dir"]), sha256_bytes(body).encode())
    assert "changed since run record" in check_artifact(uri)
