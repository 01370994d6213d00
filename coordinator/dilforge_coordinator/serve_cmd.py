"""`coordinator serve ARTIFACT`: an OpenAI-compatible endpoint over a model or SFT artifact, on this machine.

The server is the serve service (`python -m dilforge_serve`, services/serve): transformers serve's own
FastAPI app pinned to the artifact, behind a request guard, the same program the serving image runs as a
SageMaker endpoint. The coordinator reads the manifest (nothing else is downloaded here) to print the URL
and the model id, then replaces itself with the server process so Ctrl-C and SIGTERM reach it directly.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Annotated

import typer


def run_artifact(run_id: str, store: str, stage: str, endpoint: str | None = None) -> str:
    """The artifact a run produced (or reused) for `stage`, from its run record."""
    from dilforge_shared.errors import ConfigError
    from dilforge_shared.store import ArtifactStore

    from .records import RunRecord, record_artifacts

    artifacts = ArtifactStore(store, endpoint)
    found = record_artifacts(artifacts, RunRecord.load(artifacts, run_id), ("produced", "reused"))
    if stage not in found:
        raise ConfigError(
            f"run {run_id!r} in store {store} has no {stage} artifact (run the pipeline first, or pass "
            "the artifact URI)"
        )
    return found[stage]  # store-relative in the record: wherever the store now is


RunOpt = Annotated[str | None, typer.Option("--run", help="Use this run's artifact (its run record).")]
StageOpt = Annotated[str, typer.Option("--stage", help="With --run: which stage's artifact.")]
StoreOpt = Annotated[str, typer.Option("--store", envvar="DILFORGE_STORE", help="With --run: the store root URI.")]
EndpointOpt = Annotated[
    str | None, typer.Option("--s3-endpoint-url", envvar="DILFORGE_S3_ENDPOINT_URL", help="S3-compatible endpoint.")
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force", help="Ship a model below the assistant thresholds of its eval, or one without eval figures."
    ),
]


def chosen_artifact(artifact: str | None, run: str | None, store: str, stage: str, endpoint: str | None) -> str:
    """The artifact a serve/export command works on (a URI, or --run's), once the serve service is installed."""
    if (artifact is None) == (run is None):
        raise typer.BadParameter("give an artifact URI or --run RUN_ID (not both)")
    if importlib.util.find_spec("dilforge_serve") is None:
        typer.echo(
            "error: this needs the serve service: pip install -e services/serve (scripts/setup.sh does)", err=True
        )
        raise typer.Exit(1)
    return artifact if artifact is not None else run_artifact(run, store, stage, endpoint)


def serve_cmd(
    artifact: Annotated[
        str | None,
        typer.Argument(help="SFT/CPT/model artifact URI (store folder or s3://), or an HF folder; or use --run."),
    ] = None,
    run: RunOpt = None,
    stage: StageOpt = "sft",
    store: StoreOpt = ".dilforge/store",
    host: Annotated[
        str, typer.Option("--host", help="Listen address (0.0.0.0 to accept other machines).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8000,
    model_id: Annotated[
        str | None,
        typer.Option(
            "--model-id", help="The OpenAI `model` clients send; default <run_id>-<stage>, e.g. az-small-sft."
        ),
    ] = None,
    system_prompt: Annotated[
        str | None,
        typer.Option(
            "--system-prompt", help="Default system message; default the SFT config's system_prompt, '' for none."
        ),
    ] = None,
    base: Annotated[str | None, typer.Option("--base", help="Base model of an adapter (default: its lineage).")] = None,
    adapter: Annotated[
        bool, typer.Option("--adapter", help="Merge base + adapter at start-up even when the artifact has merged/.")
    ] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    continuous_batching: Annotated[
        bool, typer.Option("--continuous-batching", help="transformers' continuous batching (paged attention).")
    ] = False,
    workdir: Annotated[
        str | None,
        typer.Option(
            "--workdir",
            help="Folder in which the server makes a fresh private subfolder for the served folder (links to the "
            "weights), removed when it stops; default the system temp folder.",
        ),
    ] = None,
    endpoint: EndpointOpt = None,
    force: ForceOpt = False,
) -> None:
    """Serve an artifact with an OpenAI-compatible API (chat/completions, streaming) and SageMaker's /ping + /invocations."""
    from dilforge_shared.serving import served_model_id

    from . import gate

    artifact = chosen_artifact(artifact, run, store, stage, endpoint)
    gate.check(artifact, store, run, endpoint, force, "serve")
    model = served_model_id(artifact, gate.manifest_or_none(artifact, endpoint), model_id)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    typer.echo(
        f"serving {artifact}\n  OpenAI base URL: http://{shown}:{port}/v1\n  model id: {model}\n"
        f"  try: curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Salam!"}}]}}\''
    )
    cmd = [
        sys.executable,
        "-m",
        "dilforge_serve",
        artifact,
        "--host",
        host,
        "--port",
        str(port),
        "--model-id",
        model,
        "--device",
        device,
    ]
    for flag, value in (
        ("--system-prompt", system_prompt),
        ("--base", base),
        ("--workdir", workdir),
        ("--s3-endpoint-url", endpoint),
    ):
        if value is not None:
            cmd += [flag, value]
    cmd += ["--adapter"] if adapter else []
    cmd += ["--continuous-batching"] if continuous_batching else []
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)


def export_cmd(
    artifact: Annotated[
        str | None, typer.Argument(help="CPT or SFT artifact URI (store folder or s3://); or use --run.")
    ] = None,
    out: Annotated[str, typer.Option("--out", help="Folder for <model id>-<quant>.gguf and .Modelfile.")] = "",
    fmt: Annotated[str, typer.Option("--format", help="gguf (llama.cpp, Ollama, LM Studio).")] = "gguf",
    quant: Annotated[str, typer.Option("--quant", help="f16, q8_0 or q4_k_m.")] = "q8_0",
    run: RunOpt = None,
    stage: StageOpt = "sft",
    store: StoreOpt = ".dilforge/store",
    base_tokenizer: Annotated[
        str | None, typer.Option("--base-tokenizer", help="The base model's tokenizer folder (default: lineage).")
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option("--system-prompt", help="Default system message; default the SFT config's.")
    ] = None,
    endpoint: EndpointOpt = None,
    force: ForceOpt = False,
) -> None:
    """Export a CPT or SFT artifact as a GGUF for llama.cpp / Ollama (services/serve: dilforge_serve.export)."""
    from . import gate

    if not out:
        raise typer.BadParameter("--out DIR is required")
    if fmt != "gguf":
        raise typer.BadParameter(f"--format {fmt!r}: only gguf is supported")
    artifact = chosen_artifact(artifact, run, store, stage, endpoint)
    gate.check(artifact, store, run, endpoint, force, "export")
    cmd = [sys.executable, "-m", "dilforge_serve.export", artifact, "--out", out, "--quant", quant]
    for flag, value in (
        ("--base-tokenizer", base_tokenizer),
        ("--system-prompt", system_prompt),
        ("--s3-endpoint-url", endpoint),
    ):
        if value is not None:
            cmd += [flag, value]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)
