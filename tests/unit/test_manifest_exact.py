"""An artifact holds exactly its manifest's files, and its manifest is the one recorded when it was made: files added
to a published artifact are never read and fail validation; an edited manifest fails, with or without its digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import IntegrityError
from dilforge_shared.identity import source_files
from dilforge_shared.manifest import MANIFEST_NAME, Manifest, current_producer, sha256_bytes, sha256_file
from dilforge_shared.store import fetch, manifest_digest_key, publish
from test_reliability import PublishingBackend, write_config
from test_reliability_paths_records import RemoteLike
from typer.testing import CliRunner


def _corpus_artifact(tmp_path: Path) -> Path:
    """A published curate-like artifact: two shards and a data card."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.jsonl").write_text('{"text": "bir"}\n{"text": "iki"}\n')
    (out / "shard-00001.jsonl").write_text('{"text": "üç"}\n')
    (out / "README.md").write_text("# card\n")
    uri = tmp_path / "store" / "artifacts" / "curate" / "c1"
    manifest = Manifest(
        code_version="test",
        kind="corpus",
        artifact_id="c1",
        run_id="r",
        stage="curate",
        producer=current_producer("test"),
        config={},
        data_dir="x",
        files=[],
    )
    publish(str(uri), out, manifest)
    return uri


def _data(uri: Path) -> Path:
    return uri / json.loads((uri / MANIFEST_NAME).read_text())["data_dir"]


def _validate(uri) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["manifest", "validate", str(uri)])
    return result.exit_code, result.output


INJECTED = ["zz-injected.jsonl", "sub/more.txt", ".hidden.jsonl", "shard-00000.jsonl.bak"]


@pytest.mark.parametrize("name", INJECTED)
def test_a_file_added_to_a_published_artifact_fails_validation_and_is_never_read(tmp_path, name):
    uri = _corpus_artifact(tmp_path)
    data = _data(uri)
    assert _validate(uri)[0] == 0
    (data / name).parent.mkdir(parents=True, exist_ok=True)
    (data / name).write_text('{"text": "POISON"}\nPOISON\n')
    code, out = _validate(uri)
    assert code == 1 and name in out and "not listed in the manifest" in out and out.count("\n") == 1, out
    assert "not listed in the manifest" in check_artifact(str(uri))
    with pytest.raises(IntegrityError, match="not listed in the manifest"):
        fetch(str(uri))
    # a reader given the data folder lists the manifest's files, never the folder's
    assert [Path(f).name for f in source_files(str(data))] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert "POISON" not in list(iter_texts(str(data)))


