"""The one place that touches transformers' private GGUF internals (`transformers.integrations.gguf`).

`from_pretrained(gguf_file=...)` parses the whole file into Python objects twice (~7 s on SmolLM2); the importer
needs only the metadata, the tensor table and the tokenizer mapping, which transformers keeps in modules that are
not public API. Every use goes through this module, and tests/unit/test_private_apis.py exercises each function
on a tiny GGUF, so a transformers upgrade that moves or changes them fails there, by name, first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_metadata(path: Path) -> dict[str, Any]:
    """The GGUF key/value metadata (general.*, llama.*, tokenizer.ggml.*) without reading any tensor."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    return metadata


def header(path: Path):
    """The file's tensor table as transformers' GGUF header reads it: `.tensors` (name, shape, ggml type, offset,
    nbytes) and `.data_start` (where the tensor data begins)."""
    from transformers.integrations.gguf.reader import GgufHeader

    return GgufHeader.from_file(str(path))


def save_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer the GGUF describes, built by transformers' GGUF tokenizer mapping and saved as an HF fast
    tokenizer folder (what `AutoTokenizer.from_pretrained(gguf_file=...)` does, without its second parse)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(str(out))
