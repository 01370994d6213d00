"""A Llama GGUF → a plain fp32 LlamaForCausalLM safetensors folder with its tokenizer, in numpy with the `gguf`
package's kernels and transformers' GGUF tokenizer mapping (dilforge_shared.compat.gguf)."""

from __future__ import annotations

import struct
from pathlib import Path

from dilforge_shared.compat import gguf as compat_gguf
from dilforge_shared.errors import InputError
from dilforge_shared.manifest import sha256_file

from .weights_check import check_dimensions

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


def gguf_metadata(path: Path) -> dict:
    """A GGUF file's metadata (string arrays left as counts), without touching tensors; InputError on junk."""
    try:
        metadata = compat_gguf.gguf_metadata(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError/struct.error/IndexError on junk
        raise InputError(f"not a readable GGUF file: {exc}", path=str(path)) from None
    return metadata


# llama.cpp names → transformers LlamaForCausalLM names (the blk.N prefix is handled in `hf_name`)
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str | None:
    """The LlamaForCausalLM parameter name of a llama GGUF tensor (None: not a parameter, e.g. rope_freqs)."""
    if gguf_name in GGUF_TENSOR_NAMES:
        return GGUF_TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{leaf}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope(weight, num_heads: int):
    """Undo llama.cpp's q/k row order: its converter interleaves each head's two rotary halves
    (convert_hf_to_gguf.py `permute`); HF Llama keeps them as two halves."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# the metadata `llama_config_from_gguf` cannot do without (the rest has defaults)
GGUF_REQUIRED_KEYS = (
    "attention.head_count",
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "context_length",
    "attention.layer_norm_rms_epsilon",
)


def llama_config_from_gguf(meta: dict, tied: bool):
    """A LlamaConfig from llama.cpp's metadata keys (the same fields transformers' GGUF loader maps)."""
    from transformers import LlamaConfig

    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    token_ids = {
        f"{name}_token_id": meta.get(f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
    }
    return LlamaConfig(
        vocab_size=meta.get(f"{arch}.vocab_size") or meta["tokenizer.ggml.tokens"],
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta.get(f"{arch}.rope.dimension_count", hidden // heads),
        max_position_embeddings=meta[f"{arch}.context_length"],
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        tie_word_embeddings=tied,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
        **{k: v for k, v in token_ids.items() if v is not None},
    )


def dequantized_tensors(path: Path):
    """(name in the file, fp32 numpy array in torch layout) for every tensor, dequantized with the
    `gguf` package's numpy kernels, read from a memory map."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        header = compat_gguf.gguf_header(path)
    except ValueError as exc:  # e.g. a quantization type without a dequantization kernel (Q8_1, I8, ...)
        raise InputError(f"cannot read its tensors: {str(exc).removeprefix(f'{path} ')}", path=str(path)) from None
    except (struct.error, IndexError, OverflowError, EOFError) as exc:  # the tensor table itself is cut off
        raise InputError(f"truncated GGUF: its tensor table is cut off ({exc})", path=str(path)) from None
    blob = np.memmap(str(path), mode="r", dtype=np.uint8)
    for info in header.tensors:
        end = header.data_start + info.offset + info.nbytes
        if end > blob.size:
            raise InputError(
                f"truncated GGUF: tensor {info.name} needs bytes up to {end:,}, the file has {blob.size:,}",
                path=str(path),
            )
    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    for info in header.tensors:
        qtype = GGMLQuantizationType(info.ggml_type)
        raw = blob[header.data_start + info.offset : header.data_start + info.offset + info.nbytes]
        if qtype in plain:
            array = raw.view(plain[qtype]).reshape(info.shape).astype(np.float32)
        else:
            block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
            row_bytes = info.shape[-1] // block_elements * block_bytes
            array = dequantize(np.asarray(raw).reshape(-1, row_bytes), qtype).reshape(info.shape)
        yield info.name, array


