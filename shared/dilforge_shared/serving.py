"""How a server presents an artifact, the same for `coordinator serve` / `deploy` and the serve image: the OpenAI
model id, and the served chat template that makes the SFT config's `system_prompt` the default system message
(no torch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import ConfigError
from .manifest import Manifest

MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SYSTEM_PROMPT_ENV = "DILFORGE_SYSTEM_PROMPT"
MODEL_ID_ENV = "DILFORGE_MODEL_ID"
_GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def default_model_id(run_id: str | None, stage: str | None, fallback: str) -> str:
    """`<run_id>-<stage>` for an artifact (e.g. az-small-sft), else the folder's name; safe as an OpenAI model id
    and as a folder name (the server is pinned to a local folder of that name)."""
    raw = f"{run_id}-{stage}" if run_id and stage else fallback
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._")[:64] or "model"


def served_model_id(uri: str, manifest: Manifest | None, model_id: str | None = None) -> str:
    """The OpenAI `model` id a server of `uri` answers to: `model_id`, else `<run_id>-<stage>`, else the folder name."""
    name = model_id or default_model_id(
        manifest.run_id if manifest else None, manifest.stage if manifest else None, Path(uri.rstrip("/")).name
    )
    if not MODEL_ID.match(name):
        raise ConfigError(
            f"--model-id {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def chat_template_of(tokenizer_dir: Path) -> str | None:
    """The template a tokenizer folder carries: chat_template.jinja, else tokenizer_config.json's."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = tokenizer_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def serving_template(template: str, system_prompt: str | None) -> str:
    """The chat template a server applies: the training template without TRL's {% generation %} markers
    (servers other than transformers do not know them) and, with a system prompt, one that starts the
    conversation with it unless the request's first message is a system message."""
    template = _GENERATION_TAGS.sub("", template)
    if not system_prompt:
        return template
    literal = json.dumps(system_prompt)  # a valid Jinja string literal (\\uXXXX escapes are decoded by Jinja)
    prefix = (
        "{%- if not messages or messages[0]['role'] != 'system' %}"
        f"{{%- set messages = [{{'role': 'system', 'content': {literal}}}] + messages %}}"
        "{%- endif %}"
    )
    return prefix + template
