"""Special tokens in text a user gave (training data, requests, system prompts): a control token there forges a
turn, so the stages that take such text find them here. `CONTROL_TOKEN` needs no tokenizer: the shape every control
token of the known families has (<|eot_id|>, <|im_start|>, <|reserved_special_token_3|>)."""

from __future__ import annotations

import re
from collections.abc import Iterable

CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,64}\|>")


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
