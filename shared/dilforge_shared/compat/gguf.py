"""transformers' GGUF reader and tokenizer mapping: metadata, tensor table and tokenizer without a second parse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import first_use


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF key/value metadata (general.*, llama.*, tokenizer.ggml.*) without reading any tensor."""
    first_use()
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    return metadata


def gguf_header(path: Path):
    """The file's tensor table as transformers' GGUF header reads it: `.tensors` (name, shape, ggml type, offset,
    nbytes) and `.data_start` (where the tensor data begins)."""
    first_use()
    from transformers.integrations.gguf.reader import GgufHeader

    return GgufHeader.from_file(str(path))


def gguf_tokenizer(path: Path) -> tuple[str, dict, dict]:
    """(architecture, tokenizer dict with `tokens` and `merges` in full, tokenizer config) as transformers' GGUF
    tokenizer mapping reads them; other arrays (`scores`, `token_type`) are left as counts."""
    first_use()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    return get_gguf_tokenizer(str(path))


def save_gguf_tokenizer(parts: tuple[str, dict, dict], out: Path) -> None:
    """The tokenizer `gguf_tokenizer` read, built by transformers' GGUF tokenizer mapping and saved as an HF fast
    tokenizer folder (what `AutoTokenizer.from_pretrained(gguf_file=...)` does, without its second parse)."""
    first_use()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, tokenizer_config = parts
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(str(out))
