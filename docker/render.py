"""Write services/<name>/Dockerfile from docker/stage.Dockerfile.in (one template: the four stage images and the
serve image are identical up to the stage layer). `python docker/render.py --check` exits 1 when a Dockerfile
is out of date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dilforge_shared.stages import IMAGES

ROOT = Path(__file__).resolve().parent.parent
SERVE = "serve"  # the serving image: SageMaker runs `IMAGE serve` (port 8080), the entrypoint execs the `serve` script


def render(stage: str) -> str:
    if stage == SERVE:
        title = (
            "dilforge serve image: an OpenAI-compatible server (transformers serve) that is also a SageMaker "
            "real-time endpoint, `IMAGE serve`."
        )
        cmd = 'EXPOSE 8080\nCMD ["serve"]'
    else:
        title = f"dilforge {stage} stage image: SageMaker bring-your-own-container, `IMAGE train`."
        cmd = 'CMD ["train"]'
    text = (ROOT / "docker" / "stage.Dockerfile.in").read_text()
    return text.replace("@TITLE@", title).replace("@CMD@", cmd).replace("@STAGE@", stage)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docker/render.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a Dockerfile is out of date, write nothing")
    check = parser.parse_args(argv).check
    stale = []
    for stage in (*IMAGES, SERVE):
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
