"""The OpenAI model id a served artifact answers to, and the serve image's environment names: the same for
`coordinator serve` / `deploy` and the serve image (eval loads `serving` without them)."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ConfigError
from .manifest import Manifest

MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SYSTEM_PROMPT_ENV = "DILFORGE_SYSTEM_PROMPT"
MODEL_ID_ENV = "DILFORGE_MODEL_ID"


def default_model_id(run_id: str | None, stage: str | None, fallback: str) -> str:
    """`<run_id>-<stage>` for an artifact (e.g. az-small-sft), else the folder's name; safe as an OpenAI model id
    and as a folder name (the server is pinned to a local folder of that name)."""
    raw = f"{run_id}-{stage}" if run_id and stage else fallback
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._")[:64] or "model"


def served_model_id(uri: str, manifest: Manifest | None, model_id: str | None = None) -> str:
    """The OpenAI `model` id a server of `uri` answers to: `model_id`, else `<run_id>-<stage>`, else the folder name."""
    run_id, stage = (manifest.run_id, manifest.stage) if manifest else (None, None)
    name = model_id or default_model_id(run_id, stage, Path(uri.rstrip("/")).name)
    if not MODEL_ID.match(name):
        raise ConfigError(
            f"--model-id {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name
