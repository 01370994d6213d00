"""The one door to library internals: every use of a non-public module or underscore name of torch,
transformers, trl, peft, liger-kernel or datasets in production code is a function here, with the version
range it was checked against (CHECKED). tests/unit/test_compat.py exercises each function on real inputs and
scans the production tree: an import of such a name anywhere else fails there, so an upgrade that moves one
breaks in this file, by name, first. Imports are lazy: each image installs only the libraries it needs.

What each use is for, and why the public API does not do it:
- torch.distributed.checkpoint: `safe_dcp_reader` subclasses FileSystemReader to unpickle `.metadata` with an
  allow-list (the stock reader unpickles whatever a crafted file names); that needs the reader's private
  `_get_metadata_path` and DCP's metadata types (some private) by name.
- transformers GGUF (`gguf_metadata`, `gguf_header`, `gguf_tokenizer`, `save_gguf_tokenizer`): `from_pretrained(gguf_file=...)`
  parses a whole GGUF into Python objects twice; the importer needs only the metadata, the tensor table and the
  tokenizer mapping, which transformers keeps in `transformers.integrations.gguf`.
- transformers serve (`serve_command_app`): the `transformers serve` command's class (`transformers.cli.serve.Serve`)
  is documented only as a CLI; dilforge builds its app without starting it, to run it behind its request guard.
- transformers Trainer checkpoints (`last_trainer_checkpoint`, `TRAINER_CHECKPOINT_PREFIX`): where Trainer
  writes and finds `checkpoint-<step>/`, which SFT seals and verifies.
"""

from __future__ import annotations

import enum
import functools
import io
import logging
import pathlib
import pickle
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# distribution: (lowest, highest) version these functions were checked against (the device's and the locks')
CHECKED = {
    "torch": ("2.11.0", "2.13.0"),
    "transformers": ("5.17.0", "5.24.0"),
    "trl": ("1.16.0", "1.16.0"),
    "peft": ("0.21.2", "0.21.2"),
    "liger-kernel": ("0.8.5", "0.8.5"),
    "datasets": ("5.2.0", "5.2.0"),
}
log = logging.getLogger("dilforge")


def _release(text: str) -> tuple[int, ...]:
    """(2, 13, 0) of "2.13.0+cpu", (5, 17, 0) of "5.17.0.dev0" or "5.17.0rc1": the release numbers only."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def warn_unchecked_versions() -> dict[str, str]:
    """Warn of (and return, {distribution: installed version}) each installed library outside its CHECKED
    range: an internal used here may have moved. The server calls it at start, every door below on first use."""
    out = {}
    for name, (low, high) in CHECKED.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if not _release(low) <= _release(installed) <= _release(high):
            out[name] = installed
            log.warning(
                "%s %s is outside the versions dilforge was checked against (%s to %s)", name, installed, low, high
            )
    return out


@functools.cache
def _first_use() -> None:
    """The version warning, once per process: only a process that uses an internal needs it."""
    warn_unchecked_versions()


# ---- torch.distributed.checkpoint ----------------------------------------------------------------------
DCP_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
}


def _enum_member(cls, name):
    """CPython 3.11.0-3.11.4 (Debian's 3.11.2 in the stage images) pickle an enum member as getattr(cls, name):
    only a member lookup on an allow-listed enum (_MEM_FORMAT_ENCODING) is built, never another attribute."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or name not in cls.__members__:
        raise pickle.UnpicklingError(f"checkpoint metadata uses getattr({cls!r}, {name!r}), which is not allowed")
    return cls[name]


class DcpMetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata types (and torch dtypes); anything else is an UnpicklingError naming it."""

    def find_class(self, module, name):
        import torch

        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in DCP_ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def safe_dcp_reader(path: Path):
    """A DCP FileSystemReader whose `.metadata` unpickler only builds DCP's metadata types."""
    _first_use()
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = DcpMetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


# ---- transformers: GGUF ----------------------------------------------------------------------------------
def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF key/value metadata (general.*, llama.*, tokenizer.ggml.*) without reading any tensor."""
    _first_use()
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    return metadata


def gguf_header(path: Path):
    """The file's tensor table as transformers' GGUF header reads it: `.tensors` (name, shape, ggml type, offset,
    nbytes) and `.data_start` (where the tensor data begins)."""
    _first_use()
    from transformers.integrations.gguf.reader import GgufHeader

    return GgufHeader.from_file(str(path))


def gguf_tokenizer(path: Path) -> tuple[str, dict, dict]:
    """(architecture, tokenizer dict with `tokens` and `merges` in full, tokenizer config) as transformers' GGUF
    tokenizer mapping reads them; other arrays (`scores`, `token_type`) are left as counts."""
    _first_use()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer

    return get_gguf_tokenizer(str(path))


def save_gguf_tokenizer(parts: tuple[str, dict, dict], out: Path) -> None:
    """The tokenizer `gguf_tokenizer` read, built by transformers' GGUF tokenizer mapping and saved as an HF fast
    tokenizer folder (what `AutoTokenizer.from_pretrained(gguf_file=...)` does, without its second parse)."""
    _first_use()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    architecture, tokenizer_dict, tokenizer_config = parts
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra).save_pretrained(str(out))


# ---- transformers: the `transformers serve` command -------------------------------------------------------------
def serve_command_app(model_id: str, **options: Any):
    """The FastAPI app `transformers serve <model_id>` runs, with the model preloaded and pinned (`force_model`),
    built by the command's own class but not started: `Serve.__init__(non_blocking=True)` ends by calling
    `start_server`, which this subclass leaves to the caller's uvicorn (so the app can run behind a guard)."""
    _first_use()
    from transformers.cli.serve import Serve

    class Unstarted(Serve):
        def start_server(self):
            pass

    serve = Unstarted(force_model=model_id, trust_remote_code=False, log_level="warning", non_blocking=True, **options)
    return serve.server.config.app


# ---- transformers: Trainer checkpoints ------------------------------------------------------------------------
def trainer_checkpoint_prefix() -> str:
    """The name Trainer gives its checkpoint folders (`<prefix>-<step>`)."""
    _first_use()
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return PREFIX_CHECKPOINT_DIR


def last_trainer_checkpoint(folder: Path) -> str | None:
    """The newest `checkpoint-<step>` folder Trainer would resume from, or None."""
    _first_use()
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(folder))
