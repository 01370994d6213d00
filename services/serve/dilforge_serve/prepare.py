"""What to serve (`resolve_served_model`) and the folder the server is pinned to, named by the model id: the
weights (linked, or an adapter merged into its base), the tokenizer, and a chat template whose default system
message is the SFT system prompt."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.errors import DilforgeError
from dilforge_shared.families import GENERATION_CONFIG_FILE
from dilforge_shared.model_id import served_model_id
from dilforge_shared.models import TOKENIZER_FILES
from dilforge_shared.serving import ChatModel, resolve_chat_model, serving_template
from dilforge_shared.specials import (
    CHAT_TEMPLATE_FILE,
    describe_model_folder,
    merge_adapter,
    special_token_ids,
    system_prompt_problem,
)

log = logging.getLogger("dilforge.serve")

WEIGHT_SUFFIXES = (".safetensors",)


@dataclass
class ServedModel(ChatModel):
    """A chat model resolved for serving, with its OpenAI `model` id and default system message."""

    model_id: str = "model"
    system_prompt: str | None = None


def resolve_served_model(
    uri: str,
    endpoint_url: str | None = None,
    base: str | None = None,
    model_id: str | None = None,
    system_prompt: str | None = None,
    prefer_merged: bool = True,
) -> ServedModel:
    """Any model/adapter artifact (local or s3://) or HF folder → what to serve: an SFT artifact's `merged/`
    folder when it has one (unless not `prefer_merged`), else base + adapter. `system_prompt` overrides the SFT
    config's (an empty string serves without a default system message)."""
    spec = resolve_chat_model(uri, base=base, endpoint_url=endpoint_url, prefer_merged=prefer_merged)
    if system_prompt is None and spec.manifest is not None and spec.manifest.stage == "sft":
        system_prompt = spec.manifest.config.get("system_prompt")
    return ServedModel(
        **vars(spec), model_id=served_model_id(uri, spec.manifest, model_id), system_prompt=system_prompt or None
    )


def check_system_prompt(text: str | None, field: str, tokenizer_dir: Path) -> None:
    """Refuse a default system prompt (served, or written into a Modelfile) holding a control token, the known
    families' or this tokenizer's own specials, or a triple quote; the error names where it came from."""
    if not text:
        return
    try:
        added = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    except (OSError, ValueError, AttributeError):
        added = []  # the tokenizer's own checks name a missing or broken file; the families' tokens still count
    specials = [t["content"] for t in added if isinstance(t, dict) and t.get("special") and t.get("content")]
    if problem := system_prompt_problem(text, specials):
        raise DilforgeError(f"{field} {problem}; give another --system-prompt")


def link_model_files(src: Path, out: Path) -> None:
    """Weights as symlinks (nothing is copied or ever written through); small JSON files as copies."""
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name in TOKENIZER_FILES:
            continue
        if path.name.endswith(WEIGHT_SUFFIXES):
            os.symlink(path.resolve(), out / path.name)
        elif path.suffix == ".json":
            shutil.copyfile(path, out / path.name)


def stop_at_turn_starts(folder: Path, family) -> list[int]:
    """Add the family's turn-start tokens to the served copy's generation stops (a model that emits one has
    ended its answer; else it generates them, invisible, until max_tokens). Returns the stop ids."""
    tokens = special_token_ids(folder / "tokenizer.json")
    path = folder / GENERATION_CONFIG_FILE
    gen = json.loads(path.read_text(encoding="utf-8"))
    eos = gen.get("eos_token_id")
    stops = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    stops += [tokens[t] for t in family.turn_starts if t in tokens and tokens[t] not in stops]
    gen["eos_token_id"] = stops
    path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stops


def prepare(spec: ServedModel, root: Path) -> Path:
    """Build `root/<model id>/` for `spec` in the server's own fresh folder `root`; returns it. Built on every
    start (cheap: links and JSON); an existing folder is never removed or written into (it is not ours)."""
    out = root / spec.model_id
    try:
        out.mkdir(parents=True)
    except FileExistsError:
        raise DilforgeError(f"{out} exists; the served folder is built only in a fresh folder") from None
    if spec.adapter_dir is not None:
        log.info("merging adapter %s into %s", spec.adapter_dir, spec.base_dir)
        merge_adapter(spec.base_dir, spec.adapter_dir, out)
    else:
        link_model_files(spec.base_dir, out)
    for name in TOKENIZER_FILES:
        if (spec.tokenizer_dir / name).is_file():
            shutil.copyfile(spec.tokenizer_dir / name, out / name)
    tok_config_path, jinja = out / "tokenizer_config.json", out / CHAT_TEMPLATE_FILE
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8")) if tok_config_path.is_file() else {}
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else tok_config.get("chat_template")
    if tok_config.pop("chat_template", None) is not None:  # one template only: the .jinja file below
        tok_config_path.write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    family, _ = describe_model_folder(out)
    stops = stop_at_turn_starts(out, family)
    template = (template if isinstance(template, str) else None) or family.chat_template
    (out / CHAT_TEMPLATE_FILE).write_text(serving_template(template, spec.system_prompt), encoding="utf-8")
    log.info(
        "serving %s as %r from %s (%s family, stops %s, default system message: %s)",
        spec.description,
        spec.model_id,
        out,
        family.name,
        stops,
        "yes" if spec.system_prompt else "none",
    )
    return out
