"""Finish and write a tokenizer in its base model's family: special tokens, BOS rule, chat template.

The conventions come from `dilforge_shared.families`; the chat template written is the family's training
template (TRL `{% generation %}` markers), so SFT can mask everything but the assistant's turns."""

from __future__ import annotations

import json
from pathlib import Path

from dilforge_shared.errors import DilforgeError
from dilforge_shared.families import LLAMA3, Family
from tokenizers import Tokenizer, processors

from . import llama3


def base_specials(base_doc: dict | None, family: Family) -> list[str]:
    """The special tokens a replacement carries: the base's own (in id order) when it is ChatML, else the family's."""
    if base_doc is not None:
        specials = [
            t["content"] for t in sorted(base_doc.get("added_tokens", []), key=lambda t: t["id"]) if t.get("special")
        ]
        if all(s in specials for s in family.specials):
            return specials
    return family.specials


def finish(tok: Tokenizer, family: Family, base_doc: dict | None = None) -> Tokenizer:
    """A trained regular vocabulary + the family's specials (after it) and its BOS rule."""
    if family.name == LLAMA3.name:
        return llama3.finish(tok)
    tok.add_special_tokens(base_specials(base_doc, family))
    if family.bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{family.bos} $A",
                    pair=f"{family.bos} $A {family.bos} $B",
                    special_tokens=[(family.bos, bos_id)],
                ),
            ]
        )
    return tok


def tokenizer_config(family: Family, model_max_length: int = 131072) -> dict:
    """Special-token roles for transformers (class name readable by transformers 4 and 5)."""
    return {
        "backend": "tokenizers",
        "bos_token": family.bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": family.eot,
        "model_max_length": model_max_length,
        "pad_token": family.pad,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_folder(tok: Tokenizer, out_dir: Path, family: Family, model_max_length: int = 131072) -> None:
    """tokenizer.json, tokenizer_config.json and the family's training chat template: a folder stock
    AutoTokenizer and tokenizers.Tokenizer.from_file load as is (no transformers import here)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(family, model_max_length), indent=2) + "\n"
    )
    (out_dir / "chat_template.jinja").write_text(family.chat_template)


def verify_output(out: Path, tok: Tokenizer | None) -> dict:
    """Check what is about to be published: the tokenizer round-trips text and the special-token roles
    named in tokenizer_config.json exist. `tok` is the tokenizer just saved (not reloaded here; the tests load
    every strategy's output with both libraries)."""
    sample = "Azərbaycan dili türk dillərinin oğuz qrupuna daxildir. Hello world!"
    config_file = out / "tokenizer_config.json"
    try:
        raw = tok or Tokenizer.from_file(str(out / "tokenizer.json"))
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise DilforgeError(f"output tokenizer in {out} does not load: {exc}") from None
    ids = raw.encode(sample, add_special_tokens=False).ids
    if raw.decode(ids) != sample:
        raise DilforgeError(f"output tokenizer in {out} does not round-trip text")
    roles = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token")}
    for role, token in roles.items():
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and raw.token_to_id(content) is None:
            raise DilforgeError(f"{config_file}: {role} {content!r} is not in the vocabulary")
    return {
        "vocab_size_total": raw.get_vocab_size(with_added_tokens=True),
        **roles,
        "has_chat_template": (out / "chat_template.jinja").exists() or "chat_template" in config,
    }
