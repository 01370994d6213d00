"""How a server presents an artifact, the same for `coordinator serve` / `deploy`, the serve image and eval: what to
load (`resolve_chat_model`, also for `coordinator chat`), the served chat template that makes the SFT config's
`system_prompt` the default system message, and the ids generation stops on (no torch)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, InputError
from .families import Family, detect_family
from .manifest import Manifest
from .models import MARKERS, Resolved, choose, find_dir, open_model, resolve
from .store import Artifact

_GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


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


def adapter_base(adapter: Resolved) -> str | None:
    """The one way an adapter's base model is found (eval, chat, serve): an adapter artifact's base is what
    its SFT run used, read from its manifest by the same rule the SFT stage applied (`choose` over the
    recorded config field `base_model` and the recorded inputs `cpt`, `model`); a plain adapter folder's is
    adapter_config.json's `base_model_name_or_path` (dilforge's SFT writes the base's URI there too)."""
    if adapter.manifest is not None:
        inputs = {r.name: r.uri for r in adapter.manifest.inputs if r.kind == "manifest"}
        picked = choose("base_model", adapter.manifest.config.get("base_model"), inputs)
        if picked is not None:
            return picked.uri
    try:
        return json.loads((adapter.path / MARKERS["adapter"]).read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError):
        return None


@dataclass
class ChatModel:
    """What to load for inference: base weights, an optional adapter on top, the tokenizer to use, and the
    artifact's manifest (None for a plain HF folder)."""

    base_dir: Path
    adapter_dir: Path | None
    tokenizer_dir: Path
    description: str
    manifest: Manifest | None = None


def resolve_chat_model(
    source: str | Artifact,
    base: str | None = None,
    endpoint_url: str | None = None,
    prefer_merged: bool = False,
    cache_dir: Path | None = None,
    fetched: Iterable[Artifact] = (),
) -> ChatModel:
    """Any model or adapter artifact (or HF folder) → base + adapter folders, for chat, serve and eval.
    `prefer_merged`: a model folder (an SFT artifact's merged/) wins over an adapter beside it. An adapter's base is
    `base`, else `adapter_base`; one of `fetched` (upstream artifacts already local) is used as it is."""
    uri = source.uri if isinstance(source, Artifact) else source
    src = open_model(source, endpoint_url, cache_dir)
    adapter_dir = find_dir(src.path, "adapter", uri, required=False)
    model_dir = find_dir(src.path, "model", uri, required=False)
    if adapter_dir is None or (prefer_merged and model_dir is not None):
        if model_dir is None:
            raise ConfigError(f"{uri}: no HF model folder (config.json + safetensors) or PEFT adapter in it")
        tok = find_dir(src.path, "tokenizer", uri, required=False) or model_dir
        what = "merged model of" if adapter_dir is not None else "model"
        return ChatModel(model_dir, None, tok, f"{what} {uri}", src.manifest)
    adapter = Resolved(adapter_dir, src.uri, src.manifest)
    base = base or adapter_base(adapter)
    if base is None:
        raise ConfigError(f"{uri}: an adapter without a recorded base model; pass --base")
    local = {art.uri.rstrip("/"): art for art in fetched}
    base_res = resolve(local.get(base.rstrip("/"), base), "model", endpoint_url, cache_dir)
    return ChatModel(base_res.path, adapter_dir, adapter_dir, f"adapter {uri} on base {base}", src.manifest)


def stop_token_ids(tokenizer, family: Family | None = None) -> list[int]:
    """Ids generation stops on: the family's end of turn and end of document (detected from the vocabulary when
    not given; none for a tokenizer of no known family), and the tokenizer's EOS."""
    vocab = tokenizer.get_vocab()
    if family is None:
        with contextlib.suppress(InputError):
            family = detect_family(vocab, "tokenizer")
    ids = [vocab[t] for t in (family.stop_tokens if family else []) if t in vocab] + [tokenizer.eos_token_id]
    # by vocabulary, not by "is not the unk id": SmolLM2's unk token is its document end, <|endoftext|>
    return list(dict.fromkeys(i for i in ids if isinstance(i, int) and i >= 0))
