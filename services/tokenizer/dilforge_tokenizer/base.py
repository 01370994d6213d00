"""The base tokenizer, once `dilforge_shared.models.resolve(..., "tokenizer")` found its folder: load, checks, copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dilforge_shared.errors import InputError
from dilforge_shared.models import TOKENIZER_FILES
from tokenizers import Tokenizer


def load(folder: Path, uri: str, parse_json: bool = True) -> tuple[Tokenizer, dict | None]:
    """The base as a tokenizers.Tokenizer and (when asked, for extend) its parsed tokenizer.json."""
    path = folder / "tokenizer.json"
    try:
        text = path.read_text(encoding="utf-8")
        return Tokenizer.from_str(text), json.loads(text) if parse_json else None
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise InputError(f"tokenizer.json does not load as a tokenizer: {exc}", path=f"{uri}/tokenizer.json") from None


def check_extendable(doc: dict, source: str) -> None:
    """One clear line when `extend` cannot continue this base's BPE (before any corpus is read)."""
    model = doc.get("model", {})
    if model.get("type") != "BPE":
        raise InputError(f"extend needs a BPE base tokenizer, got model type {model.get('type')!r}", path=source)
    if "ByteLevel" not in json.dumps(doc.get("pre_tokenizer")):
        raise InputError(
            "extend needs a byte-level BPE base (a ByteLevel pre-tokenizer, as Llama 3 / GPT-2 / SmolLM2)", path=source
        )
    if not model.get("merges"):
        raise InputError("extend needs a BPE base with merges; this tokenizer.json has none", path=source)


def vocab_tokens(doc: dict) -> list[str]:
    """Every token string of a tokenizer.json: the model's vocabulary and the added tokens. A BPE/WordPiece vocab
    is a {token: id} mapping, a Unigram one a list of [token, score] pairs (so a T5-style base is refused by
    `check_extendable` in one line rather than failing here)."""
    vocab = doc.get("model", {}).get("vocab") or {}
    tokens = [entry[0] if isinstance(entry, list | tuple) else entry for entry in vocab]
    return [*tokens, *(t["content"] for t in doc.get("added_tokens", []))]


def copy_folder(folder: Path, out: Path) -> None:
    """Publish the base unchanged (strategy base): its tokenizer files, byte for byte."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
