#!/usr/bin/env python
"""Build the Llama 3.2 tokenizer as an HF folder, offline, from Meta's tiktoken file.

The file is `llama_models/llama3/tokenizer.model` inside the PyPI wheel llama-models==0.3.0
(`pip download --no-deps llama-models==0.3.0`); transformers' TikTokenConverter turns its 128,000
BPE ranks into a tokenizer.json, and Llama 3's 256 special tokens take ids 128000-128255.

The Llama 3.2 Community License attaches attribution terms: write the folder OUTSIDE the repository
and never commit it.

    pip download --no-deps llama-models==0.3.0 -d /tmp/llama-models
    python scripts/build_llama32_tokenizer.py --wheel /tmp/llama-models/llama_models-0.3.0-py3-none-any.whl \
        --out /tmp/llama32-tokenizer

The folder's chat template and special-token roles follow dilforge's convention (families.LLAMA3: bos
<|begin_of_text|>, eos <|eot_id|>, pad <|finetune_right_pad_id|>, TRL's llama3 template with
generation markers), so it serves as `base_tokenizer` for every strategy.
"""

from __future__ import annotations

import argparse
import base64
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MEMBER = "llama_models/llama3/tokenizer.model"
CHECK = ("Hello world", [9906, 1917])


def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
    """Same as tiktoken.load.load_tiktoken_bpe for a local file (`<base64 token> <rank>` per line)."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tokenizer_model(wheel: Path | None, workdir: Path) -> Path:
    if wheel is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "llama-models==0.3.0", "-d", str(workdir)],
            check=True,
        )
        wheel = next(workdir.glob("llama_models-0.3.0-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(MEMBER, workdir)
    return workdir / MEMBER


def convert(model_file: Path, out: Path) -> None:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "services" / "tokenizer"), str(root / "shared")]
    from dilforge_shared.families import LLAMA3
    from dilforge_tokenizer import family_out

    class Converter(TikTokenConverter):
        load_tiktoken_bpe = staticmethod(load_tiktoken_bpe)  # no tiktoken dependency

    tok = Converter(vocab_file=str(model_file)).converted()
    if tok.get_vocab_size() != 128_000:
        raise SystemExit(f"expected 128000 BPE ranks, got {tok.get_vocab_size()}")
    tok = family_out.finish(tok, LLAMA3)  # 256 specials at 128000-128255, BOS prepended on encode
    family_out.write_folder(tok, out, LLAMA3)


def check(out: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text, expected = CHECK
    raw = Tokenizer.from_file(str(out / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    hf = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    specials = {
        t: hf.convert_tokens_to_ids(t)
        for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    }
    want = {
        "<|begin_of_text|>": 128000,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eot_id|>": 128009,
    }
    if raw != expected or ids != expected or specials != want or len(hf) != 128256:
        raise SystemExit(
            f"check failed: {text!r} -> {raw} / {ids} (want {expected}); specials {specials}; len {len(hf)}"
        )
    print(f"ok: {text!r} -> {ids}; specials {specials}; {len(hf)} tokens; written to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Output folder (outside the repository).")
    parser.add_argument("--wheel", type=Path, help="llama_models-0.3.0 wheel; downloaded with pip when omitted.")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[1]
    if args.out.resolve().is_relative_to(repo):
        raise SystemExit(f"--out {args.out} is inside the repository; the converted file must not be committed")
    with tempfile.TemporaryDirectory() as tmp:
        convert(tokenizer_model(args.wheel, Path(tmp)), args.out)
    check(args.out)


if __name__ == "__main__":
    main()
