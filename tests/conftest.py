from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import factories
import seaweed


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = factories.data_root()
    os.environ.setdefault("DILFORGE_DATA", str(root))
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on 127.0.0.1 for the whole session."""
    server = seaweed.start(tmp_path_factory.mktemp("seaweed"))
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket; returns its s3:// URI."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, data_root) -> Path:
    return factories.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return factories.build_tiny_llama(tmp_path_factory.mktemp("llama") / "model", tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder. For now: DILFORGE_SMOLLM2_DIR or /work/cache/smollm2-hf,
    skipping otherwise; the lead replaces this with the project's importer (fetch + convert + cache)."""
    path = Path(os.environ.get("DILFORGE_SMOLLM2_DIR", "/work/cache/smollm2-hf"))
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 HF folder not found at {path} (set DILFORGE_SMOLLM2_DIR)")
    return path
