"""docker/pip-install.sh VARIANT=gpu keeps the base image's (AWS DLC) core stack: dropped from the lock,
pinned as constraints at the image's versions, and the build fails if an install changed it anyway."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "pip-install.sh"
DLC = "Torch==2.9.0+cu130\nnumpy==2.1.3\npandas==2.2.3\nnvidia_cudnn_cu13==9.13.0.50\nboto3==1.40.0\n"

# a stand-in python3: `-m pip list` prints the installed set from $STATE, `-m pip install` records its
# arguments and the lock it got, and, when $UPGRADE is set, "upgrades" numpy as a careless pin would
FAKE_PYTHON = """#!/bin/sh
if [ "$3" = list ]; then cat "$STATE"; exit 0; fi
echo "$@" > "$LOG"
for a in "$@"; do case "$prev" in -r) cat "$a" > "$LOG.lock";; -c) cat "$a" > "$LOG.constraints";; esac; prev="$a"; done
if [ -n "${UPGRADE:-}" ]; then sed -i 's/numpy==2.1.3/numpy==2.4.6/' "$STATE"; fi
exit 0
"""


def run_install(tmp_path: Path, variant: str, upgrade: bool = False) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    (tmp_path / "state").write_text(DLC)
    lock = tmp_path / "req.lock"
    lock.write_text(
        "torch==2.13.0\nnumpy==2.4.6\npandas==3.0.1\ntransformers==5.24.0\nliger-kernel==0.7.0\n"
        "nvidia-cudnn-cu13==9.14.0\ntriton==3.7.0\n"
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STATE": str(tmp_path / "state"),
        "LOG": str(tmp_path / "log"),
        "VARIANT": variant,
        **({"UPGRADE": "1"} if upgrade else {}),
    }
    return subprocess.run(["sh", str(SCRIPT), "-r", str(lock)], env=env, capture_output=True, text=True, check=False)


def test_gpu_variant_resolves_against_the_dlc_core_stack(tmp_path):
    res = run_install(tmp_path, "gpu")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "log.lock").read_text().split() == ["transformers==5.24.0", "liger-kernel==0.7.0"]
    constraints = (tmp_path / "log.constraints").read_text().split()
    assert constraints == ["numpy==2.1.3", "nvidia-cudnn-cu13==9.13.0.50", "pandas==2.2.3", "torch==2.9.0+cu130"]


def test_gpu_variant_fails_when_the_install_changes_the_dlc_stack(tmp_path):
    res = run_install(tmp_path, "gpu", upgrade=True)
    assert res.returncode == 1
    assert "changed the base image's core stack" in res.stderr and "numpy==2.4.6" in res.stderr


def test_cpu_variant_keeps_torch_and_numpy_pins_and_drops_cuda_only(tmp_path):
    res = run_install(tmp_path, "cpu")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "log.lock").read_text().split() == [
        "torch==2.13.0",
        "numpy==2.4.6",
        "pandas==3.0.1",
        "transformers==5.24.0",
    ]
    assert not (tmp_path / "log.constraints").exists()
