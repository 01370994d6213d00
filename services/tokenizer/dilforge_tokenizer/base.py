"""The base tokenizer: an HF tokenizer folder on disk or under an s3:// prefix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import urlparse

from dilforge_shared.errors import InputError, ManifestNotFound
from dilforge_shared.store import NotFound, fetch, mirror_prefix
from tokenizers import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")


def resolve(uri: str, workdir: Path, endpoint_url: str | None = None) -> Path:
    """A local folder holding the base tokenizer's files: a dilforge artifact (tokenizer or model, verified),
    an HF folder, or an s3:// prefix (only the tokenizer files are downloaded, never the weights beside them)."""
    parsed = urlparse(uri)
    local = Path(uri[len("file://"):] if parsed.scheme == "file" else uri)
    art = None
    if parsed.scheme == "s3" or local.is_dir():
        try:
            art = fetch(uri, cache_dir=workdir / "base_artifact", endpoint_url=endpoint_url)
        except (ManifestNotFound, NotFound):
            pass
    if art is not None:
        if not (art.path / "tokenizer.json").is_file():
            raise InputError("base_tokenizer: the artifact has no tokenizer.json", path=uri)
        return art.path
    if parsed.scheme == "s3":
        out = workdir / "base_tokenizer"
        shutil.rmtree(out, ignore_errors=True)
        try:
            mirror_prefix(uri, out, endpoint_url, only=TOKENIZER_FILES)  # never the weights beside it
        except NotFound:
            pass
        if not (out / "tokenizer.json").is_file():
            raise InputError("no tokenizer.json under this S3 prefix (base_tokenizer must be an HF tokenizer folder)",
                             path=uri)
        return out
    path = local
    if not path.is_dir():
        raise InputError("base_tokenizer: no such folder", path=uri)
    if not (path / "tokenizer.json").is_file():
        raise InputError("base_tokenizer: the folder has no tokenizer.json (an HF fast-tokenizer folder is needed)",
                         path=uri)
    return path


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
        raise InputError("extend needs a byte-level BPE base (a ByteLevel pre-tokenizer, as Llama 3 / GPT-2 / "
                         "SmolLM2)", path=source)
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