def convert_gguf(path: Path, out: Path) -> dict:
    """Dequantize a Llama GGUF into a plain fp32 LlamaForCausalLM safetensors folder with its tokenizer.

    Not `from_pretrained(gguf_file=...)`: that model is marked quantized, which `save_pretrained` refuses. The
    integration test checks this folder's logits against transformers' own GGUF loading."""
    if not path.is_file():
        raise InputError("no such GGUF file", path=str(path))
    meta = gguf_metadata(path)
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise InputError(
            f"GGUF architecture {arch!r} is not supported (dilforge imports "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} models)",
            path=str(path),
        )
    missing = [f"{arch}.{key}" for key in GGUF_REQUIRED_KEYS if f"{arch}.{key}" not in meta]
    if missing:
        raise InputError(f"GGUF metadata lacks {', '.join(missing)}", path=str(path))
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaForCausalLM

    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    dims = {
        "vocab_size": meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens"),
        "hidden_size": meta[f"{arch}.embedding_length"],
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    check_dimensions(dims, None, str(path))  # types and heads, before any tensor is read
    tokenizer = read_gguf_tokenizer(path, meta)
    state, skipped = {}, []
    for name, array in dequantized_tensors(path):
        target = hf_name(name)
        if target is None:
            skipped.append(name)
            continue
        if ".self_attn.q_proj." in target:
            array = unpermute_rope(array, heads)
        elif ".self_attn.k_proj." in target:
            array = unpermute_rope(array, kv_heads)
        state[target] = torch.from_numpy(array.copy())
    tied = "lm_head.weight" not in state
    check_dimensions(dims, sum(v.numel() for v in state.values()), str(path))  # before a model is built from them
    config = llama_config_from_gguf(meta, tied)
    with torch.device("meta"):
        expected = {
            k: tuple(v.shape)
            for k, v in LlamaForCausalLM(config).state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise InputError(
            f"GGUF tensors do not match a LlamaForCausalLM (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, wrong shape {wrong[:3]})",
            path=str(path),
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    compat_gguf.save_gguf_tokenizer(tokenizer, out)
    return {
        "gguf_file": path.name,
        "gguf_sha256": sha256_file(path),
        "gguf_architecture": arch,
        "gguf_tensors_skipped": skipped,
    }


GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}


def read_gguf_tokenizer(path: Path, meta: dict) -> tuple[str, dict, dict]:
    """The tokenizer the GGUF describes, checked for what would otherwise fail deep inside the tokenizers library
    (a merge naming a token the vocabulary lacks, a SentencePiece vocabulary without scores) or later at `chat`
    (ids past the embedding rows): one error naming the metadata key, before any tensor is read."""
    where = str(path)
    model = meta.get("tokenizer.ggml.model")
    if model not in GGUF_TOKENIZER_MODELS:
        kinds = ", ".join(f"{k} ({v})" for k, v in GGUF_TOKENIZER_MODELS.items())
        raise InputError(f"tokenizer.ggml.model is {model!r}; dilforge imports {kinds} tokenizers", path=where)
    try:
        parts = compat_gguf.gguf_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises KeyError/IndexError/ValueError on bad metadata
        raise InputError(f"cannot read the GGUF tokenizer: {exc!r}", path=where) from None
    tokens = parts[1].get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InputError("tokenizer.ggml.tokens is missing, empty or not a list of strings", path=where)
    if model == "llama" and meta.get("tokenizer.ggml.scores") != len(tokens):
        raise InputError(
            f"tokenizer.ggml.scores has {meta.get('tokenizer.ggml.scores')} entries for {len(tokens)} tokens "
            "(a SentencePiece vocabulary needs one score per token)",
            path=where,
        )
    if model == "gpt2":
        vocab = set(tokens)
        for i, merge in enumerate(parts[1].get("merges") or []):
            pair = merge.split(" ") if isinstance(merge, str) else []
            if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
                raise InputError(
                    f"tokenizer.ggml.merges[{i}] is {merge!r}: not two tokens of tokenizer.ggml.tokens", path=where
                )
    return parts
