"""What the coordinator's commands share (errors as one line, logging, the prepared backend), in one module that
cli.py and the command modules (models_cmd.py) import, so no command module imports cli.py back."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from botocore.exceptions import BotoCoreError, ClientError
from dilforge_shared.errors import DilforgeError, printable
from dilforge_shared.settings import install_log_masking, redact

from .backends import get_backend
from .config import PipelineConfig

# What a user can act on: our own errors, OS errors (a full disk, a path under a file), and S3 answers such as an
# unreachable endpoint or missing credentials; shown as one line and exit 1, never as a traceback.
USER_ERRORS = (DilforgeError, BotoCoreError, ClientError, OSError)

# options several commands take
EndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--s3-endpoint-url", envvar="DILFORGE_S3_ENDPOINT_URL", help="S3-compatible endpoint (SeaweedFS, MinIO)."
    ),
]
StoreRootOpt = Annotated[str, typer.Option("--store", envvar="DILFORGE_STORE", help="Artifact store root URI.")]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force", help="Ship a model below the assistant thresholds of its eval, or one without eval figures."
    ),
]


def one_line(exc: BaseException) -> str:
    """An error as the user reads it: OS errors name the file and what failed; credentials are masked."""
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{printable(exc.filename)}: {exc.strerror}" if exc.filename else exc.strerror
        if exc.filename2:
            text += f" (→ {printable(exc.filename2)})"
    else:
        text = str(exc) or type(exc).__name__
    return redact(text)


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {redact(message)}", err=True)
    raise typer.Exit(code)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    install_log_masking()


def _prepared_backend(name: str, cfg: PipelineConfig, dry_run: bool = False, data: Path | None = None):
    """The backend, and the config as it runs there (compose points the store at its S3)."""
    if dry_run and name != "sagemaker":
        fail("--dry-run is for --backend sagemaker")
    options = {"dry_run": True} if dry_run else {}
    if name in ("compose", "sagemaker-local") and data is not None:
        options["data_root"] = data.resolve()
    backend = get_backend(name, **options)
    prepare = getattr(backend, "prepare", None)
    return backend, (prepare(cfg) if prepare else cfg)
