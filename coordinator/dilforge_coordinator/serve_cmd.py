"""`coordinator serve` and `coordinator export`: the serve service's own Typer commands (their options declared
there, once), run in this process with what the coordinator adds: the artifact from a run record (--run, --stage,
--store) and the ship gate (--force)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated

import typer
from dilforge_serve import cli as serve_cli
from dilforge_serve import export as export_cli

from .common import ForceOpt, StoreRootOpt
from .records import run_artifact

RunOpt = Annotated[str | None, typer.Option("--run", help="Use this run's artifact (its run record).")]
StageOpt = Annotated[str, typer.Option("--stage", help="With --run: which stage's artifact.")]


def _coordinator_options(
    run: RunOpt = None, stage: StageOpt = "sft", store: StoreRootOpt = ".dilforge/store", force: ForceOpt = False
) -> None:
    """What the coordinator adds to a serve service command (declared as a signature, read by `gated`)."""


def gated(command: Callable, action: str, **defaults) -> Callable:
    """The serve service's Typer `command` (its first parameter the artifact, its options as declared there,
    `defaults` replacing some defaults) plus the coordinator's options: the artifact is the argument or --run's,
    the ship gate passes it (or --force), then `command` runs."""
    theirs = list(inspect.signature(command, eval_str=True).parameters.values())
    ours = list(inspect.signature(_coordinator_options, eval_str=True).parameters.values())
    artifact_param = theirs[0].name

    def gated_command(**options):
        from . import gate

        run, stage, store, force = (options.pop(p.name) for p in ours)
        artifact, endpoint = options[artifact_param], options["s3_endpoint_url"]
        if (artifact is None) == (run is None):
            raise typer.BadParameter("give an artifact URI or --run RUN_ID (not both)")
        artifact = artifact if artifact is not None else run_artifact(run, store, stage, endpoint)
        gate.check(artifact, store, run, endpoint, force, action)
        options[artifact_param] = artifact
        return command(**options)

    defaults[artifact_param] = None  # the argument or --run
    keyword = inspect.Parameter.KEYWORD_ONLY  # a required option may follow the optional argument
    gated_command.__signature__ = inspect.Signature(
        [p.replace(kind=keyword, default=defaults.get(p.name, p.default)) for p in theirs + ours]
    )
    gated_command.__doc__ = command.__doc__
    return gated_command


serve_cmd = gated(serve_cli.serve, "serve", host="127.0.0.1", port="8000")
export_cmd = gated(export_cli.export_cmd, "export")
