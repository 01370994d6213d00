"""The one door to library internals: every use of a non-public module or underscore name of torch,
transformers, trl, peft, liger-kernel or datasets in production code is a function here, one module per internal
(`dcp`, `gguf`, `serve`: each stage loads only the one it uses), checked against the versions in CHECKED.
tests/unit/test_compat.py exercises each on real inputs and fails on such a name used anywhere else; what each is
for, and why the public API does not do it, is in docs/architecture.md. Imports are lazy."""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

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


def warn_unchecked_versions() -> dict[str, str]:
    """Warn of (and return, {distribution: installed version}) each installed library outside its CHECKED
    range: an internal used here may have moved. The server calls it at start, every door below on first use."""
    out = {}
    for name, (low, high) in CHECKED.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        try:
            inside = Version(low).release <= Version(installed).release <= Version(high).release
        except InvalidVersion:  # a local build's version string: unknown, so unchecked
            inside = False
        if not inside:
            out[name] = installed
            log.warning(
                "%s %s is outside the versions dilforge was checked against (%s to %s)", name, installed, low, high
            )
    return out


@functools.cache
def first_use() -> None:
    """The version warning, once per process: only a process that uses an internal needs it."""
    warn_unchecked_versions()
