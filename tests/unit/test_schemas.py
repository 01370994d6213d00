from pathlib import Path

from dilforge_coordinator import schemas

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"


def test_exported_json_schemas_match_the_models():
    for name, schema in schemas.schemas().items():
        path = SCHEMA_DIR / name
        assert path.exists(), f"{path} missing: run python -m dilforge_coordinator.schemas schemas"
        assert path.read_text() == schemas.render(schema), (
            f"{path} is stale: run python -m dilforge_coordinator.schemas schemas"
        )


def test_manifest_schema_validates_a_real_manifest():
    import json

    import jsonschema
    from factories import make_manifest

    schema = json.loads((SCHEMA_DIR / "manifest.schema.json").read_text())
    doc = json.loads(make_manifest().to_json())
    jsonschema.validate(doc, schema)
    # and the schema is not one that accepts anything: a manifest without its id, or with a stage's kind
    # misspelt, is refused by the exported schema as by the model
    valid = [
        jsonschema.Draft202012Validator(schema).is_valid(bad)
        for bad in (
            {k: v for k, v in doc.items() if k != "artifact_id"},
            {**doc, "kind": "weights"},
            {**doc, "files": [{"path": "a"}]},
        )
    ]
    assert valid == [False, False, False]
