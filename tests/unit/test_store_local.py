import threading

import pytest
from dilforge_shared.errors import ArtifactExistsError, IntegrityError, ManifestError
from dilforge_shared.store import fetch, publish, read_manifest
from factories import make_manifest, write_output


def test_publish_then_fetch_round_trip(tmp_path):
    out = write_output(tmp_path)
    uri = str(tmp_path / "store" / "artifacts" / "tokenizer" / "abc")
    published = publish(uri, out, make_manifest())
    assert [f.path for f in published.files] == ["model.safetensors", "sub/config.json"]
    art = fetch(uri)
    assert art.manifest == published
    assert (art.path / "model.safetensors").read_bytes() == b"weights"
    manifest, digest = read_manifest(uri + "/manifest.json")
    assert manifest == published and digest == art.manifest_sha256


def test_existing_manifest_is_never_overwritten(tmp_path):
    uri = str(tmp_path / "store" / "a")
    publish(uri, write_output(tmp_path, "one", b"first"), make_manifest())
    before = (tmp_path / "store" / "a" / "manifest.json").read_bytes()
    with pytest.raises(ArtifactExistsError):
        publish(uri, write_output(tmp_path, "two", b"second"), make_manifest())
    assert (tmp_path / "store" / "a" / "manifest.json").read_bytes() == before
    assert len([p for p in (tmp_path / "store" / "a").iterdir() if p.name.startswith("data-")]) == 1
    assert (fetch(uri).path / "model.safetensors").read_bytes() == b"first"


def test_tampered_file_is_detected(tmp_path):
    uri = str(tmp_path / "store" / "a")
    m = publish(uri, write_output(tmp_path), make_manifest())
    (tmp_path / "store" / "a" / m.data_dir / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(IntegrityError, match="model.safetensors does not match its sha256"):
        fetch(uri)


def test_missing_file_is_detected(tmp_path):
    uri = str(tmp_path / "store" / "a")
    m = publish(uri, write_output(tmp_path), make_manifest())
    (tmp_path / "store" / "a" / m.data_dir / "sub" / "config.json").unlink()
    with pytest.raises(IntegrityError, match="sub/config.json listed in the manifest is missing"):
        fetch(uri)


def test_no_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(ManifestError, match="no manifest there"):
        fetch(str(tmp_path / "nothing"))


def test_failed_upload_leaves_no_manifest(tmp_path, monkeypatch):
    from dilforge_shared import store as store

    out = write_output(tmp_path)
    uri = tmp_path / "store" / "a"
    calls = []

    def flaky(self, key, path):
        calls.append(key)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(self, key, path)

    original = store.LocalStorage.upload_file
    monkeypatch.setattr(store.LocalStorage, "upload_file", flaky)
    with pytest.raises(OSError):
        publish(str(uri), out, make_manifest())
    assert not (uri / "manifest.json").exists()
    assert not any(p.name.startswith("data-") for p in uri.iterdir())


def test_concurrent_local_publishers_one_wins(tmp_path):
    uri = str(tmp_path / "store" / "a")
    outs = [write_output(tmp_path, f"o{i}", f"v{i}".encode()) for i in range(4)]
    results = []

    def go(out):
        try:
            results.append(publish(uri, out, make_manifest()))
        except ArtifactExistsError:
            results.append(None)

    threads = [threading.Thread(target=go, args=(o,)) for o in outs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    art = fetch(uri)
    assert art.manifest == winners[0]
    assert len([p for p in (tmp_path / "store" / "a").iterdir() if p.name.startswith("data-")]) == 1


def test_a_long_publish_of_small_files_logs_as_it_goes(tmp_path, monkeypatch, caplog):
    """Files too small to go up in parts are logged once the publish has been quiet for PUBLISH_LOG_S."""
    from dilforge_shared import store

    uri = str(tmp_path / "store" / "artifacts" / "tokenizer" / "abc")
    monkeypatch.setattr(store, "PUBLISH_LOG_S", 0.0)  # every file is "after a quiet spell"
    with caplog.at_level("INFO", logger="dilforge_shared.store"):
        publish(uri, write_output(tmp_path), make_manifest())
    lines = [r.getMessage() for r in caplog.records if "files, uploading" in r.getMessage()]
    assert [line.split(": ", 1)[1] for line in lines] == [
        "1/2 files, uploading model.safetensors (0 MiB)",
        "2/2 files, uploading sub/config.json (0 MiB)",
    ]


@pytest.mark.parametrize(("code", "status"), [("NoSuchKey", 404), ("NotFound", 404), ("404", 404)])
def test_a_conditional_s3_write_on_a_missing_object_is_refused_not_raised(code, status):
    """S3 and S3-compatible stores name a missing object three ways; a lease renewal on one returns False."""
    from botocore.exceptions import ClientError
    from dilforge_shared.store import S3Storage

    class Client:
        def put_object(self, **_):
            raise ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert S3Storage("bkt", "runs", client=Client()).replace_bytes("lease", b"{}", "etag") is False
