"""The compose backend gives its local S3 identity to this process's clients of that endpoint only,
without writing os.environ (issue 11 item 5)."""

from __future__ import annotations

import os

from dilforge_coordinator.backends.compose import S3_ACCESS_KEY, ComposeBackend
from dilforge_coordinator.config import PipelineConfig
from dilforge_shared.store import S3Storage, endpoint_keys


def test_prepare_leaves_os_environ_alone_and_scopes_the_keys_to_the_compose_endpoint(monkeypatch, tmp_path):
    monkeypatch.delenv("DILFORGE_S3_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("DILFORGE_S3_SECRET_ACCESS_KEY", raising=False)
    backend = ComposeBackend(workdir=tmp_path, s3_port=18333, docker="docker", up=False)
    pipeline = PipelineConfig.model_validate(
        {"run_id": "r", "store": {"uri": "s3://elsewhere/store", "s3_endpoint_url": "http://other:9000"}}
    )
    before = dict(os.environ)
    assert backend.prepare(pipeline).store.uri == "s3://elsewhere/store"
    assert dict(os.environ) == before
    assert endpoint_keys("http://127.0.0.1:18333/")["aws_access_key_id"] == S3_ACCESS_KEY
    assert endpoint_keys("http://other:9000") == {}
    client = S3Storage("b", "p", "http://127.0.0.1:18333").client
    assert client._request_signer._credentials.access_key == S3_ACCESS_KEY


def test_user_store_keys_win_over_the_compose_identity(monkeypatch, tmp_path):
    monkeypatch.setenv("DILFORGE_S3_ACCESS_KEY_ID", "user-key-id")
    monkeypatch.setenv("DILFORGE_S3_SECRET_ACCESS_KEY", "user-secret-key")
    ComposeBackend(workdir=tmp_path, s3_port=18334, docker="docker", up=False).prepare(
        PipelineConfig.model_validate({"run_id": "r", "store": {"uri": "s3://b/s", "s3_endpoint_url": "http://o:1"}})
    )
    assert endpoint_keys("http://127.0.0.1:18334")["aws_access_key_id"] == "user-key-id"


def test_the_image_tag_of_a_run_never_moves_the_s3_server():
    """DILFORGE_IMAGE_TAG (the compose backend sets it per run) names the stage images only: the S3 service's
    image is tagged by its own variable, so an unknown tag cannot rebuild or recreate a running S3."""
    from pathlib import Path

    import yaml

    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "compose.yaml").read_text())
    assert "DILFORGE_IMAGE_TAG" not in compose["services"]["s3"]["image"]
    assert compose["services"]["s3"]["image"] == "dilforge-s3:${DILFORGE_S3_IMAGE_TAG:-dev}"
    stages = [name for name, svc in compose["services"].items() if "stages" in svc.get("profiles", [])]
    assert stages and all("DILFORGE_IMAGE_TAG" in compose["services"][s]["image"] for s in stages)
