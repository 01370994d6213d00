"""Find and load what the report compares: HF folders given directly, inside artifacts, or on S3."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.manifest import MANIFEST_NAME, Manifest
from dilforge_shared.models import open_model
from dilforge_shared.settings import settings

log = logging.getLogger("dilforge.eval")

WEIGHT_SUFFIXES = (".safetensors", ".bin")
PREFERRED = ("merged", "model", "final", "hf", "tokenizer")


@dataclass
class Located:
    """A local folder for a URI, and the manifest when the URI was a dilforge artifact."""
    path: Path
    manifest: Manifest | None = None


def locate(uri: str, cache_dir: Path, endpoint_url: str | None = None) -> Located:
    """A local folder (or file) for an HF folder, a tokenizer.json, an artifact, or an s3:// prefix."""
    path = Path(uri.removeprefix("file://"))
    if urlparse(uri).scheme != "s3" and path.is_file() and path.name != MANIFEST_NAME:
        return Located(path)  # a bare tokenizer.json
    try:
        src = open_model(uri, "model", endpoint_url, cache_dir)
    except ConfigError as exc:
        raise InputError(str(exc).removeprefix(f"{uri}: "), path=uri) from None
    return Located(src.path, src.manifest)


def _candidates(root: Path, depth: int = 3) -> list[Path]:
    out, frontier = [root], [root]
    for _ in range(depth):
        frontier = [c for d in frontier for c in sorted(d.iterdir()) if c.is_dir() and not c.name.startswith(".")]
        out += frontier
    return out


def _pick(dirs: list[Path], root: Path) -> Path | None:
    if not dirs:
        return None
    def rank(d: Path) -> tuple:
        rel = d.relative_to(root).parts
        pref = min((PREFERRED.index(p) for p in rel if p in PREFERRED), default=len(PREFERRED))
        return (len(rel) > 0, pref, len(rel), str(d))
    return min(dirs, key=rank)


def find_model_dir(root: Path) -> Path | None:
    """The folder holding an HF causal LM (config.json + weights), preferring merged/ and model/."""
    dirs = [d for d in _candidates(root) if (d / "config.json").is_file()
            and any(f.name.endswith(WEIGHT_SUFFIXES) and "adapter" not in f.name for f in d.iterdir())]
    return _pick(dirs, root)


def find_adapter_dir(root: Path) -> Path | None:
    return _pick([d for d in _candidates(root) if (d / "adapter_config.json").is_file()], root)


def find_tokenizer_dir(root: Path) -> Path | None:
    if root.is_file() and root.name.endswith(".json"):
        return root
    return _pick([d for d in _candidates(root) if (d / "tokenizer.json").is_file()], root)


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


def model_source(label: str, root: Path, origin: str, manifest: Manifest | None = None,
                 tokenizer_dir: Path | None = None, adapter_dir: Path | None = None,
                 base_model_dir: Path | None = None, base_tokenizer_dir: Path | None = None) -> EvalModel:
    """Resolve a model folder; an adapter-only folder is applied on `base_model_dir` (the CPT model)."""
    model_dir = find_model_dir(root)
    if model_dir is None:
        adapter_dir = adapter_dir or find_adapter_dir(root)
        if adapter_dir is None:
            raise InputError(f"model {label!r}: no HF model (config.json + weights) or PEFT adapter found", path=str(root))
        base = base_model_dir or _adapter_base(adapter_dir)
        if base is None:
            raise InputError(f"model {label!r}: adapter found but no base model to apply it on (run the cpt stage "
                             "in the same pipeline, or publish merged/ weights)", path=str(adapter_dir))
        model_dir = base
    tok = tokenizer_dir or find_tokenizer_dir(root) or find_tokenizer_dir(model_dir) or base_tokenizer_dir
    if tok is None:
        raise InputError(f"model {label!r}: no tokenizer.json next to the model; set tokenizer_uri", path=str(root))
    return EvalModel(label=label, model_dir=model_dir, tokenizer_dir=tok, adapter_dir=adapter_dir, origin=origin,
                       manifest=manifest)


def adapter_base_uri(adapter_dir: Path) -> str | None:
    """The base model an adapter names (dilforge's SFT writes the base's URI there)."""
    import json
    try:
        return json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError):
        return None


def _adapter_base(adapter_dir: Path) -> Path | None:
    base = adapter_base_uri(adapter_dir)
    if base and Path(base).is_dir():
        return find_model_dir(Path(base))
    return None


def load_model(src: EvalModel, device: str, dtype):
    """(model in eval mode on device, transformers tokenizer); a PEFT adapter is merged in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(src.tokenizer_dir), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(src.model_dir), dtype=dtype, trust_remote_code=False)
    if src.adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(src.adapter_dir)).merge_and_unload()
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise InputError(f"model {src.label!r}: tokenizer has {len(tokenizer)} tokens but the model's embedding "
                         f"only {model.get_input_embeddings().weight.shape[0]}", path=str(src.tokenizer_dir))
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def cache_dir_for(opt_root: Path) -> Path:
    return settings().cache or opt_root / "cache"
