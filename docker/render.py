"""Write services/<stage>/Dockerfile from docker/stage.Dockerfile.in (one template, four identical images
up to the stage layer). `python docker/render.py --check` exits 1 when a Dockerfile is out of date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("tokenizer", "cpt", "sft", "eval")


def render(stage: str) -> str:
    return (ROOT / "docker" / "stage.Dockerfile.in").read_text().replace("@STAGE@", stage)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docker/render.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a Dockerfile is out of date, write nothing")
    check = parser.parse_args(argv).check
    stale = []
    for stage in STAGES:
        path = ROOT / "services" / stage / "Dockerfile"
        text = render(stage)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date: {stale}; run python docker/render.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
