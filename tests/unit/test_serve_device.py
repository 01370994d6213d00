"""`serve --device` and `--dtype`: a device this machine does not have, or a dtype the server cannot load, is one
error line naming the flag, before anything is resolved or loaded (it was a stack trace from inside model loading)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from dilforge_serve.cli import device_error, main


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_auto_and_cpu_are_always_taken(device):
    assert device_error(device) is None


def test_a_cuda_device_on_a_machine_without_one_names_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_error("cuda:7") == (
        "--device cuda:7: this machine has no CUDA GPU that torch can use; use --device cpu or auto"
    )
    assert "no CUDA GPU" in device_error("cuda")


def test_a_gpu_index_past_the_machine_names_the_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_error("cuda:7") == "--device cuda:7: this machine has 2 CUDA GPU(s), cuda:0 to cuda:1"
    assert device_error("cuda:1") is None


@pytest.mark.parametrize("device", ["gpu7", "cuda:x", ""])
def test_a_name_that_is_no_device_is_refused(device):
    assert "is not a device: use auto, cpu, cuda or cuda:N" in device_error(device)


def test_the_command_stops_before_resolving_the_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([str(tmp_path / "no-such-model"), "--device", "cuda:7", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == "error: --device cuda:7: this machine has no CUDA GPU that torch can use; use --device cpu or auto\n"
    assert list(tmp_path.iterdir()) == []  # nothing made in --workdir


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_coordinator_serve_on_a_cpu_machine_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", "serve", str(tmp_path), "--device", "cuda:7", "--force"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --device cuda:7: this machine has no CUDA GPU that torch can use; use --device cpu or auto"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("dtype", ["float7", "int8", ""])
def test_a_dtype_the_server_cannot_load_is_one_line(tmp_path, capsys, dtype):
    assert main([str(tmp_path / "no-such-model"), "--device", "cpu", "--dtype", dtype, "--workdir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: --dtype {dtype!r} is not one of auto, bfloat16, float16, float32\n"


@pytest.mark.parametrize(("flag", "env"), [(["--port", "70000"], {}), ([], {"SAGEMAKER_BIND_TO_PORT": "abc"})])
def test_a_port_that_is_no_port_is_one_line(tmp_path, capsys, monkeypatch, flag, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main([str(tmp_path / "m"), "--device", "cpu", "--workdir", str(tmp_path), *flag]) == 1
    assert capsys.readouterr().err.endswith("is not a port number (1 to 65535)\n")
