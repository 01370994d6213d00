"""Finish and write a tokenizer in its base model's family (`dilforge_shared.families`): special tokens, BOS rule,
and the family's training chat template (TRL `{% generation %}` markers, for SFT's masking)."""

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
    """A trained regular vocabulary + the special tokens after it (Llama 3's 256, else `base_specials`) and the
    family's BOS rule."""
    tok.add_special_tokens(llama3.special_tokens() if family.name == LLAMA3.name else base_specials(base_doc, family))
    byte_level = processors.ByteLevel(trim_offsets=False)
    if family.bos is None:
        tok.post_processor = byte_level
    else:
        bos = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, tok.token_to_id(family.bos))],
        )
        tok.post_processor = processors.Sequence([byte_level, bos])
    return tok


def write_folder(tok: Tokenizer, out_dir: Path, family: Family, model_max_length: int = 131072) -> None:
    """tokenizer.json, tokenizer_config.json (the special-token roles, a class name transformers 4 and 5 read) and
    the family's training chat template: a folder stock AutoTokenizer and tokenizers.Tokenizer.from_file load as
    is (no transformers import here)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"backend": "tokenizers", "clean_up_tokenization_spaces": False, "model_max_length": model_max_length}
    config.update(bos_token=family.bos, eos_token=family.eot, pad_token=family.pad)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").write_text(family.chat_template)


def verify_output(out: Path, tok: Tokenizer) -> dict:
    """Check what is about to be published: `tok` (the tokenizer just saved) round-trips text and the roles
    tokenizer_config.json names exist."""
    sample = "Azərbaycan dili türk dillərinin oğuz qrupuna daxildir. Hello world!"
    config_file = out / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except ValueError as exc:
        raise DilforgeError(f"output tokenizer in {out} does not load: {exc}") from None
    ids = tok.encode(sample, add_special_tokens=False).ids
    if tok.decode(ids) != sample:
        raise DilforgeError(f"output tokenizer in {out} does not round-trip text")
    roles = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token")}
    for role, token in roles.items():
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and tok.token_to_id(content) is None:
            raise DilforgeError(f"{config_file}: {role} {content!r} is not in the vocabulary")
    return {
        "vocab_size_total": tok.get_vocab_size(with_added_tokens=True),
        **roles,
        "has_chat_template": (out / "chat_template.jinja").exists() or "chat_template" in config,
    }
