"""The serving image as SageMaker runs it: `docker run IMAGE serve` with the artifact in /opt/ml/model (read-only
here) answers GET /ping and POST /invocations on port 8080. Needs Docker and `coordinator images build --stage
serve` (scripts/ci_containers.sh does both)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import publish
from docker_stack import DOCKER

pytestmark = [pytest.mark.docker, pytest.mark.slow]
IMAGE = "dilforge-serve:dev"


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as res:
            return res.status, json.loads(res.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@pytest.fixture(scope="module")
def container(tmp_path_factory, tiny_llama_dir):
    missing = pytest.fail if os.environ.get("DILFORGE_REQUIRE_DOCKER") else pytest.skip
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        missing("no Docker engine (run ../shared/tools/container-env.sh)")
    if subprocess.run([DOCKER, "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        missing(f"{IMAGE} not built (coordinator images build --stage serve)")
    # the tiny Llama published as a model artifact (no training: the CPU budget of the docker step is small;
    # SFT artifacts are served in tests/integration/test_serve.py)
    artifact_dir = tmp_path_factory.mktemp("serve-image") / "store/artifacts/cpt/tiny0000"
    publish(
        str(artifact_dir),
        tiny_llama_dir,
        Manifest(
            code_version="test",
            kind="model",
            artifact_id="tiny0000",
            run_id="az-tiny",
            stage="cpt",
            producer=current_producer("dilforge-test"),
            config={},
            data_dir="pending",
            files=[],
        ),
    )  # manifest.json + data-*/, as SageMaker copies it to /opt/ml/model
    name = f"dilforge-serve-test-{uuid.uuid4().hex[:8]}"
    run = subprocess.run(
        [
            DOCKER,
            "run",
            "-d",
            "--rm",
            "--name",
            name,
            "-p",
            "127.0.0.1::8080",
            "-v",
            f"{artifact_dir}:/opt/ml/model:ro",
            "-e",
            "OMP_NUM_THREADS=1",
            IMAGE,
            "serve",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    try:
        port = (
            subprocess.run([DOCKER, "port", name, "8080/tcp"], capture_output=True, text=True, check=True)
            .stdout.split(":")[-1]
            .strip()
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if http(f"{base}/ping", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(1)
        else:
            logs = subprocess.run([DOCKER, "logs", name], capture_output=True, text=True)
            pytest.fail(f"/ping never answered:\n{(logs.stdout + logs.stderr)[-3000:]}")
        yield base, name
    finally:
        subprocess.run([DOCKER, "rm", "-f", name], capture_output=True)


def test_ping_and_invocations_on_8080_from_opt_ml_model(container):
    base, name = container
    assert http(f"{base}/ping")[0] == 200
    code, res = http(f"{base}/invocations", {"messages": [{"role": "user", "content": "Salam!"}], "max_tokens": 4})
    assert code == 200, res
    assert res["object"] == "chat.completion" and res["model"] == "az-tiny-cpt"
    assert res["choices"][0]["message"]["role"] == "assistant" and res["usage"]["completion_tokens"] >= 1
    code, res = http(f"{base}/invocations", {"messages": []})
    assert code == 400 and res["error"]["message"].startswith("messages should have at least 1 item"), res
    logs = subprocess.run([DOCKER, "logs", name], capture_output=True, text=True)
    assert "model id: az-tiny-cpt" in logs.stdout + logs.stderr


def test_the_images_processes_get_the_expandable_segments_allocator(container):
    """What torch's CUDA allocator reads at start-up, in the running container (the layer is the stage images'
    too: test_images_build checks the shared layers are identical): fewer fragmentation OOMs on GPU."""
    _, name = container
    code = "import os; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    out = subprocess.run([DOCKER, "exec", name, "python3", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "expandable_segments:True"
