"""The coordinator owns its stage processes (issue 12 item 4), through the real CLI and the local backend.

The stage is a stand-in run through the real container contract (`stage_main`): it logs its start and what
it read from stdin, polls the SIGTERM flag like CPT does, checkpoints and stops when asked, else publishes
after FAKE_SECONDS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import metrics_samples
import psutil
import pytest

FAKE_STAGE = """
import json, os, sys, time
from pathlib import Path
from dilforge_coordinator.config import STAGE_CONFIGS
from dilforge_shared.contract import StageResult, Terminated, install_sigterm_handler, stage_main

def body(config, ctx):
    flag = install_sigterm_handler()
    log = Path(os.environ["FAKE_LOG"])
    stdin = sys.stdin.read()
    with open(log, "a") as f:
        f.write(f"start {os.getpid()} stdin={stdin!r}\\n")
    deadline = time.time() + float(os.environ.get("FAKE_SECONDS", "0"))
    while time.time() < deadline:
        if flag["stop"]:
            ctx.opt.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            (ctx.opt.checkpoint_dir / "step").write_text("checkpoint")
            with open(log, "a") as f:
                f.write("checkpointed\\n")
            raise Terminated("stopped by SIGTERM after checkpointing")
        time.sleep(0.05)
    (ctx.opt.model_dir / "out.txt").write_text("done")
    with open(log, "a") as f:
        f.write("published\\n")
    return StageResult(metrics=json.loads(os.environ["FAKE_METRICS"]))

if __name__ == "__main__":
    from dilforge_shared import identity
    identity.STAGE_MODULES["tokenizer"] = "fakestage"  # as the driver: the code version is this module's
    sys.exit(stage_main(STAGE_CONFIGS["tokenizer"], body, "fake", sys.argv[1:]))
"""

DRIVER = """
import sys
from dilforge_coordinator import pipeline
pipeline.STAGE_MODULES["tokenizer"] = "fakestage"
from dilforge_coordinator.cli import app
app(args=sys.argv[1:])
"""


@pytest.fixture
def world(tmp_path):
    (tmp_path / "fakestage.py").write_text(FAKE_STAGE)
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "corpus.txt").write_text("bir iki üç\n")
    for run_id in ("a", "b"):
        (tmp_path / f"{run_id}.yaml").write_text(
            textwrap.dedent(f"""
            run_id: {run_id}
            store: {{uri: {tmp_path / "store"}}}
            tokenizer: {{strategy: replace, corpora: [{{uri: "{tmp_path / "corpus.txt"}"}}], vocab_sizes: [1000]}}
        """)
        )
    return tmp_path


def start(world: Path, run_id: str = "a", seconds: float = 0, stdin: bytes | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": f"{world}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "FAKE_LOG": str(world / "stage.log"),
        "FAKE_SECONDS": str(seconds),
        "FAKE_METRICS": json.dumps(metrics_samples.TOKENIZER),
        "DILFORGE_WORKDIR": str(world / "work"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, str(world / "driver.py"), "run-all", "-c", str(world / f"{run_id}.yaml")],
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.flush()
    return proc


def wait_for(world: Path, text: str, timeout: float = 60) -> list[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = (world / "stage.log").read_text() if (world / "stage.log").exists() else ""
        if text in log:
            return log.splitlines()
        time.sleep(0.05)
    raise AssertionError(f"stage never logged {text!r}")


def record(world: Path, run_id: str = "a") -> dict:
    return json.loads((world / "store" / "runs" / f"{run_id}.json").read_text())


def test_a_stage_never_reads_the_users_stdin(world):
    proc = start(world, stdin=b"y\ny\ny\n")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert "stdin=''" in wait_for(world, "start")[0]
    assert record(world)["status"] == "succeeded"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_is_forwarded_stage_checkpoints_and_record_says_cancelled(world, sig):
    proc = start(world, seconds=60)
    stage_pid = int(wait_for(world, "start")[0].split()[1])
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode() and "cancelled" in err.decode()
    assert "checkpointed" in wait_for(world, "checkpointed")
    assert not psutil.pid_exists(stage_pid) or psutil.Process(stage_pid).status() == psutil.STATUS_ZOMBIE
    rec = record(world)
    assert rec["status"] == "cancelled" and rec["stages"]["tokenizer"]["status"] == "cancelled"
    assert not list((world / "store").glob("artifacts/*/*/manifest.json"))
    assert list((world / "work").glob("tokenizer-*/checkpoints/step")), "the work folder is kept for resuming"


def test_kill_9_of_the_coordinator_stops_the_stage_and_a_rerun_waits_then_resumes(world):
    proc = start(world, seconds=60)
    stage_pid = int(wait_for(world, "start")[0].split()[1])
    proc.kill()
    proc.wait(10)
    rerun = start(world, seconds=0)  # immediately: the orphan may still be checkpointing
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err.decode()
    log = wait_for(world, "published")
    assert log[:2] == [log[0], "checkpointed"], log
    assert log[2].startswith("start") and log[3] == "published", "the rerun started after the orphan stopped"
    assert not psutil.pid_exists(stage_pid) or psutil.Process(stage_pid).status() == psutil.STATUS_ZOMBIE
    assert record(world)["status"] == "succeeded"


def test_two_runs_started_apart_share_one_stage_process_and_both_succeed(world):
    first = start(world, "a", seconds=3)
    time.sleep(0.7)
    second = start(world, "b", seconds=3)
    results = [p.communicate(timeout=120) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, [r[1].decode()[-2000:] for r in results]
    assert sum(line.startswith("start") for line in wait_for(world, "published")) == 1
    statuses = {r: record(world, r)["stages"]["tokenizer"]["status"] for r in ("a", "b")}
    assert statuses == {"a": "produced", "b": "reused"}
    assert "waiting" in results[1][0].decode()


@pytest.mark.parametrize("case", ["bad_endpoint", "bad_secret"])
def test_chat_with_a_bad_endpoint_or_secret_is_one_line(case, tmp_path, s3_server, s3_bucket):
    """The installed `coordinator` script: an S3 error in any command (chat here) is one line, exit 1."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{closed_port}" if case == "bad_endpoint" else s3_server.endpoint_url
    env = {
        **os.environ,
        "DILFORGE_S3_MAX_ATTEMPTS": "1",
        "DILFORGE_S3_ACCESS_KEY_ID": "dilforge-test",
        "DILFORGE_S3_SECRET_ACCESS_KEY": "wrong-secret-value",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "coordinator"),
            "chat",
            f"{s3_bucket}/model",
            "-p",
            "hi",
            "--s3-endpoint-url",
            endpoint,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "wrong-secret-value" not in proc.stderr
