"""`serve [MODEL]`: resolve an artifact, build the served folder, run transformers serve behind the guard.
Its defaults are SageMaker's inference contract (the model in /opt/ml/model, 0.0.0.0:8080 or
SAGEMAKER_BIND_TO_PORT), so `docker run IMAGE serve` is a real-time endpoint; `coordinator serve` mounts it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from dilforge_shared import compat, locks

from . import run
from .app import build_app
from .prepare import check_system_prompt, prepare, resolve_served_model

SAGEMAKER_MODEL_DIR = "/opt/ml/model"
DTYPES = ("auto", "bfloat16", "float16", "float32")  # what the server loads weights as ("auto": as stored)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def device_error(device: str) -> str | None:
    """Why `--device` cannot serve on this machine (one line), or None: checked before anything is loaded, so a
    `cuda:7` on a CPU-only machine is an error naming the flag, not a stack trace from inside model loading."""
    if device in ("auto", "cpu"):
        return None
    import torch

    try:
        chosen = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N"
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"--device {device}: this machine has no CUDA GPU that torch can use; use --device cpu or auto"
        if chosen.index is not None and chosen.index >= count:
            return f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
        return None
    if chosen.type == "mps" and torch.backends.mps.is_available():
        return None
    return f"--device {device}: not available here; use auto, cpu, cuda or cuda:N"


def stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through serve's finally: the served folder is removed


@app.command()
def serve(
    model: Annotated[
        str, typer.Argument(envvar="DILFORGE_MODEL_URI", help="Model or adapter artifact URI, or an HF folder.")
    ] = SAGEMAKER_MODEL_DIR,
    host: Annotated[str, typer.Option("--host", help="Listen address (0.0.0.0 accepts other machines).")] = "0.0.0.0",
    port: Annotated[str, typer.Option("--port", envvar="SAGEMAKER_BIND_TO_PORT", help="1 to 65535.")] = "8080",
    model_id: Annotated[
        str | None, typer.Option("--model-id", envvar="DILFORGE_MODEL_ID", help="Default <run_id>-<stage>.")
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option("--system-prompt", envvar="DILFORGE_SYSTEM_PROMPT", help="Default the SFT config's.")
    ] = None,
    base: Annotated[str | None, typer.Option("--base", help="Base model of an adapter (default: its lineage).")] = None,
    adapter: Annotated[bool, typer.Option("--adapter", help="Merge base + adapter even when merged/ exists.")] = False,
    device: Annotated[
        str, typer.Option("--device", envvar="DILFORGE_SERVE_DEVICE", help="auto, cpu, cuda:N.")
    ] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", envvar="DILFORGE_SERVE_DTYPE", help=", ".join(DTYPES))] = "auto",
    continuous_batching: Annotated[
        bool, typer.Option("--continuous-batching", envvar="DILFORGE_CONTINUOUS_BATCHING", help="Paged attention.")
    ] = False,
    workdir: Annotated[
        str | None,
        typer.Option(
            "--workdir", envvar="DILFORGE_SERVE_WORKDIR", help="Where a fresh subfolder holds the served one."
        ),
    ] = None,
    s3_endpoint_url: Annotated[str | None, typer.Option("--s3-endpoint-url", envvar="DILFORGE_S3_ENDPOINT_URL")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level.")] = "info",
) -> None:
    """Serve an artifact with an OpenAI-compatible API and SageMaker's /ping + /invocations."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    compat.warn_unchecked_versions()  # the server runs on `transformers serve` internals
    # SIGTERM before uvicorn runs (while the model loads) ends like Ctrl-C; uvicorn installs its own while serving
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    problem = device_error(device)
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        problem = f"--port (or SAGEMAKER_BIND_TO_PORT) {port!r} is not a port number (1 to 65535)"
    if dtype not in DTYPES:
        problem = f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}"
    if workdir and not Path(workdir).is_dir():
        problem = f"--workdir {workdir}: no such folder"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise typer.Exit(1)
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    print(f"OpenAI base URL: {base_url}/v1 (SageMaker: GET /ping, POST /invocations)", flush=True)  # before loading
    # a private staging folder of our own (never a path the user named: their model may live there), removed on
    # exit; one a killed server left (links, and for an adapter a merged copy of the model) goes at the next start
    parent = Path(workdir or tempfile.gettempdir())
    for stale in locks.abandoned(parent, "serve"):
        logging.getLogger("dilforge.serve").info("removing %s, left by a server that was killed", stale)
        locks.remove_abandoned(stale)
    cwd = os.getcwd()
    try:
        with locks.staging_dir(parent, "serve") as root:
            os.chmod(root, 0o700)
            try:
                spec = resolve_served_model(
                    model,
                    endpoint_url=s3_endpoint_url,
                    base=base,
                    model_id=model_id,
                    system_prompt=system_prompt,
                    prefer_merged=not adapter,
                )
                field = "--system-prompt" if system_prompt else f"{model}: its SFT config's system_prompt"
                check_system_prompt(spec.system_prompt, field, spec.tokenizer_dir)
                prepare(spec, root)
                os.chdir(root)  # transformers serve is pinned to the folder named by the model id, relative to here
                import uvicorn

                server = build_app(spec.model_id, device=device, dtype=dtype, continuous_batching=continuous_batching)
                print(
                    f"serving {spec.description}\n  model id: {spec.model_id}\n"
                    f"  try: curl {base_url}/v1/chat/completions "
                    f'-H \'Content-Type: application/json\' -d \'{{"model": "{spec.model_id}", "messages": '
                    '[{"role": "user", "content": "Salam!"}]}\'',
                    flush=True,
                )
                uvicorn.run(server, host=host, port=int(port), log_level=log_level)
            finally:
                os.chdir(cwd)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def main(argv: list[str] | None = None) -> int:
    """The image's `serve` command (SageMaker runs `IMAGE serve`, so a leading `serve` is the command's name)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    return run(app, args, "serve")
