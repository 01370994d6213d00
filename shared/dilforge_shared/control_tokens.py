"""The shape every control token of the known families has (<|eot_id|>, <|im_start|>, <|reserved_special_token_3|>).

User text holding one renders as a forged turn, so serve, chat and SFT data refuse it and curate strips it: one rule
that needs no tokenizer (and no `families`)."""

from __future__ import annotations

import re

CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,64}\|>")


def control_token_in(text: str) -> str | None:
    """The first substring of `text` shaped like a family control token, or None."""
    match = CONTROL_TOKEN.search(text)
    return match.group(0) if match else None
