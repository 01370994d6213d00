"""The image entrypoint (docker/entrypoint.py): SIGTERM reaches the stage, exit codes pass through, every host
runs the stage's `train` (cpt launches torchrun itself), single-host stages idle on other hosts."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.py"

spec = importlib.util.spec_from_file_location("dilforge_entrypoint", ENTRYPOINT)
ep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ep)

PROBE = """
import os, signal, sys, time, pathlib
root = pathlib.Path(os.environ["DILFORGE_OPT_ML"])
if os.environ.get("PROBE_HANDLE") == "1":
    def handler(signum, frame):
        (root / "got-sigterm").write_text("checkpointed")
        sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
    signal.signal(signal.SIGTERM, handler)
(root / "argv").write_text(" ".join(sys.argv[1:]))
(root / "ready").write_text("1")
time.sleep(60)
"""


def _start(tmp_path: Path, **env) -> subprocess.Popen:
    (tmp_path / "sigprobe.py").write_text(PROBE)
    opt = tmp_path / "opt"
    opt.mkdir(exist_ok=True)
    full = {
        **os.environ,
        "DILFORGE_STAGE": "sft",
        "DILFORGE_STAGE_MODULE": "sigprobe",
        "DILFORGE_OPT_ML": str(opt),
        "PYTHONPATH": str(tmp_path),
        **env,
    }
    proc = subprocess.Popen([sys.executable, str(ENTRYPOINT), "train"], env=full)
    deadline = time.time() + 30
    while not (opt / "ready").exists():
        assert proc.poll() is None and time.time() < deadline, "probe stage did not start"
        time.sleep(0.05)
    return proc


def test_sigterm_is_forwarded_and_the_stage_exit_code_returned(tmp_path):
    proc = _start(tmp_path, PROBE_HANDLE="1", PROBE_EXIT="3")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 3
    assert (tmp_path / "opt" / "got-sigterm").read_text() == "checkpointed"
    assert (tmp_path / "opt" / "argv").read_text() == "train"


EARLY_SIGTERM = """
import importlib.util, os, signal, subprocess, sys
spec = importlib.util.spec_from_file_location("ep", sys.argv[1])
ep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ep)
real = subprocess.Popen

def popen(*args, **kwargs):  # the stop arrives while the stage is being started
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

ep.subprocess.Popen = popen
sys.exit(ep.supervise([sys.executable, sys.argv[2]], dict(os.environ)))
"""


def test_a_sigterm_before_the_stage_started_is_held_and_forwarded(tmp_path):
    """SIGTERM that reaches the entrypoint while it starts the stage is forwarded once the stage runs: the stage
    stops and its status comes back (143), instead of the entrypoint dying of it with the stage left running."""
    (tmp_path / "sigprobe.py").write_text(PROBE)
    opt = tmp_path / "opt"
    opt.mkdir()
    env = {**os.environ, "DILFORGE_OPT_ML": str(opt)}
    proc = subprocess.run(
        [sys.executable, "-c", EARLY_SIGTERM, str(ENTRYPOINT), str(tmp_path / "sigprobe.py")],
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "forwarding SIGTERM to the stage" in proc.stderr


def test_stage_killed_by_sigterm_exits_143(tmp_path):
    proc = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM


def test_other_commands_are_executed_as_given(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ENTRYPOINT), "python3", "-c", "print('hello')"],
        capture_output=True,
        text=True,
        env={**os.environ, "DILFORGE_STAGE": "eval"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "hello"


def _opt(tmp_path: Path, current: str, hosts: list[str], instance_type: str | None = None) -> dict[str, str]:
    cfg = tmp_path / current / "input" / "config"
    cfg.mkdir(parents=True)
    rc = {"current_host": current, "hosts": hosts, "network_interface_name": "eth0"}
    if instance_type:
        rc["current_instance_type"] = instance_type
    (cfg / "resourceconfig.json").write_text(json.dumps(rc))
    return {"DILFORGE_OPT_ML": str(tmp_path / current)}


def test_stage_launcher_by_default_and_single_host_stages(tmp_path):
    cpt_env = _opt(tmp_path / "a", "algo-2", ["algo-1", "algo-2"])
    cmd, _ = ep.plan("cpt", cpt_env)  # cpt starts torchrun itself; every host runs its `train`
    assert cmd[1:] == ["-m", "dilforge_cpt", "train"]
    cmd, desc = ep.plan("eval", _opt(tmp_path / "b", "algo-2", ["algo-1", "algo-2"]))
    assert cmd is None and "first host only" in desc
    cmd, _ = ep.plan("eval", _opt(tmp_path / "c", "algo-1", ["algo-1", "algo-2"]))
    assert cmd[1:] == ["-m", "dilforge_eval", "train"]


def test_bad_resourceconfig_leaves_a_failure_file(tmp_path):
    opt = tmp_path / "opt"
    (opt / "input" / "config").mkdir(parents=True)
    (opt / "input" / "config" / "resourceconfig.json").write_text(json.dumps({"hosts": ["algo-1"]}))
    out = subprocess.run(
        [sys.executable, str(ENTRYPOINT), "train"],
        capture_output=True,
        text=True,
        env={**os.environ, "DILFORGE_STAGE": "sft", "DILFORGE_OPT_ML": str(opt)},
    )
    assert out.returncode == 1
    failure = (opt / "output" / "failure").read_text()
    assert "resourceconfig.json" in failure and "current_host" in failure


@pytest.mark.parametrize("argv", [[]])
def test_no_command_is_usage(argv):
    assert ep.main(argv) == 2
