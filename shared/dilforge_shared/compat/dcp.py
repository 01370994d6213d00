"""torch.distributed.checkpoint: a reader that unpickles a checkpoint's `.metadata` with an allow-list."""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
from pathlib import Path

from . import first_use

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
    first_use()
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
