"""`python -m dilforge_coordinator.schemas [schemas/]`: write the JSON Schemas of the manifest and the pipeline
config (tests/unit/test_schemas.py fails while a written one is stale)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dilforge_shared.manifest import Manifest

from .config import PipelineConfig


def schemas() -> dict[str, dict]:
    return {
        "manifest.schema.json": Manifest.model_json_schema(),
        "pipeline.schema.json": PipelineConfig.model_json_schema(),
    }


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[-1].startswith("-"):
        sys.exit("usage: python -m dilforge_coordinator.schemas [FOLDER]  (default: schemas)")
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "schemas")
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas().items():
        (out / name).write_text(render(schema))
