"""Check an HF model folder's weights before it is published as a `model` artifact.

A folder that only *looks* right (config.json, *.safetensors, tokenizer.json) used to be published, and failed
later with a raw traceback in CPT or `coordinator chat`: tensors of another shape than the config, a header that
declares more bytes than the file holds (or a huge header), a truncated file. Checked here, in order, cheapest
first; each failure is one InputError naming the file and the tensor:

1. every safetensors header is bounded, parses, and its data offsets tile the file exactly (safetensors' own
   `safe_open` checks, surfaced as one line naming the file);
2. the tensors' names and shapes are the ones the config's architecture builds (on the meta device: no memory);
3. every tensor loads (safetensors reads it back).
"""

from __future__ import annotations

from pathlib import Path

from dilforge_shared.errors import InputError


def read_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape"} of a safetensors file, as safetensors itself reads and validates the
    header (bounded, valid JSON, each tensor's byte span matching its dtype and shape, the spans tiling the data
    exactly, nothing past the end) without loading a tensor; InputError naming the file otherwise."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            slices = {name: fh.get_slice(name) for name in fh.keys()}  # noqa: SIM118 - safe_open has keys() only
            return {name: {"dtype": sl.get_dtype(), "shape": sl.get_shape()} for name, sl in slices.items()}
    except (SafetensorError, OSError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        hint = " (truncated, or bytes after the last tensor)" if "not fully covered" in reason else ""
        raise InputError(f"not a valid safetensors file: {reason}{hint}", path=str(path)) from None


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
