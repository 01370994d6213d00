"""Load what the report compares; finding the folders is the shared resolver's (`dilforge_shared.models`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.manifest import Manifest
from dilforge_shared.models import Kind, ModelSource, Resolved, adapter_base, find_dir, open_model, resolve
from dilforge_shared.settings import settings

log = logging.getLogger("dilforge.eval")


def locate(uri: str, kind: Kind, cache_dir: Path, endpoint_url: str | None = None) -> Resolved:
    """The shared resolver (`models.resolve`), its ConfigError as an InputError naming the URI."""
    try:
        return resolve(uri, kind, "model", endpoint_url, cache_dir)
    except ConfigError as exc:
        raise InputError(str(exc).removeprefix(f"{uri}: "), path=uri) from None


def open_root(uri: str, cache_dir: Path, endpoint_url: str | None = None) -> ModelSource:
    """The whole artifact or folder a model URI names (model, adapter and tokenizer are found inside)."""
    try:
        return open_model(uri, "model", endpoint_url, cache_dir)
    except ConfigError as exc:
        raise InputError(str(exc).removeprefix(f"{uri}: "), path=uri) from None


def adapter_base_dir(src: ModelSource, cache_dir: Path, endpoint_url: str | None = None) -> Path | None:
    """For an adapter-only artifact/folder: its base's model folder, found the one way (`models.adapter_base`)."""
    adapter = find_adapter_dir(src.path)
    if find_model_dir(src.path) is not None or adapter is None:
        return None
    declared = adapter_base(Resolved("adapter", adapter, src))
    return locate(declared, "model", cache_dir, endpoint_url).path if declared else None


def find_model_dir(root: Path) -> Path | None:
    return find_dir(root, "model", str(root), required=False)


def find_adapter_dir(root: Path) -> Path | None:
    return find_dir(root, "adapter", str(root), required=False)


def find_tokenizer_dir(root: Path) -> Path | None:
    if root.is_file():
        return root
    return find_dir(root, "tokenizer", str(root), required=False)


def tokenizer_json(path: Path) -> Path:
    return path if path.is_file() else path / "tokenizer.json"


@dataclass
class EvalModel:
    """One model the eval stage scores, under its report label: model, tokenizer and adapter folders and where
    they came from (not the shared `models.ModelSource`, which is a fetched folder and its lineage)."""

    label: str
    model_dir: Path
    tokenizer_dir: Path
    adapter_dir: Path | None = None
    origin: str = ""
    manifest: Manifest | None = None
    notes: list[str] = field(default_factory=list)


def model_source(
    label: str,
    root: Path,
    origin: str,
    manifest: Manifest | None = None,
    tokenizer_dir: Path | None = None,
    adapter_dir: Path | None = None,
    base_model_dir: Path | None = None,
    base_tokenizer_dir: Path | None = None,
) -> EvalModel:
    """Resolve a model folder; an adapter-only folder is applied on `base_model_dir` (the caller found it
    with `models.adapter_base`, the one way an adapter's base is found)."""
    model_dir = find_model_dir(root)
    if model_dir is None:
        adapter_dir = adapter_dir or find_adapter_dir(root)
        if adapter_dir is None:
            raise InputError(
                f"model {label!r}: no HF model (config.json + weights) or PEFT adapter found", path=str(root)
            )
        if base_model_dir is None:
            raise InputError(
                f"model {label!r}: adapter found but no base model to apply it on (run the cpt stage "
                "in the same pipeline, or publish merged/ weights)",
                path=str(adapter_dir),
            )
        model_dir = base_model_dir
    tok = tokenizer_dir or find_tokenizer_dir(root) or find_tokenizer_dir(model_dir) or base_tokenizer_dir
    if tok is None:
        raise InputError(f"model {label!r}: no tokenizer.json next to the model; set tokenizer_uri", path=str(root))
    return EvalModel(
        label=label, model_dir=model_dir, tokenizer_dir=tok, adapter_dir=adapter_dir, origin=origin, manifest=manifest
    )


def load_model(src: EvalModel, device: str, dtype):
    """(model in eval mode on device, transformers tokenizer); a PEFT adapter is merged in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src.tokenizer_dir), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(src.model_dir), dtype=dtype, trust_remote_code=False)
    if src.adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(src.adapter_dir)).merge_and_unload()
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise InputError(
            f"model {src.label!r}: tokenizer has {len(tokenizer)} tokens but the model's embedding "
            f"only {model.get_input_embeddings().weight.shape[0]}",
            path=str(src.tokenizer_dir),
        )
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def cache_dir_for(opt_root: Path) -> Path:
    return settings().cache or opt_root / "cache"
