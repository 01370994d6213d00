"""The `transformers serve` command's app, built without starting it."""

from __future__ import annotations

from typing import Any

from . import first_use


def serve_command_app(model_id: str, **options: Any):
    """The FastAPI app `transformers serve <model_id>` runs, with the model preloaded and pinned (`force_model`),
    built by the command's own class but not started: `Serve.__init__(non_blocking=True)` ends by calling
    `start_server`, which this subclass leaves to the caller's uvicorn (so the app can run behind a guard)."""
    first_use()
    from transformers.cli.serve import Serve

    class Unstarted(Serve):
        def start_server(self):
            pass

    serve = Unstarted(force_model=model_id, trust_remote_code=False, log_level="warning", non_blocking=True, **options)
    return serve.server.config.app
