"""A tokenizer family's special tokens where they meet the outside world. In text a user gave (training data,
requests, system prompts) a control token would forge a turn, so the stages that take such text find them here
(`CONTROL_TOKEN` needs no tokenizer). Published model folders carry them for stock servers and `from_pretrained`:
the family's bos/eos/pad ids and chat template beside the weights, an adapter merged into its base."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from . import CONTROL_TOKEN
from .errors import InputError
from .families import GENERATION_CONFIG_FILE, Family, detect_family

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def control_token_in(text: str) -> str | None:
    """The first substring of `text` shaped like a family control token, or None."""
    match = CONTROL_TOKEN.search(text)
    return match.group(0) if match else None


def special_tokens(tokenizer) -> list[str]:
    """Every special token of a tokenizer (a transformers tokenizer or a `tokenizers.Tokenizer`): the family's
    markers and its own, not `<|word|>`-shaped (SmolLM2's `<repo_name>`, `<file_sep>`). Where the special tokens
    are parsed (a chat template's render), text holding one is encoded as that control id."""
    if hasattr(tokenizer, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
        added = tokenizer.get_added_tokens_decoder().values()
        tokens = set()
    else:
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        tokens = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
    tokens |= {t.content for t in added if t.special}
    tokens.discard("")
    return sorted(tokens, key=len, reverse=True)


def special_token_pattern(tokens: Iterable[str]) -> re.Pattern[str] | None:
    """A pattern matching any of `tokens` (longest first), or None when there is none."""
    tokens = sorted((t for t in tokens if t), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def special_token_in(text: str, pattern: re.Pattern[str] | None) -> str | None:
    """The first family control token or special token of `pattern` (`special_token_pattern`) in `text`, or None."""
    return control_token_in(text) or (m.group(0) if pattern is not None and (m := pattern.search(text)) else None)


def system_prompt_problem(text: str, specials: Iterable[str] = ()) -> str | None:
    """Why `text` cannot be a default system message, or None: a control token (the families' or one of `specials`)
    would forge turns; a triple quote, or a closing quote, would end the Modelfile's SYSTEM block (it has no escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid text (character {exc.start} is a lone surrogate: bytes that were not UTF-8)"
    if "\x00" in text:
        return "contains a NUL character"
    token = control_token_in(text) or next((t for t in specials if t and t in text), None)
    if token is not None:
        return f"contains the control token {token!r}, which would forge a turn in every conversation"
    if '"""' in text or text.endswith('"'):
        return "contains a triple quote (or ends with a quote), which would end the Modelfile's SYSTEM block"
    return None


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
