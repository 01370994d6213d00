"""The shell blocks of README.md, docs/serve.md and docs/containers.md run as written from a fresh clone
(issue 32), on az-tiny where they name the main job: every command is either run here or skipped by a rule
that says where it is run instead (CI's own steps, tests/docker) or why it cannot run here (a cloud account).
A new command in those blocks fails `test_every_command_is_run_or_skipped_for_a_reason` until classified."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/serve.md", "docs/containers.md")

# (pattern, why it is not run here); the first match wins
SKIPPED = [
    (r"^bash scripts/setup\.sh", "CI's first step runs the setup (.ci/run)"),
    (r"bash scripts/test\.sh$", "this suite is that command"),
    (r"^(eval .*container-env|bash \.\./shared/tools/container-env)", "the container engine: scripts/ci_containers.sh"),
    (r"(^docker |images build)", "needs a Docker engine and images: tests/docker (scripts/ci_containers.sh)"),
    (r"--backend (compose|sagemaker-local)", "needs a Docker engine: tests/docker"),
    (r"(images push|deploy |--backend sagemaker\b)", "needs an AWS account (dry runs: tests/unit/test_sagemaker_*)"),
    (r"^curl -s localhost:8080", "the serve image: tests/docker/test_serve_image.py"),
    (r"^export AWS_DEFAULT_REGION", "an environment setting for the SageMaker local mode block"),
    (
        r"coordinator export --run",
        "az-tiny has no base model to name llama.cpp's pre-tokenizer: scripts/ci_export.sh exports the main job's",
    ),
]


def commands() -> list[tuple[str, str]]:
    """(doc, command) for every command of every ```bash block, backslash continuations joined."""
    out = []
    for doc in DOCS:
        blocks = re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                for command in re.sub(r"\s+#.*$", "", line).split(" && "):  # `a && b`: two commands
                    if command.strip():
                        out.append((doc, command.strip()))
    return out


def skip_reason(command: str) -> str | None:
    return next((why for pattern, why in SKIPPED if re.search(pattern, command)), None)


def as_tiny(command: str) -> str:
    tiny = command.replace("configs/az-small.yaml", "configs/az-tiny.yaml").replace("az-small", "az-tiny")
    # az-tiny's random model is below the assistant gate's thresholds by design: served anyway, to test serving
    return tiny + " --force" if "coordinator serve" in tiny else tiny


def test_every_command_is_run_or_skipped_for_a_reason():
    found = commands()
    assert len(found) > 10
    runnable = [c for _, c in found if skip_reason(c) is None]
    known = ("coordinator run-all", "coordinator serve", "curl -s http://127.0.0.1:8000")
    unclassified = [c for c in runnable if not any(k in c for k in known)]
    assert unclassified == [], "a documented command is neither run by this test nor skipped with a reason"
    assert any("run-all" in c for c in runnable) and any("serve --run" in c for c in runnable)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_documented_commands_run_on_az_tiny(tmp_path, data_root):
    """The run-all of the README (on az-tiny), then each documented `serve` with each documented curl."""
    env = {**os.environ, "DILFORGE_STORE": str(tmp_path / "store"), "OMP_NUM_THREADS": "1"}
    found = list(dict.fromkeys(c for _, c in commands() if skip_reason(c) is None))  # README and docs repeat some
    for command in [c for c in found if "run-all" in c]:
        args = shlex.split(as_tiny(command).replace("../shared/data", str(data_root)))
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    curls = [as_tiny(c) for c in found if c.startswith("curl -s http://127.0.0.1:8000")]
    for command in [c for c in found if "coordinator serve" in c]:
        port = free_port()
        args = shlex.split(as_tiny(command)) + ["--port", str(port), "--device", "cpu"]
        server = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert server.poll() is None, server.stdout.read()[-3000:]
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                    break
                except OSError:
                    time.sleep(0.5)
            for curl in curls:
                out = subprocess.run(
                    shlex.split(curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")),
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                ).stdout
                reply = json.loads(out)
                assert reply["model"] == "az-tiny-sft" and reply["choices"][0]["finish_reason"] in ("stop", "length")
        finally:
            server.terminate()
            server.wait(timeout=30)
    leftovers = [p for p in Path("/tmp").glob(".dilforge-serve-*") if p.stat().st_mtime > time.time() - 600]
    assert leftovers == [], "the served folder was left behind"
