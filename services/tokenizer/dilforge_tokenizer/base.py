"""The base tokenizer: resolved, loaded, checked against the strategies before any corpus is read, copied for
`base`."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.contract import StageContext
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.families import Family, detect_family
from dilforge_shared.models import TOKENIZER_FILES, choose, resolve
from tokenizers import Tokenizer

from .config import TokenizerConfig


def load(folder: Path, uri: str) -> tuple[Tokenizer, dict]:
    """The base as a tokenizers.Tokenizer and its parsed tokenizer.json."""
    path = folder / "tokenizer.json"
    try:
        text = path.read_text(encoding="utf-8")
        return Tokenizer.from_str(text), json.loads(text)
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
    """Every token string of a tokenizer.json: the model's vocabulary (a BPE {token: id} or a Unigram list of
    [token, score]) and the added tokens."""
    vocab = doc.get("model", {}).get("vocab") or {}
    tokens = [entry[0] if isinstance(entry, list | tuple) else entry for entry in vocab]
    return [*tokens, *(t["content"] for t in doc.get("added_tokens", []))]


def copy_folder(folder: Path, out: Path) -> None:
    """Publish the base unchanged (strategy base): its tokenizer files, byte for byte."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)


@dataclass
class Base:
    """The base tokenizer, wherever it came from, and its family (None when unknown)."""

    folder: Path
    uri: str
    tok: Tokenizer
    doc: dict
    family: Family | None


def resolve_base(config: TokenizerConfig, ctx: StageContext) -> Base | None:
    """`base_tokenizer` when set, else the upstream `model` artifact's tokenizer, else None (`models.choose`); an
    `extend` over a base it cannot continue is refused here, before any corpus is read (a missing base is refused
    with the request: `TokenizerConfig.needed_inputs`)."""
    choice = choose("base_tokenizer", config.base_tokenizer, ctx.request.inputs, order=("model",))
    if choice is None:
        return None
    uri = choice.uri
    source = ctx.input(choice.input) if choice.input else uri
    try:
        folder = resolve(source, "tokenizer", endpoint_url=ctx.endpoint_url, cache_dir=ctx.cache_dir).path
    except ConfigError as exc:
        raise InputError(f"{choice.field}: {str(exc).removeprefix(f'{uri}: ')}", path=uri) from None
    if folder.is_file():
        raise InputError(f"{choice.field}: a folder (or artifact) with tokenizer.json is needed, not a file", path=uri)
    tok, doc = load(folder, uri)
    extend = "extend" in config.strategies
    if extend:
        check_extendable(doc, f"{uri.rstrip('/')}/tokenizer.json")
    try:
        family = detect_family(vocab_tokens(doc), uri)
    except InputError:
        if extend:  # extend writes the base's family: an unknown one is an error, else the output is Llama 3's
            raise
        family = None
    return Base(folder=folder, uri=uri, tok=tok, doc=doc, family=family)
