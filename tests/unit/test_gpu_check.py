"""The device script (scripts/gpu_check.py): phases clipped to the time left (a phase that cannot finish
is skipped and says so), at most 8 result files, the summary last; and the carried-wheel check
(scripts/gpu_wheel_deps.py): a requirement neither carried nor on the device fails it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def check():
    return load("gpu_check")


def test_phases_are_clipped_to_the_time_left(check):
    tests = check.Phase("tests", min_s=60, max_s=300)
    assert check.time_for(tests, 500) == 300
    assert check.time_for(tests, 90) == 90
    assert check.time_for(tests, 59) is None  # cannot finish: skipped
    cpt = check.Phase("cpt", min_s=90, max_s=300, reserve_s=120)
    assert check.time_for(cpt, 400) == 280  # leaves the tests their reserve
    assert check.time_for(cpt, 150) == 150  # too little for the reserve: the later phase gets what is left
    real = check.plan(dry_run=False)
    assert [p.name for p in real] == ["environment", "ceilings", "cpt", "tests"]
    assert sum(p.min_s for p in real) + check.MARGIN_S <= 480


def test_pack_keeps_at_most_8_files(check, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cpt.log").write_text("x")
    for name in (
        "env.json",
        "ceilings.json",
        "attention_table.json",
        "bench.json",
        "pytest.xml",
        "a.json",
        "b.json",
        "c.json",
    ):
        (tmp_path / name).write_text("{}")
    files = check.pack(tmp_path, logs)
    assert len(files) <= check.MAX_FILES - 1 and "logs.tar.gz" in files and "extra.tar.gz" in files
    assert {"bench.json", "ceilings.json", "pytest.xml", "env.json"} <= set(files)


def test_a_call_too_short_for_any_phase_skips_each_and_says_why(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "r"), "--total-s", "22", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip())  # the table is printed last
    for phase in ("environment", "ceilings", "cpt", "tests"):
        assert f"{phase}" in summary
    assert summary.count("skipped: needs") == 4
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["logs.tar.gz", "summary.txt"]


def test_environment_phase_runs_and_reports(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            str(tmp_path / "r"),
            "--dry-run",
            "--phases",
            "environment",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    env = json.loads((tmp_path / "r" / "env.json").read_text())
    assert env["device"] == "cpu" and env["torch"] and "sdpa_backends_available" in env
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert "environment" in summary and "cpu" in summary and summary.count("not asked") == 3


# ---- the carried wheels ------------------------------------------------------------------------------


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        zf.writestr(f"{dist}.dist-info/METADATA", meta)


def test_wheel_set_check_names_what_is_missing_conflicting_or_too_big(tmp_path):
    deps = load("gpu_wheel_deps")
    fake_wheel(
        tmp_path,
        "dilforge-fake",
        "1.0",
        [
            "pydantic-settings>=2",
            "numpy>=2",
            "torch<2.5",
            "pytest; extra == 'test'",
            "colorama; sys_platform == 'win32'",
        ],
    )
    problems = deps.check(tmp_path, "3.12", 64)
    assert any("pydantic-settings>=2 - neither carried nor on the device" in p for p in problems)
    assert any("torch<2.5, on the device is 2.11.0" in p for p in problems)
    assert not any("numpy" in p or "pytest" in p or "colorama" in p for p in problems)
    fake_wheel(tmp_path, "pydantic-settings", "2.16.3", [])
    fake_wheel(tmp_path, "pydantic-settings", "2.15.0", [])
    problems = deps.check(tmp_path, "3.12", 64)
    assert any("two versions of pydantic-settings" in p for p in problems)
    assert not any("neither carried" in p for p in problems)
    assert any("MiB >" in p for p in deps.check(tmp_path, "3.12", 1e-6))
