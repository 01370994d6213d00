"""`serve [MODEL]`: resolve an artifact, build the served folder, run transformers serve behind the guard.

Defaults follow SageMaker's inference contract, so `docker run IMAGE serve` is a SageMaker real-time
endpoint: the model in /opt/ml/model (an artifact folder: manifest.json + data-*/, or a plain HF folder),
0.0.0.0 on port 8080 (SAGEMAKER_BIND_TO_PORT when set). `coordinator serve` runs the same command with a
store URI, 127.0.0.1 and port 8000.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from dilforge_shared import compat
from dilforge_shared.errors import DilforgeError
from dilforge_shared.settings import settings

from .app import ServerOptions, build_app
from .prepare import prepare, resolve_served_model

log = logging.getLogger("dilforge.serve")
SAGEMAKER_MODEL_DIR = "/opt/ml/model"
DTYPES = ("auto", "bfloat16", "float16", "float32")  # what the server loads weights as ("auto": as stored)


def parse(argv: list[str]) -> argparse.Namespace:
    env = settings()
    p = argparse.ArgumentParser(prog="serve", description=__doc__.splitlines()[0])
    p.add_argument(
        "model",
        nargs="?",
        default=env.model_uri or SAGEMAKER_MODEL_DIR,
        help=f"model or adapter artifact URI (local folder or s3://), or an HF folder (default {SAGEMAKER_MODEL_DIR})",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", default=os.environ.get("SAGEMAKER_BIND_TO_PORT", "8080"))
    p.add_argument(
        "--model-id",
        default=env.model_id or None,
        help="the OpenAI `model` clients send (default <run_id>-<stage>, e.g. az-small-sft)",
    )
    p.add_argument(
        "--system-prompt",
        default=env.system_prompt,
        help="default system message (default: the SFT config's system_prompt; '' for none)",
    )
    p.add_argument("--base", default=None, help="base model of an adapter (default: its lineage)")
    p.add_argument("--adapter", action="store_true", help="serve base + adapter even when merged/ exists")
    p.add_argument("--device", default=env.serve_device)
    p.add_argument("--dtype", default=env.serve_dtype)
    p.add_argument(
        "--continuous-batching",
        action="store_true",
        default=env.continuous_batching == "1",
        help="transformers' continuous batching (paged attention) instead of one request at a time",
    )
    p.add_argument(
        "--workdir",
        default=env.serve_workdir,
        help="folder in which a private, fresh subfolder holds the served folder (default: the system temp folder); "
        "nothing else in it is touched, and the subfolder is removed when the server stops",
    )
    p.add_argument("--s3-endpoint-url", default=env.s3_endpoint_url)
    p.add_argument("--log-level", default="info")
    args = list(argv)
    if args[:1] == ["serve"]:  # `docker run IMAGE serve` (SageMaker) passes the command name
        args = args[1:]
    return p.parse_args(args)


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
    raise SystemExit(128 + signum)  # unwinds through main's finally: the served folder is removed


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    compat.warn_unchecked_versions()  # the server runs on `transformers serve` internals
    # SIGTERM before uvicorn runs (while the model loads) ends like Ctrl-C; uvicorn installs its own while serving
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.workdir and not Path(args.workdir).is_dir():
        print(f"error: --workdir {args.workdir}: no such folder", file=sys.stderr)
        return 1
    problem = device_error(args.device)
    if not (args.port.isascii() and args.port.isdigit() and 1 <= int(args.port) <= 65535):
        problem = f"--port (or SAGEMAKER_BIND_TO_PORT) {args.port!r} is not a port number (1 to 65535)"
    if args.dtype not in DTYPES:
        problem = f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    # a private folder of our own: never a path the user named (their model may live there), always removed
    root = Path(tempfile.mkdtemp(prefix="dilforge-serve-", dir=args.workdir or None))
    cwd = os.getcwd()
    try:
        try:
            spec = resolve_served_model(
                args.model,
                endpoint_url=args.s3_endpoint_url,
                base=args.base,
                model_id=args.model_id,
                system_prompt=args.system_prompt,
                prefer_merged=not args.adapter,
            )
            prepare(spec, root)
        except DilforgeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        os.chdir(root)  # transformers serve is pinned to the folder named by the model id, relative to here
        import uvicorn

        app = build_app(
            spec.model_id,
            ServerOptions(device=args.device, dtype=args.dtype, continuous_batching=args.continuous_batching),
        )
        shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        print(
            f"serving {spec.description}\n  model id: {spec.model_id}\n  OpenAI base URL: http://{shown}:{args.port}/v1"
            f"\n  SageMaker: GET /ping, POST /invocations",
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=int(args.port), log_level=args.log_level)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)