def test_a_symlinked_subfolder_in_a_published_artifact_fails_validation(tmp_path):
    uri = _corpus_artifact(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.txt").write_text("POISON\n")
    (_data(uri) / "linked").symlink_to(tmp_path / "elsewhere")
    code, out = _validate(uri)
    assert code == 1 and "linked" in out and "not listed in the manifest" in out, out


def test_a_fetched_copy_is_listed_from_its_manifest_too(tmp_path, monkeypatch):
    uri = _corpus_artifact(tmp_path)
    monkeypatch.setattr("dilforge_shared.store.open_backend", lambda u, e=None: RemoteLike(Path(u)))
    art = fetch(str(uri), cache_dir=tmp_path / "cache")
    assert art.path != _data(uri) and art.path.is_relative_to(tmp_path / "cache")
    # the copy's manifest is the published bytes: a SageMaker channel made of the copy cites the same digest
    assert sha256_file(art.path.parent / "manifest.json") == art.manifest_sha256
    (art.path / "zz-injected.jsonl").write_text('{"text": "POISON"}\n')
    assert [Path(f).name for f in source_files(str(art.path))] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    again = fetch(str(uri), cache_dir=tmp_path / "cache")  # the damaged copy is downloaded again
    assert not (again.path / "zz-injected.jsonl").exists()


def _edit_file_and_manifest(uri: Path) -> tuple[Path, dict]:
    """Edit tokenizer.json, and put its new size and sha256 in manifest.json: a consistent forgery."""
    data = _data(uri)
    target = data / "tokenizer.json"
    target.write_text('{"model": "POISON"}')
    path = uri / MANIFEST_NAME
    raw = json.loads(path.read_text())
    for entry in raw["files"]:
        if entry["path"] == "tokenizer.json":
            entry["size"], entry["sha256"] = target.stat().st_size, sha256_file(target)
    path.write_text(json.dumps(raw, indent=2))
    return path, raw


def _swap_data_folder(uri: Path, raw: dict) -> None:
    """Move the edited files to a new data folder, name it in the manifest, and write that manifest's digest."""
    new = "data-0123456789ab"
    (uri / raw["data_dir"]).rename(uri / new)
    (uri / manifest_digest_key(raw["data_dir"])).unlink()
    raw["data_dir"] = new
    body = json.dumps(raw, indent=2).encode()
    (uri / MANIFEST_NAME).write_bytes(body)
    (uri / manifest_digest_key(new)).write_text(sha256_bytes(body))


@pytest.mark.parametrize("sidecar", ["deleted", "rewritten", "new data folder"])
def test_an_edited_artifact_with_a_matching_manifest_is_neither_valid_nor_reused(tmp_path, sidecar, capsys):
    cfg = load_pipeline(write_config(tmp_path))
    backend = PublishingBackend()
    uri = Path(pl.run_all(cfg, backend)["tokenizer"].removeprefix("file://"))
    witness = json.loads((tmp_path / "store" / "runs" / "demo.json").read_text())["witnesses"]
    assert witness[f"artifacts/tokenizer/{uri.name}"]["manifest_sha256"] == sha256_file(uri / MANIFEST_NAME)
    path, raw = _edit_file_and_manifest(uri)
    digest = uri / manifest_digest_key(raw["data_dir"])
    if sidecar == "deleted":
        digest.unlink()
    elif sidecar == "rewritten":
        digest.write_text(sha256_bytes(path.read_bytes()))
    else:
        _swap_data_folder(uri, raw)
    code, out = _validate(uri)
    assert code == 1 and out.count("\n") == 1, out
    expected = {
        "deleted": "no recorded digest",
        "rewritten": "changed since run record",
        "new data folder": "no publish a run record witnessed",
    }[sidecar]
    assert expected in out, out
    capsys.readouterr()
    assert pl.run_all(cfg, backend)["tokenizer"].removeprefix("file://") == str(uri)
    assert len(backend.runs) == 2, "rebuilt, not reused"
    assert "damaged artifact" in capsys.readouterr().out
    assert json.loads((_data(uri) / "tokenizer.json").read_text()) == {"model": "bpe"}
    assert _validate(uri)[0] == 0, "the rebuilt artifact validates against the record's new witness"


def test_an_artifact_its_run_no_longer_names_is_still_checked_against_its_witness(tmp_path):
    """The stage's entry moves on to another artifact (another config under the same run id); the record still
    witnesses the first one, so editing that one with a matching manifest and digest is caught."""
    backend = PublishingBackend()
    first = Path(pl.run_all(load_pipeline(write_config(tmp_path)), backend)["tokenizer"].removeprefix("file://"))
    other = write_config(tmp_path).read_text().replace("vocab_sizes: [1000]", "vocab_sizes: [1200]")
    assert other != write_config(tmp_path).read_text()
    (tmp_path / "other.yaml").write_text(other)
    second = pl.run_all(load_pipeline(tmp_path / "other.yaml"), backend)["tokenizer"]
    assert second.removeprefix("file://") != str(first)
    path, raw = _edit_file_and_manifest(first)
    (first / manifest_digest_key(raw["data_dir"])).write_text(sha256_bytes(path.read_bytes()))
    assert "changed since run record" in check_artifact(str(first))


def test_a_rebuilt_artifact_is_not_judged_by_an_older_publishs_witness(tmp_path):
    """A witness is of one publish (its data folder): after a rebuild under the same id, a record of the old
    publish does not condemn the new one, which the rebuilding run witnessed."""
    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, PublishingBackend())["tokenizer"]
    other = tmp_path / "store" / "runs" / "older.json"
    address = "artifacts/tokenizer/" + uri.rsplit("/", 1)[1]
    entry = {"artifact": address, "status": "produced"}
    other.write_text(
        json.dumps(
            {
                "run_id": "older",
                "stages": {"tokenizer": entry},
                "witnesses": {address: {"data_dir": "data-0", "manifest_sha256": "0" * 64}},
            }
        )
    )
    assert check_artifact(uri) is None


@pytest.mark.parametrize("spelling", ["relative", "doubled slashes", "link to its folder"])
def test_the_witness_is_found_whatever_the_artifacts_path_spelling(tmp_path, monkeypatch, spelling):
    """`manifest validate artifacts/tokenizer/<id>` from the store's root, `store//artifacts//…` or a link to the
    artifact's folder: still the artifact in its store, still checked against the store's run records."""
    uri = Path(
        pl.run_all(load_pipeline(write_config(tmp_path)), PublishingBackend())["tokenizer"].removeprefix("file://")
    )
    path, raw = _edit_file_and_manifest(uri)
    (uri / manifest_digest_key(raw["data_dir"])).write_text(sha256_bytes(path.read_bytes()))
    if spelling == "relative":
        monkeypatch.chdir(tmp_path / "store")
        given = str(uri.relative_to(tmp_path / "store"))
    elif spelling == "doubled slashes":
        given = str(uri).replace("/artifacts/", "//artifacts//")
    else:
        (tmp_path / "link").symlink_to(uri)
        given = str(tmp_path / "link")
    code, out = _validate(given)
    assert code == 1 and "changed since run record" in out, out
