"""dilforge serve: transformers' own OpenAI-compatible server over a dilforge artifact, plus SageMaker's
inference contract (GET /ping, POST /invocations on port 8080, the model in /opt/ml/model)."""

from __future__ import annotations

import sys

import typer
from dilforge_shared.errors import DilforgeError


def run(app: typer.Typer, argv: list[str], prog: str) -> int:
    """One of this package's Typer commands as a process (the image's `serve`, `python -m dilforge_serve.export`):
    an error of ours or of the OS is one line and exit 1. The coordinator runs them under its own wrapper."""
    try:
        app(argv, prog_name=prog)
    except SystemExit as exc:  # how Typer ends: 0, 2 for a usage error, typer.Exit's code
        return exc.code
    except (DilforgeError, OSError) as exc:
        os_error = isinstance(exc, OSError) and exc.strerror
        where = f": {exc.filename}" if os_error and exc.filename else ""
        print(f"error: {exc.strerror if os_error else exc}{where}", file=sys.stderr)
        return 1
