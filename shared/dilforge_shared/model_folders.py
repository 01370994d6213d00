"""Published model folders that stock servers and `from_pretrained` read as they are: an adapter merged into its
base, and the family's bos/eos/pad ids and chat template written beside the weights."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .errors import InputError
from .families import GENERATION_CONFIG_FILE, Family, detect_family

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def special_token_ids(tokenizer_json: Path) -> dict[str, int]:
    """content -> id of a tokenizer.json's added tokens (where every family's specials live), read as JSON."""
    try:
        doc = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the tokenizer: {exc}", path=str(tokenizer_json)) from None
    return {t["content"]: int(t["id"]) for t in doc.get("added_tokens", [])}


def generation_ids(family: Family, token_ids: Mapping[str, int]) -> dict[str, int | list[int] | None]:
    """bos/eos/pad ids for config.json and generation_config.json as the family's instruct models write them:
    eos lists every stop token the vocabulary has, so stock servers end an answer at the end of the turn."""
    eos = [token_ids[t] for t in family.stop_tokens if t in token_ids]
    if family.eot not in token_ids or family.doc_end not in token_ids:
        raise InputError(f"tokenizer lacks the {family.name} family's {family.eot} or {family.doc_end}")
    return {
        "bos_token_id": token_ids.get(family.bos) if family.bos is not None else None,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": token_ids.get(family.pad),
    }


def describe_model_folder(folder: Path) -> tuple[Family, dict]:
    """Make a published model folder describe itself to stock servers: the family's bos/eos/pad ids into config.json
    (when there is one) and generation_config.json, its chat template when the tokenizer has none. Returns
    (family, the ids written)."""
    tokens = special_token_ids(folder / "tokenizer.json")
    family = detect_family(tokens, str(folder))
    ids = generation_ids(family, tokens)
    for path in (folder / "config.json", folder / GENERATION_CONFIG_FILE):
        if path.is_file() or path.name == GENERATION_CONFIG_FILE:
            doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            path.write_text(json.dumps({**doc, **ids}, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tok_config = folder / "tokenizer_config.json"
    if not (folder / CHAT_TEMPLATE_FILE).is_file() and not (
        tok_config.is_file() and json.loads(tok_config.read_text(encoding="utf-8")).get("chat_template")
    ):
        (folder / CHAT_TEMPLATE_FILE).write_text(family.chat_template, encoding="utf-8")
    return family, ids


def merge_adapter(base_dir: Path, adapter_dir: Path, out: Path) -> None:
    """The adapter merged into its base (PEFT `merge_and_unload`, fp32 on CPU, from the saved files as a user
    would), saved to `out` in the base's own dtype. torch and peft are imported here, for the callers that merge."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, trust_remote_code=False)
    dtype = getattr(base.config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(dtype).save_pretrained(str(out), safe_serialization=True)
