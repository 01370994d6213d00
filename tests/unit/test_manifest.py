import json

import pytest
from dilforge_shared.errors import ManifestError
from dilforge_shared.manifest import SCHEMA_VERSION, FileEntry, InputRef, fingerprint, parse_manifest
from factories import make_manifest


def test_round_trip_is_lossless():
    m = make_manifest()
    again = parse_manifest(m.to_json(), "mem")
    assert again == m
    assert again.to_json() == m.to_json()


def test_older_minor_is_accepted():
    raw = json.loads(make_manifest().to_json())
    major = SCHEMA_VERSION.split(".")[0]
    raw["schema_version"] = f"{major}.0.0"
    assert parse_manifest(json.dumps(raw), "mem").artifact_id == "abc123"


def test_newer_minor_ignores_unknown_fields():
    raw = json.loads(make_manifest().to_json())
    major, minor, _ = SCHEMA_VERSION.split(".")
    raw["schema_version"] = f"{major}.{int(minor) + 1}.0"
    raw["field_from_the_future"] = 1
    assert parse_manifest(json.dumps(raw), "mem").kind == "tokenizer"


def test_newer_major_is_rejected_with_reason():
    raw = json.loads(make_manifest().to_json())
    raw["schema_version"] = f"{int(SCHEMA_VERSION.split('.')[0]) + 1}.0.0"
    with pytest.raises(ManifestError, match=r"s3://b/m.json: manifest schema .* newer major"):
        parse_manifest(json.dumps(raw), "s3://b/m.json")


def test_unknown_field_in_same_version_is_rejected():
    raw = json.loads(make_manifest().to_json())
    raw["surprise"] = True
    with pytest.raises(ManifestError, match="surprise"):
        parse_manifest(json.dumps(raw), "mem")


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../b", "a//b", "a\\b", ""])
def test_path_traversal_is_rejected(bad):
    with pytest.raises(ValueError):
        FileEntry(path=bad, size=0, sha256="a" * 64)


def test_not_json_names_source():
    with pytest.raises(ManifestError, match="file.json: not valid JSON"):
        parse_manifest(b"{", "file.json")


def test_fingerprint_depends_on_config_and_inputs_only():
    ref = InputRef(name="tokenizer", kind="manifest", uri="s3://a", sha256="1" * 64)
    moved = ref.model_copy(update={"uri": "s3://elsewhere"})
    base = fingerprint("cpt", {"lr": 1e-4}, [ref], 1)
    assert fingerprint("cpt", {"lr": 1e-4}, [moved], 1) == base  # location does not matter, content does
    assert fingerprint("cpt", {"lr": 2e-4}, [ref], 1) != base
    assert fingerprint("cpt", {"lr": 1e-4}, [ref.model_copy(update={"sha256": "2" * 64})], 1) != base
    assert fingerprint("sft", {"lr": 1e-4}, [ref], 1) != base
    assert fingerprint("cpt", {"lr": 1e-4}, [ref], 2) != base  # a new code version is a new artifact
    data = InputRef(name="data:wiki", kind="data", uri="/d/wiki.txt", sha256="3" * 64)
    renamed = data.model_copy(update={"name": "data:Wikipedia"})
    assert fingerprint("cpt", {}, [data], 1) == fingerprint("cpt", {}, [renamed], 1)  # a display name is run-only
