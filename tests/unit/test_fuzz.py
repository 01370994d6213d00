"""Property-based tests (Hypothesis) of everything dilforge parses from outside: pipeline configs (YAML text and
documents), manifests and run records. The property is always the same: the parser returns a valid object or
raises the project's one error type for that input, naming its source; never anything else (no KeyError,
TypeError, RecursionError, hang) and no path that leaves its root. Budget: tests/fuzzing.py."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from pathlib import Path

from dilforge_coordinator.cli import app
from dilforge_coordinator.config import PipelineConfig, load_pipeline
from dilforge_coordinator.records import ArtifactStore, DamagedRecord, RecordDoc, RunRecord, parse_record
from dilforge_shared.configs import validate_model
from dilforge_shared.errors import ConfigError, ManifestError
from dilforge_shared.manifest import Manifest, check_name, check_relative_path, current_producer, parse_manifest
from fuzzing import FUZZ
from hypothesis import assume, given
from hypothesis import strategies as st
from typer.testing import CliRunner

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20,
)

VALID_CONFIG = {
    "run_id": "r",
    "store": {"uri": "/tmp/dilforge-fuzz-store"},
    "tokenizer": {"strategy": "replace", "corpora": [{"uri": "/nonexistent/c.txt"}], "vocab_sizes": [1000]},
}


def _paths(doc: dict, prefix=()):
    """Every (path, value) in a nested dict/list document."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _replace(doc, path, value):
    if not path:
        return value
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def _has_non_finite(doc) -> bool:
    return any(isinstance(v, float) and not math.isfinite(v) for _, v in _paths(doc))


# ---- configs ----------------------------------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_a_mutated_config_validates_or_is_a_config_error(data):
    paths = [p for p, _ in _paths(VALID_CONFIG)]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_value)
    doc = _replace(VALID_CONFIG, path, value)
    try:
        cfg = validate_model(PipelineConfig, doc, "fuzz.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("invalid config in fuzz.yaml")
        return
    dumped = json.dumps(cfg.model_dump(mode="json"), allow_nan=True)
    assert "Infinity" not in dumped and "NaN" not in dumped, "inf/nan must never validate"
    check_name(cfg.run_id, "run id")


@FUZZ
@given(st.text(max_size=300))
def test_any_yaml_text_loads_or_is_one_config_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        try:
            path.write_bytes(text.encode("utf-8"))
        except UnicodeEncodeError:
            assume(False)
        try:
            load_pipeline(path)
        except ConfigError as exc:
            assert str(path) in str(exc)


@FUZZ
@given(st.integers(1, 12), st.integers(2, 12))
def test_nested_aliases_are_refused_exactly_when_they_expand_past_the_bound(depth, width):
    from dilforge_coordinator.config import MAX_YAML_NODES

    levels = ["l0: &l0 [x]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth)]
    sizes = [2]  # a sequence node and its scalar
    for _ in range(1, depth):
        sizes.append(1 + width * sizes[-1])
    expanded = 1 + sum(1 + n for n in sizes) + 2  # the mapping, each key + value, and `run_id: r`
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text("\n".join(levels) + "\nrun_id: r\n")
        try:
            load_pipeline(path)
            raise AssertionError("unknown top-level keys must still fail validation")
        except ConfigError as exc:
            assert ("aliases expand" in str(exc)) == (expanded > MAX_YAML_NODES), (expanded, str(exc)[:200])


# ---- manifests ---------------------------------------------------------------------------------------------


def _manifest_doc() -> dict:
    return json.loads(
        Manifest(
            code_version="test",
            kind="tokenizer",
            artifact_id="abc0123456789def",
            run_id="r",
            stage="tokenizer",
            producer=current_producer("fuzz"),
            config={},
            data_dir="data-0123456789ab",
            files=[{"path": "tokenizer.json", "size": 2, "sha256": "0" * 64}],
        ).to_json()
    )


MANIFEST = _manifest_doc()


@FUZZ
@given(st.data())
def test_a_mutated_manifest_parses_safely_or_is_a_manifest_error(data):
    paths = [p for p, _ in _paths(MANIFEST)]
    doc = _replace(MANIFEST, data.draw(st.sampled_from(paths)), data.draw(json_value))
    try:
        manifest = parse_manifest(json.dumps(doc, allow_nan=True), "s3://b/m.json")
    except ManifestError as exc:
        assert str(exc).startswith("s3://b/m.json: ")
        return
    check_name(manifest.artifact_id, "artifact id")
    check_relative_path(manifest.data_dir)
    for entry in manifest.files:
        check_relative_path(entry.path)
    # written as strict JSON (a non-finite number in metrics or config becomes null), then stable
    again = parse_manifest(manifest.to_json(), "again")
    assert again.to_json() == manifest.to_json() and b"Infinity" not in again.to_json(), "round-trips"


@FUZZ
@given(st.binary(max_size=400))
def test_any_manifest_bytes_parse_or_are_a_manifest_error(raw):
    with contextlib.suppress(ManifestError):
        parse_manifest(raw, "m.json")


@FUZZ
@given(st.text(min_size=1, max_size=40))
def test_an_artifact_id_is_accepted_only_as_one_safe_path_component(artifact_id):
    doc = {**MANIFEST, "artifact_id": artifact_id}
    try:
        manifest = parse_manifest(json.dumps(doc), "m.json")
    except ManifestError:
        return
    root = Path("/cache")
    assert (root / manifest.artifact_id).resolve().parent == root and "/" not in artifact_id
    assert not artifact_id.startswith(".")


# ---- run records -----------------------------------------------------------------------------------------------

RECORD = json.loads(
    RunRecord(
        run_id="r",
        status="succeeded",
        owner={"pid": 1, "host": "h"},
        stages={"tokenizer": {"artifact": "artifacts/tokenizer/abc", "status": "produced", "backend": "local"}},
    ).to_json()
)


@FUZZ
@given(st.data())
def test_a_mutated_record_parses_or_is_one_damaged_record_error(data):
    paths = [p for p, _ in _paths(RECORD)]
    doc = _replace(RECORD, data.draw(st.sampled_from(paths)), data.draw(json_value))
    try:
        parsed = parse_record(json.dumps(doc, allow_nan=True).encode(), "runs/r.json")
    except DamagedRecord as exc:
        assert str(exc).startswith("runs/r.json: damaged run record") and "\n" not in str(exc)
        return
    assert isinstance(parsed, RecordDoc)
    store = ArtifactStore("/tmp/dilforge-fuzz-store")
    for entry in parsed.stages.values():
        uri = store.resolve(entry.artifact)
        assert uri.startswith(store.backend.uri + "/"), "a relative address stays inside the store"


@FUZZ
@given(st.binary(max_size=300))
def test_status_of_any_record_bytes_is_an_answer_or_one_line_never_a_traceback(raw):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "runs").mkdir()
        (Path(tmp) / "runs" / "r.json").write_bytes(raw)
        result = CliRunner().invoke(app, ["status", "r", "--store", tmp])
        assert result.exit_code in (0, 1) and (result.exception is None or isinstance(result.exception, SystemExit)), (
            result.output
        )
        if result.exit_code == 1:
            assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
        record = RunRecord.load(ArtifactStore(tmp), "r")  # the next run is never blocked
        assert record.run_id == "r"
