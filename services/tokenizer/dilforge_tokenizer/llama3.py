"""Llama 3's pre-tokenizer and 256 special tokens, so a new tokenizer is a drop-in for Llama 3.x models (the
family's chat template and roles: `dilforge_shared.families.LLAMA3`)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}


def special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (offset 0 = <|begin_of_text|>)."""
    reserved = iter(range(256))
    return [_NAMED.get(i) or f"<|reserved_special_token_{next(reserved)}|>" for i in range(256)]


def empty_bpe() -> Tokenizer:
    """An untrained byte-level BPE with Llama 3's pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(ignore_merges=True, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok
