"""Llama 3's tokenizer conventions, so a new tokenizer is a drop-in for Llama 3.x models.

Pre-tokenizer regex, byte-level alphabet, the 256 special tokens (ids right after the regular
vocabulary, as in Llama 3 where they are 128000-128255) and a chat template with generation
markers (TRL's llama3_training.jinja: same text as Llama 3's template, plus {% generation %} so
SFT can mask everything but assistant content and its <|eot_id|>).
"""

from __future__ import annotations

from pathlib import Path

from dilforge_shared.families import LLAMA3_CHAT_TEMPLATE
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
PAD = "<|finetune_right_pad_id|>"
_NAMED = {
    0: BOS,
    1: EOS,
    4: PAD,
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: EOT,
    10: "<|python_tag|>",
}


def special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (offset 0 = <|begin_of_text|>)."""
    tokens, reserved = [], 0
    for i in range(256):
        if i in _NAMED:
            tokens.append(_NAMED[i])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


CHAT_TEMPLATE = LLAMA3_CHAT_TEMPLATE  # one definition, in the shared families


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def empty_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def finish(tok: Tokenizer) -> Tokenizer:
    """Append the 256 special tokens after the regular vocabulary and prepend BOS on encode."""
    tok.add_special_tokens(special_tokens())
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok


def to_transformers(tok: Tokenizer, model_max_length: int = 131072):
    """Wrap as a transformers fast tokenizer with Llama 3's BOS/EOS/pad and chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save(tok: Tokenizer, out_dir: Path) -> None:
    """Write a folder that AutoTokenizer.from_pretrained and Tokenizer.from_file both load as is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    to_transformers(tok).save_pretrained(str(out_dir))


def tokenizer_config(model_max_length: int = 131072) -> dict:
    """The tokenizer_config.json `save` writes (class name readable by transformers 4 and 5)."""
    return {
        "backend": "tokenizers",
        "bos_token": BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_max_length": model_max_length,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_folder(tok: Tokenizer, out_dir: Path, model_max_length: int = 131072) -> None:
    """Same folder as `save`, written without importing transformers (seconds saved per stage run)."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
