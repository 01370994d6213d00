"""`python -m dilforge_coordinator.schemas [schemas/]`: write the JSON Schemas of the manifest and the pipeline
config; `--check` exits 1 if they are stale."""

from __future__ import annotations

import argparse
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dilforge_coordinator.schemas",
        description="Write the JSON Schemas of the manifest and the pipeline config.",
    )
    parser.add_argument("out", nargs="?", default="schemas", type=Path, help="folder of the JSON schemas")
    parser.add_argument("--check", action="store_true", help="exit 1 when a schema file is stale, write nothing")
    args = parser.parse_args(argv)
    check, out = args.check, args.out
    stale = []
    for name, schema in schemas().items():
        path = out / name
        text = render(schema)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale JSON schemas: {stale}; run `python -m dilforge_coordinator.schemas {out}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
