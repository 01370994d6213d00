"""The one door to library internals: every use of a non-public module or underscore name of torch,
transformers, trl, peft, liger-kernel or datasets in production code is a function in this package, one module per
internal (`dcp`, `gguf`, `serve`: each stage loads only the one it uses), checked against the version
ranges here (CHECKED). tests/unit/test_compat.py exercises each function on real inputs and scans the production
tree: an import of such a name anywhere else fails there, so an upgrade that moves one breaks here, by name, first.
Imports are lazy: each image installs only the libraries it needs.

What each use is for, and why the public API does not do it:
- `dcp` (torch.distributed.checkpoint): `safe_dcp_reader` subclasses FileSystemReader to unpickle `.metadata` with an
  allow-list (the stock reader unpickles whatever a crafted file names); that needs the reader's private
  `_get_metadata_path` and DCP's metadata types (some private) by name.
- `gguf` (transformers GGUF: `gguf_metadata`, `gguf_header`, `gguf_tokenizer`, `save_gguf_tokenizer`): `from_pretrained(gguf_file=...)`
  parses a whole GGUF into Python objects twice; the importer needs only the metadata, the tensor table and the
  tokenizer mapping, which transformers keeps in `transformers.integrations.gguf`.
- `serve` (transformers serve, `serve_command_app`): the `transformers serve` command's class (`transformers.cli.serve.Serve`)
  is documented only as a CLI; dilforge builds its app without starting it, to run it behind its request guard.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version

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
def first_use() -> None:
    """The version warning, once per process: only a process that uses an internal needs it."""
    warn_unchecked_versions()
