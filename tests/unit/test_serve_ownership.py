"""`serve --workdir W` (issue 31): the server builds its folder in a fresh private subfolder of W and removes it
on every exit path; nothing of W it did not create is ever removed or written, whatever the model id."""

from __future__ import annotations

from pathlib import Path

import pytest
from dilforge_serve import cli
from dilforge_serve.prepare import ServedModel, prepare
from dilforge_shared.errors import DilforgeError


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_failed_start_leaves_the_workdir_as_it_was(tmp_path, capsys):
    work = tmp_path / "work"
    (work / "mymodel").mkdir(parents=True)
    (work / "mymodel" / "config.json").write_text("{}")  # the user's model, named like the model id
    before = snapshot(work)
    assert cli.main([str(tmp_path / "no-such-model"), "--workdir", str(work), "--model-id", "mymodel"]) == 1
    assert "error:" in capsys.readouterr().err
    assert snapshot(work) == before and sorted(p.name for p in work.iterdir()) == ["mymodel"]


def test_a_workdir_that_does_not_exist_is_an_error_not_created(tmp_path, capsys):
    assert cli.main([str(tmp_path), "--workdir", str(tmp_path / "missing")]) == 1
    assert "no such folder" in capsys.readouterr().err and not (tmp_path / "missing").exists()


def test_the_server_warns_of_a_library_outside_the_checked_versions(tmp_path, monkeypatch, caplog):
    """It runs on `transformers serve` internals (compat.serve.serve_command_app), and does not start through a stage."""
    from dilforge_shared import compat

    monkeypatch.setitem(compat.CHECKED, "pydantic", ("1.0.0", "1.10.0"))  # installed: 2.x
    assert cli.main([str(tmp_path), "--workdir", str(tmp_path / "missing")]) == 1
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith("pydantic 2.") and warned[0].endswith("(1.0.0 to 1.10.0)")


def test_prepare_never_writes_into_an_existing_folder(tmp_path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "weights.bin").write_bytes(b"mine")
    spec = ServedModel(tmp_path, None, tmp_path, "x", model_id="keep")
    with pytest.raises(DilforgeError, match="exists; the served folder is built only in a fresh folder"):
        prepare(spec, tmp_path)
    assert (tmp_path / "keep" / "weights.bin").read_bytes() == b"mine"


def test_a_killed_servers_folder_goes_at_the_next_start_and_nothing_else(tmp_path, capsys):
    """`kill -9` leaves the private folder (links, and for an adapter a merged copy of the model): the next start
    in that workdir removes it, by its staging name and unlocked owner file; a live server's and the user's stay."""
    import os
    import signal
    import subprocess
    import sys

    work = tmp_path / "work"
    work.mkdir()
    holder = (
        "import sys, time; from pathlib import Path; from dilforge_shared import locks\n"
        "with locks.staging_dir(Path(sys.argv[1]), 'serve') as root:\n"
        "    (root / 'merged.safetensors').write_bytes(b'w' * 100); print(root, flush=True); time.sleep(60)\n"
    )
    killed, live = (
        subprocess.Popen([sys.executable, "-c", holder, str(work)], stdout=subprocess.PIPE, text=True) for _ in range(2)
    )
    try:
        folders = [Path(p.stdout.readline().strip()) for p in (killed, live)]
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
        mine = work / ".dilforge-serve-notes"  # the user's, of a similar name
        mine.mkdir()
        (mine / ".owner").write_text("x")
        assert folders[0].is_dir(), "kill -9 leaves it"
        assert cli.main([str(tmp_path / "no-such-model"), "--workdir", str(work)]) == 1
        assert not folders[0].exists() and folders[1].is_dir() and mine.is_dir()
        assert sorted(p.name for p in work.iterdir()) == sorted([folders[1].name, mine.name]), (
            "the failed start's own went"
        )
    finally:
        live.kill()
        live.wait(10)
