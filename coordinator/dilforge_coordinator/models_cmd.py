"""`coordinator models import SOURCE`: the pipeline's `model` stage run on its own (same fingerprint, same
backends), so a pipeline with `model: {source: SAME}` reuses the artifact and a second import downloads nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from dilforge_cpt.model_metrics import ModelMetrics
from dilforge_cpt.recipes import RECIPES, source_kind
from dilforge_shared.configs import validate_model
from dilforge_shared.contract import read_metrics
from dilforge_shared.store import read_manifest

from . import pipeline as pl
from .common import EndpointOpt, StoreRootOpt, _prepared_backend, _setup_logging
from .config import PipelineConfig

models_app = typer.Typer(
    help="Base models as artifacts: import a recipe, a GGUF, an HF folder or an s3:// prefix.", no_args_is_help=True
)


@models_app.command("import")
def import_cmd(
    source: Annotated[
        str,
        typer.Argument(
            help=f"Recipe ({', '.join(sorted(RECIPES))}), a local .gguf file, a local "
            "HF folder, or an s3:// prefix of one."
        ),
    ],
    store: StoreRootOpt = ".dilforge/store",
    endpoint: EndpointOpt = None,
    backend: Annotated[
        str, typer.Option("--backend", "-b", help="Where the importer runs: local, compose, sagemaker.")
    ] = "local",
    run_id: Annotated[str, typer.Option("--run-id", help="Run record the import is written to.")] = "models",
    verbose: bool = False,
) -> None:
    """Publish a base model to the store as a `model` artifact; prints its URI."""
    _setup_logging(verbose)
    if source_kind(source) in ("folder", "gguf") and not source.startswith("file://"):
        source = str(Path(source).expanduser().resolve())
    cfg = validate_model(
        PipelineConfig,
        {"run_id": run_id, "store": {"uri": store, "s3_endpoint_url": endpoint}, "model": {"source": source}},
        "coordinator models import",
    )
    runner, cfg = _prepared_backend(backend, cfg)
    # the record ends succeeded, failed or cancelled; every model imported under one run id stays referenced
    uri = pl.run_one(cfg, "model", runner, {}, accumulate=True)
    model = read_metrics(ModelMetrics, read_manifest(uri, endpoint)[0].metrics, uri)
    typer.echo(
        f"[model] {model.architecture}, {model.num_parameters:,} parameters, {model.dtype}, "
        f"licence {model.license or 'not stated'}, from {model.source}"
    )
    typer.echo(f"[model] artifact: {uri}")
