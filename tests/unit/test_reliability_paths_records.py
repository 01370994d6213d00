"""Reliability round 3 (issue 23 items 2 and 3): untrusted names cannot steer paths; run records are relative
to the store (a copied or moved store works, gc is right there) and a damaged record never blocks its run id."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.records import ArtifactStore
from dilforge_shared.errors import ManifestError, UnsafePathError
from dilforge_shared.manifest import MANIFEST_NAME, Manifest, current_producer
from dilforge_shared.store import LocalStorage, S3Storage, fetch, publish
from test_reliability import PublishingBackend, write_config
from typer.testing import CliRunner


def _published(tmp_path: Path, artifact_id: str = "a1") -> str:
    out = tmp_path / "out"
    out.mkdir()
    (out / "w.bin").write_bytes(b"weights")
    uri = str(tmp_path / "store" / "artifacts" / "tokenizer" / artifact_id)
    publish(
        uri,
        out,
        Manifest(
            code_version="test",
            kind="tokenizer",
            artifact_id=artifact_id,
            run_id="r",
            stage="tokenizer",
            producer=current_producer("test"),
            config={},
            data_dir="x",
            files=[],
        ),
    )
    return uri


class RemoteLike(LocalStorage):
    """A local folder that behaves like S3 for fetch: no local path, so files are downloaded to the cache."""

    def local_path(self, key):
        return None


# ---- untrusted data cannot steer paths -------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["../../escape", "..", "a/../../b", "/abs", ".hidden", "a b"])
def test_a_fetched_manifest_whose_artifact_id_climbs_out_is_refused_and_nothing_is_written(
    tmp_path, monkeypatch, bad_id
):
    from dilforge_shared import store as artifacts

    uri = _published(tmp_path)
    mpath = Path(uri) / MANIFEST_NAME
    raw = json.loads(mpath.read_text())
    raw["artifact_id"] = bad_id
    mpath.write_text(json.dumps(raw))
    monkeypatch.setattr(artifacts, "open_backend", lambda u, e=None: RemoteLike(Path(u.removeprefix("file://"))))
    cache = tmp_path / "deep" / "cache"
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(ManifestError, match="artifact_id"):
        fetch(uri, cache_dir=cache)
    assert sorted(p for p in tmp_path.rglob("*")) == before, "nothing may be written anywhere"


def test_a_valid_remote_fetch_still_lands_in_the_cache(tmp_path, monkeypatch):
    from dilforge_shared import store as artifacts

    uri = _published(tmp_path)
    monkeypatch.setattr(artifacts, "open_backend", lambda u, e=None: RemoteLike(Path(u.removeprefix("file://"))))
    art = fetch(uri, cache_dir=tmp_path / "cache")
    assert art.path.parent.parent == tmp_path / "cache" and (art.path / "w.bin").read_bytes() == b"weights"
    assert (art.path.parent / MANIFEST_NAME).is_file(), "the copy keeps the artifact's layout"


@pytest.mark.parametrize("run_id", ["../../etc/passwd", "a/b", "..", ".x"])
def test_run_ids_cannot_address_files_outside_runs(tmp_path, run_id):
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(UnsafePathError, match="run id"):
        store.write_run_record(run_id, b"{}")
    result = CliRunner().invoke(app, ["status", run_id, "--store", str(tmp_path / "store")])
    assert result.exit_code == 1 and "not a valid name" in result.output and "Traceback" not in result.output
    assert not any(tmp_path.rglob("*.json"))


def test_stage_and_artifact_names_are_checked_before_they_become_a_uri(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(UnsafePathError, match="artifact id"):
        store.artifact_uri("cpt", "../x")
    with pytest.raises(UnsafePathError, match="stage"):
        store.artifact_uri("../runs", "x")


def test_a_store_key_through_a_symlinked_folder_out_of_the_store_is_refused(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("s")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "runs").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePathError, match="outside"):
        LocalStorage(tmp_path / "store").read_bytes("runs/secret")


class NoClient:
    def download_file(self, *a, **k):  # pragma: no cover - must never be reached
        raise AssertionError("an unsafe key reached the S3 client")


def test_an_s3_key_with_dotdot_creates_nothing_locally(tmp_path):
    backend = S3Storage("bucket", "prefix", client=NoClient())
    dest = tmp_path / "cache" / "m"
    with pytest.raises(UnsafePathError):
        backend.download_file("x/../../../escape/f", dest / "x/../../../escape/f")
    assert not any(tmp_path.rglob("*")), "no folder may be created before the key is checked"


def _hf_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (root / "tokenizer.json").write_text("{}")
    return root


def test_a_model_folder_with_a_link_out_of_it_is_refused_at_planning_and_import(tmp_path):
    from dilforge_cpt.import_model import copy_hf_folder
    from dilforge_shared.identity import model_digest

    folder = _hf_folder(tmp_path / "model")
    (tmp_path / "secret.txt").write_text("do not publish")
    (folder / "notes.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(UnsafePathError, match="notes.txt is a link to .*outside the folder"):
        model_digest(str(folder))
    with pytest.raises(UnsafePathError, match="notes.txt is a link"):
        copy_hf_folder(folder, str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (folder / "notes.txt").unlink()
    (folder / "sub").symlink_to(tmp_path, target_is_directory=True)  # a folder link out is refused too
    with pytest.raises(UnsafePathError, match="sub is a link"):
        model_digest(str(folder))
    (folder / "sub").unlink()
    (folder / "alias.json").symlink_to(folder / "config.json")  # a link inside the folder is fine
    assert len(model_digest(str(folder))) == 64


def test_a_store_or_work_folder_inside_a_model_folder_is_not_the_model(tmp_path):
    """`models import DIR --store DIR/store`: the store is not part of the model, nor are hidden entries. Its files changed between planning
    and the run (locks, the record), so the import failed on every try ("rerun to plan again"); had it run, the
    artifact would have held the store. A work folder (its marker) or a nested artifact is skipped the same way."""
    from dilforge_cpt.import_model import copy_hf_folder
    from dilforge_shared.identity import model_digest

    folder = _hf_folder(tmp_path / "model")
    (folder / "sub").mkdir()
    (folder / "sub" / "vocab.txt").write_text("a b")  # a subfolder of the model still counts
    before = model_digest(str(folder))
    for hidden in [".git/lfs/objects/ab/model.safetensors", ".cache/huggingface/download/x.metadata", ".gitattributes"]:
        (folder / hidden).parent.mkdir(parents=True, exist_ok=True)  # a clone's history, `hf download`'s cache
        (folder / hidden).write_text(hidden)
    store, work = folder / "store", folder / "work" / "model-0123456789abcdef"
    for marker, content in [
        (store / ".dilforge-store", "x"),
        (store / "runs" / "r.json", "{}"),
        (work / ".dilforge-work", "x"),
    ]:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(content)
    (tmp_path / "elsewhere").mkdir()  # a published artifact (manifest.json beside its data) copied in, too
    shutil.copytree(_published(tmp_path / "elsewhere"), folder / "an-artifact")
    assert model_digest(str(folder)) == before
    (store / "runs" / "r.json").write_text('{"changed": true}')
    assert model_digest(str(folder)) == before, "a run writing to the store does not change the model"
    copy_hf_folder(folder, str(folder), tmp_path / "out")
    copied = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert copied == ["config.json", "model.safetensors", "sub/vocab.txt", "tokenizer.json"]


# ---- run records: relative, robust -----------------------------------------------------------------------


def test_run_records_hold_store_relative_addresses(tmp_path):
    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, PublishingBackend())["tokenizer"]
    raw = json.loads((tmp_path / "store" / "runs" / "demo.json").read_text())
    assert raw["stages"]["tokenizer"]["artifact"] == "artifacts/tokenizer/" + uri.rsplit("/", 1)[1]
    assert str(tmp_path) not in json.dumps(raw["stages"]), "no absolute address in the stages"


def test_a_moved_store_works_gc_is_right_and_stages_take_upstream_from_the_new_place(tmp_path):
    old = tmp_path / "a"
    old.mkdir()
    cfg = load_pipeline(write_config(old))
    uri = pl.run_all(cfg, PublishingBackend())["tokenizer"]
    new = tmp_path / "b" / "store"
    shutil.copytree(old / "store", new, symlinks=True)
    shutil.rmtree(old / "store")  # moved, not copied
    moved = load_pipeline(write_config(old), {"store.uri": str(new)})
    upstream = pl.upstream_from_record(moved)
    assert upstream["tokenizer"] == ArtifactStore(str(new)).artifact_uri("tokenizer", uri.rsplit("/", 1)[1])
    assert Path(upstream["tokenizer"].removeprefix("file://"), MANIFEST_NAME).is_file()
    args = ["gc", "--store", str(new), "--workdir", str(tmp_path / "work"), "--unreferenced", "--min-age-minutes", "0"]
    result = CliRunner().invoke(app, [*args, "--delete"])
    assert result.exit_code == 0 and "0 item(s) removed" in result.output, result.output
    backend = PublishingBackend()
    assert pl.run_all(moved, backend)["tokenizer"].startswith(new.as_uri()) and backend.runs == [], "reused in place"
    status = CliRunner().invoke(app, ["status", "demo", "--store", str(new)])
    assert status.exit_code == 0 and str(new) in status.output and str(old / "store") not in status.output


DAMAGED = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "empty": lambda raw: b"",
    "not_utf8": lambda raw: b"\xff\xfe" + raw,
    "a_list": lambda raw: b"[1, 2]",
    "stages_a_list": lambda raw: json.dumps({**json.loads(raw), "stages": ["x"]}).encode(),
    "stage_without_status": lambda raw: json.dumps({**json.loads(raw), "stages": {"t": {"artifact": "a/b"}}}).encode(),
    "artifact_climbs_out": lambda raw: json.dumps(
        {**json.loads(raw), "stages": {"t": {"artifact": "../../x", "status": "produced"}}}
    ).encode(),
    "owner_a_string": lambda raw: json.dumps({**json.loads(raw), "owner": "me"}).encode(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_run_record_is_one_line_for_status_and_gc_and_set_aside_by_the_next_run(tmp_path, damage, capsys):
    cfg = load_pipeline(write_config(tmp_path))
    pl.run_all(cfg, PublishingBackend())
    path = tmp_path / "store" / "runs" / "demo.json"
    path.write_bytes(DAMAGED[damage](path.read_bytes()))
    status = CliRunner().invoke(app, ["status", "demo", "--store", str(tmp_path / "store")])
    assert status.exit_code == 1 and "damaged run record" in status.output, status.output
    assert "Traceback" not in status.output and status.output.count("\n") == 1
    gc = CliRunner().invoke(
        app, ["gc", "--store", str(tmp_path / "store"), "--workdir", str(tmp_path / "w"), "--unreferenced", "--delete"]
    )
    assert gc.exit_code == 1 and "damaged run record" in gc.output and gc.output.count("\n") == 1, gc.output
    capsys.readouterr()
    assert pl.run_all(cfg, PublishingBackend())["tokenizer"], "the run id is not blocked"
    out = capsys.readouterr().out
    assert "damaged run record" in out and "moved it to" in out
    assert json.loads(path.read_text())["status"] == "succeeded"
    assert len(list(path.parent.glob("demo.json.damaged-*"))) == 1
    ok = CliRunner().invoke(app, ["status", "demo", "--store", str(tmp_path / "store")])
    assert ok.exit_code == 0 and "succeeded" in ok.output


def test_an_input_name_that_would_climb_out_of_the_channel_folder_is_refused():
    from dilforge_shared.contract import parse_hyperparameters
    from dilforge_shared.errors import ConfigError
    from dilforge_tokenizer.config import TokenizerConfig

    hp = {
        "stage_config": json.dumps({"strategy": "replace", "corpora": [{"uri": "/c.txt"}], "vocab_sizes": [1000]}),
        "artifact_uri": "s3://b/artifacts/tokenizer/x",
        "run_id": "r",
        "inputs": json.dumps({"../../x": "s3://b/m"}),
    }
    with pytest.raises(ConfigError, match=r"hp.json: hyperparameter 'inputs': input name '../../x' is not a valid"):
        parse_hyperparameters(hp, TokenizerConfig, "hp.json")


def test_gc_removes_the_digest_of_a_killed_publish_and_keeps_the_live_one(tmp_path):
    import os
    import time

    uri = _published(tmp_path, "0123456789abcdef")  # an artifact id's shape: what gc looks at
    root = Path(uri)
    live = next(root.glob(".data-*.manifest.sha256"))
    dead = root / ".data-0000deadbeef.manifest.sha256"  # a publish killed after its digest
    dead.write_text("0" * 64)
    old = time.time() - 7200
    os.utime(dead, (old, old))
    result = CliRunner().invoke(
        app, ["gc", "--store", str(tmp_path / "store"), "--workdir", str(tmp_path / "w"), "--delete"]
    )
    assert result.exit_code == 0 and "1 item(s) removed" in result.output, result.output
    assert not dead.exists() and live.exists()
    assert fetch(uri).manifest.artifact_id == "0123456789abcdef", "the artifact still verifies"


def test_serve_run_finds_the_runs_artifact_in_the_store_where_it_now_is(tmp_path):
    from dilforge_coordinator.records import run_artifact
    from dilforge_shared.errors import ConfigError

    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, PublishingBackend())["tokenizer"]
    assert run_artifact("demo", str(tmp_path / "store"), "tokenizer") == uri
    shutil.move(tmp_path / "store", tmp_path / "moved")
    moved = run_artifact("demo", str(tmp_path / "moved"), "tokenizer")
    assert moved == uri.replace("/store/", "/moved/") and Path(moved.removeprefix("file://"), MANIFEST_NAME).is_file()
    with pytest.raises(ConfigError, match="has no sft artifact"):
        run_artifact("demo", str(tmp_path / "moved"), "sft")
