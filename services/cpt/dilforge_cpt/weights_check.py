"""Check an HF model folder's weights before publishing, cheapest first: safetensors headers, the names and shapes
the config builds, every tensor loads. Each failure is one InputError naming the file and tensor."""

from __future__ import annotations

import math
import numbers
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


SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",
)  # fmt: skip


def check_dimensions(dims: dict, num_weights: int | None, path: str) -> None:
    """Before anything is built (an absurd config takes minutes even on the meta device): sizes are positive
    integers, the heads divide, and the parameters the sizes imply (embedding, attention, MLP: a lower bound) are
    not more than the weight files hold. `num_weights` None: the checks that need no weights."""
    dims = dict(dims)
    for name in SIZE_FIELDS:
        value = dims.get(name)
        if value is None:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise InputError(f"{name} must be a positive integer (got {value!r})", path=path)
        dims[name] = int(value)  # GGUF metadata holds numpy integers
    hidden, heads, layers = dims.get("hidden_size"), dims.get("num_attention_heads"), dims.get("num_hidden_layers")
    if not (hidden and heads and layers):
        return
    kv = dims.get("num_key_value_heads") or heads
    if heads % kv:
        raise InputError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})", path=path)
    head_dim = dims.get("head_dim") or hidden // heads
    if not dims.get("head_dim") and hidden % heads:
        raise InputError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})", path=path)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    implied = (dims.get("vocab_size") or 0) * hidden + layers * (
        attention + 3 * hidden * (dims.get("intermediate_size") or 0)
    )
    if num_weights is not None and implied > num_weights:
        raise InputError(
            f"the sizes ({layers} layers, hidden {hidden}, vocabulary {dims.get('vocab_size')}) imply at least "
            f"{implied:,} parameters; the weights hold {num_weights:,}",
            path=path,
        )


def check_tokenizer_fits(folder: Path, vocab_size: int | None) -> None:
    """Every id the tokenizer can produce has an embedding row (else `chat` fails with an IndexError)."""
    import json

    path = folder / "tokenizer.json"
    if not vocab_size or not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", 0) for t in data.get("added_tokens", [])]
    top = max((i for i in ids if isinstance(i, int)), default=-1)
    if top >= vocab_size:
        raise InputError(
            f"the tokenizer has ids up to {top}, the model's embedding {vocab_size} rows (config.json vocab_size): "
            "the tokenizer does not belong to these weights",
            path=str(path),
        )


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


def _config_dict(folder: Path) -> dict:
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"config.json does not read: {exc}", path=str(folder / "config.json")) from None
    return config if isinstance(config, dict) else {}


def verify_weights(folder: Path) -> dict[Path, dict[str, dict]]:
    """All three checks (module docstring), InputError naming the file and tensor that is wrong; the headers."""
    headers = {path: read_header(path) for path in sorted(folder.glob("*.safetensors"))}
    got: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for path, header in headers.items():
        for name, info in header.items():
            got[name], where[name] = tuple(info["shape"]), path
    config = _config_dict(folder)
    check_dimensions(config, sum(math.prod(s) for s in got.values()), str(folder / "config.json"))
    check_tokenizer_fits(folder, config.get("vocab_size"))
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
    return headers
