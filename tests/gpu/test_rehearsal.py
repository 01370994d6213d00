"""Checks of the device environment itself, run on CPU by the rehearsal (scripts/gpu_rehearsal.sh, in
its replica of the GPU machine's Python). scripts/gpu_check.sh imports every production module
(scripts/gpu_imports.py) before its phases, with the carried wheels; here, removing a required wheel
from the carried set must make that fail, naming the module (as pydantic-settings' absence once killed
every GPU test and bench point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = os.environ.get("DILFORGE_REHEARSAL_WHEELS")  # set by scripts/gpu_rehearsal.sh
needs_wheels = pytest.mark.skipif(not WHEELS, reason="outside the rehearsal: no carried wheel set to take apart")


def install_carried(wheels: list[Path], site: Path) -> None:
    """Exactly as scripts/gpu_check.sh installs them on the device."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *map(str, wheels),
        ],
        check=True,
        timeout=600,
    )


def imports_with(site: Path) -> subprocess.CompletedProcess:
    """scripts/gpu_imports.py with only `site` in front of the device's own packages."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_imports.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@needs_wheels
@pytest.mark.parametrize(("wheel", "module"), [("pydantic_settings", "pydantic_settings")])
def test_removing_a_required_wheel_fails_the_imports(tmp_path, wheel, module):
    carried = sorted(Path(WHEELS).glob("*.whl"))
    kept = [w for w in carried if not w.name.lower().startswith(wheel + "-")]
    assert len(kept) == len(carried) - 1, f"{wheel} is not in the carried set {WHEELS}"
    install_carried(kept, tmp_path / "site")
    proc = imports_with(tmp_path / "site")
    assert proc.returncode == 1
    assert f"No module named '{module}'" in proc.stderr
    assert "dilforge_shared.settings" in proc.stderr  # the production module that needs it is named
