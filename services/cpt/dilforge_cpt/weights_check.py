"""Check an HF model folder's weights before it is published as a `model` artifact.

A folder that only *looks* right (config.json, *.safetensors, tokenizer.json) used to be published, and failed
later with a raw traceback in CPT or `coordinator chat`: tensors of another shape than the config, a header that
declares more bytes than the file holds (or a huge header), a truncated file. Checked here, in order, cheapest
first; each failure is one InputError naming the file and the tensor:

1. every safetensors header is bounded, parses, and its data offsets tile the file exactly;
2. the tensors' names and shapes are the ones the config's architecture builds (on the meta device: no memory);
3. every tensor loads (safetensors reads it back).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from dilforge_shared.errors import InputError

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit for the JSON header
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size; InputError naming the file."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise InputError(
                f"not a safetensors file: {size} bytes, shorter than its 8-byte header length", path=str(path)
            )
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise InputError(
                f"safetensors header declares {length:,} bytes, the file has {size:,}: truncated or "
                "not a safetensors file",
                path=str(path),
            )
        try:
            header = json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"safetensors header is not valid JSON: {exc}", path=str(path)) from None
    if not isinstance(header, dict):
        raise InputError("safetensors header is not a JSON object", path=str(path))
    data_bytes = size - 8 - length
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                dtype in DTYPE_BYTES
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(start, int)
                and isinstance(end, int)
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"tensor {name!r}: malformed header entry {str(info)[:120]}", path=str(path))
        need = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - start != need or start < 0:
            raise InputError(
                f"tensor {name!r}: {dtype}{shape} needs {need:,} bytes, its offsets give {end - start:,}",
                path=str(path),
            )
        if end > data_bytes:
            raise InputError(
                f"tensor {name!r} ends at byte {end:,} of the data, the file holds {data_bytes:,}: truncated",
                path=str(path),
            )
        spans.append((start, end, name))
    covered = 0
    for start, end, name in sorted(spans):
        if start != covered:
            raise InputError(
                f"tensor {name!r} starts at {start:,}, expected {covered:,} (overlapping or gapped data)",
                path=str(path),
            )
        covered = end
    if covered != data_bytes:
        raise InputError(f"tensors cover {covered:,} bytes of data, the file holds {data_bytes:,}", path=str(path))
    return header


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def expected_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Parameter names and shapes the folder's config builds (meta device), and whether embeddings are tied."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise InputError(
            f"config.json does not describe a causal LM transformers can build: {str(exc).splitlines()[0][:200]}",
            path=str(folder / "config.json"),
        ) from None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, tied


def verify_weights(folder: Path) -> None:
    """All three checks (module docstring); raises InputError naming the file and tensor that is wrong."""
    headers = {path: read_header(path) for path in weight_files(folder)}
    got: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for path, header in headers.items():
        for name, info in header.items():
            if name != "__metadata__":
                got[name], where[name] = tuple(info["shape"]), path
    expected, tied = expected_shapes(folder)
    if tied and "lm_head.weight" not in got:
        expected.pop("lm_head.weight", None)
    wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
    if wrong:
        name = wrong[0]
        raise InputError(
            f"tensor {name!r} has shape {list(got[name])}, config.json gives {list(expected[name])}"
            + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""),
            path=str(where[name]),
        )
    missing = sorted(set(expected) - set(got))
    if missing:
        raise InputError(
            f"the weights lack {len(missing)} tensor(s) config.json needs, e.g. {missing[:3]}", path=str(folder)
        )
    unexpected = sorted(k for k in set(got) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise InputError(
            f"the weights hold {len(unexpected)} tensor(s) the config's architecture does not have, "
            f"e.g. {unexpected[:3]}",
            path=str(folder),
        )
    from safetensors import SafetensorError, safe_open

    for path in headers:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    fh.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise InputError(f"tensors do not load: {str(exc).splitlines()[0][:200]}", path=str(path)) from None
