"""The compose backend's bucket set-up (botocore waiter instead of a hand-written retry loop), against the real
SeaweedFS server of the test session."""

from __future__ import annotations

import uuid

import pytest
from dilforge_coordinator.backends.compose import ensure_bucket
from dilforge_shared.errors import DilforgeError


def test_ensure_bucket_creates_once_and_accepts_an_existing_bucket(s3_server):
    client = s3_server.client()
    name = f"c-{uuid.uuid4().hex[:12]}"
    ensure_bucket(client, name, timeout_s=10)
    client.put_object(Bucket=name, Key="k", Body=b"v")
    ensure_bucket(client, name, timeout_s=10)  # second start of the same compose project
    assert client.get_object(Bucket=name, Key="k")["Body"].read() == b"v"


def test_ensure_bucket_names_the_bucket_it_cannot_create(s3_server):
    with pytest.raises(DilforgeError, match="cannot create bucket 'Bad_Name'"):
        ensure_bucket(s3_server.client(), "Bad_Name", timeout_s=2)
