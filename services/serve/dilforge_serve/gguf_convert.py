"""llama.cpp's own converter (`convert_hf_to_gguf.py`) on a prepared HF folder, told the base tokenizer's
pre-tokenizer name (it names one by hashing how the tokenizer encodes a test string, which an extended vocabulary
changes). The only code touching the converter's internals; it runs in its own process:

  python -m dilforge_serve.gguf_convert SOURCES MODEL_DIR OUTFILE OUTTYPE BASE_TOKENIZER_DIR"""

from __future__ import annotations

import sys
from pathlib import Path


def pre_tokenizer_name(sources: Path, base_tokenizer_dir: Path) -> str:
    """The converter's name for the base tokenizer's pre-tokenizer (e.g. `smollm`, `llama-bpe`)."""
    from transformers import AutoTokenizer

    text_model = converter_module(sources).TextModel
    tokenizer = AutoTokenizer.from_pretrained(str(base_tokenizer_dir), trust_remote_code=False)
    try:
        return text_model.get_vocab_base_pre(text_model.__new__(text_model), tokenizer)
    except NotImplementedError as exc:
        raise SystemExit(f"llama.cpp does not know the base tokenizer's pre-tokenizer: {exc}") from None


def converter_module(sources: Path):
    """llama.cpp's `conversion` package from SOURCES (its vendored gguf-py first on sys.path, as the script does)."""
    sys.path.insert(0, str(sources))
    sys.path.insert(1, str(sources / "gguf-py"))
    import conversion

    return conversion


def main(argv: list[str]) -> int:
    sources, model_dir, outfile, outtype, base_tok = argv
    sources = Path(sources)
    name = pre_tokenizer_name(sources, Path(base_tok))
    print(f"gguf_convert: pre-tokenizer {name!r} (the base tokenizer's, {base_tok})", flush=True)
    text_model = converter_module(sources).TextModel
    text_model.get_vocab_base_pre = lambda self, tokenizer: name
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", outfile, "--outtype", outtype]
    import runpy

    runpy.run_path(str(sources / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
