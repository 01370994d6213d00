"""What the report compares: the models (base, the config's, the upstream cpt/sft) and the tokenizers, found by
the shared resolver (`dilforge_shared.models`) and loaded here."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from dilforge_shared.configs import EvalConfig
from dilforge_shared.configs.eval import BASE_LABEL
from dilforge_shared.contract import StageContext
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.manifest import Manifest
from dilforge_shared.models import Kind, ModelSource, Resolved, adapter_base, find_dir, open_model, resolve
from dilforge_shared.settings import settings

log = logging.getLogger("dilforge.eval")


def locate(uri: str, kind: Kind, cache_dir: Path, endpoint_url: str | None = None) -> Path:
    """The folder the shared resolver (`models.resolve`) finds, its ConfigError as an InputError naming the URI."""
    try:
        return resolve(uri, kind, "model", endpoint_url, cache_dir).path
    except ConfigError as exc:
        raise InputError(str(exc).removeprefix(f"{uri}: "), path=uri) from None


def inside(root: Path, kind: Kind) -> Path | None:
    """The model, adapter or tokenizer folder inside an artifact or folder (a tokenizer may be a bare file)."""
    if kind == "tokenizer" and root.is_file():
        return root
    return find_dir(root, kind, str(root), required=False)


def adapter_base_dir(src: ModelSource, cache_dir: Path, endpoint_url: str | None = None) -> Path | None:
    """For an adapter-only artifact/folder: its base's model folder, found the one way (`models.adapter_base`)."""
    adapter = inside(src.path, "adapter")
    if inside(src.path, "model") is not None or adapter is None:
        return None
    declared = adapter_base(Resolved("adapter", adapter, src))
    return locate(declared, "model", cache_dir, endpoint_url) if declared else None


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
    model_dir = inside(root, "model")
    if model_dir is None:
        adapter_dir = adapter_dir or inside(root, "adapter")
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
    tok = tokenizer_dir or inside(root, "tokenizer") or inside(model_dir, "tokenizer") or base_tokenizer_dir
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


def load_tokenizers(config: EvalConfig, ctx: StageContext, models: list[EvalModel], cache: Path):
    """label -> tokenizers.Tokenizer; tokenizers with identical tokenizer.json are listed once, with aliases."""
    from tokenizers import Tokenizer

    entries: list[tuple[str, Path, str]] = []
    if ctx.has_input("tokenizer"):
        art = ctx.input("tokenizer")
        tdir = inside(art.path, "tokenizer")
        if tdir is None:
            raise InputError("tokenizer artifact holds no tokenizer.json", path=art.uri)
        entries.append(("tokenizer", tdir, f"artifact {art.manifest.artifact_id}"))
    for ref in config.tokenizers:
        entries.append((ref.label, locate(ref.uri, "tokenizer", cache, ctx.endpoint_url), ref.uri))
    for m in models:
        entries.append((m.label, m.tokenizer_dir, f"tokenizer of model {m.label}"))
    out, info, by_hash = {}, {}, {}
    for label, tdir, origin in entries:
        path = tdir if tdir.is_file() else tdir / "tokenizer.json"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest in by_hash:
            info[by_hash[digest]]["aliases"].append(label)
            continue
        by_hash[digest] = label
        tok = Tokenizer.from_file(str(path))
        out[label] = tok
        info[label] = {"origin": origin, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "aliases": []}
    return out, info


def base_model(config: EvalConfig, ctx: StageContext) -> EvalModel | None:
    """The pipeline's `model` artifact (the base model, with its own tokenizer) as "base", when there is one."""
    if not ctx.has_input("model"):
        return None
    for i, ref in enumerate(config.models):
        if ref.label == BASE_LABEL:
            raise ConfigError(
                f"eval.models[{i}].label: {BASE_LABEL!r} is the pipeline's model artifact here; "
                "give this model another label"
            )
    art = ctx.input("model")
    try:
        hf_dir = resolve(art, "model").path
    except ConfigError as exc:
        raise InputError(str(exc).removeprefix(f"{art.uri}: "), path=art.uri) from None
    return model_source(BASE_LABEL, hf_dir, f"artifact {art.manifest.artifact_id}", art.manifest, tokenizer_dir=hf_dir)


def sft_model(art, cpt: EvalModel | None, ctx: StageContext, cache: Path) -> EvalModel:
    """The SFT artifact: its merged/ weights, else its adapter on the base `models.adapter_base` names (the
    pipeline's cpt artifact, already loaded, when that is the one)."""
    base_dir = base_tok = None
    src = open_model(art)
    if inside(art.path, "model") is None and (adapter := inside(art.path, "adapter")) is not None:
        declared = adapter_base(Resolved("adapter", adapter, src))
        if cpt is not None and (declared is None or declared.rstrip("/") == ctx.input("cpt").uri.rstrip("/")):
            base_dir, base_tok = cpt.model_dir, cpt.tokenizer_dir
        else:
            base_dir = adapter_base_dir(src, cache, ctx.endpoint_url)
    return model_source(
        "sft",
        art.path,
        f"artifact {art.manifest.artifact_id}",
        art.manifest,
        base_model_dir=base_dir,
        base_tokenizer_dir=base_tok,
    )


def resolve_models(config: EvalConfig, ctx: StageContext, cache: Path) -> tuple[list[EvalModel], list[str]]:
    """Base first (the reference of every change), then the config's models, then cpt and sft."""
    models, skipped = [], []
    if (base := base_model(config, ctx)) is not None:
        models.append(base)
    for ref in config.models:
        try:
            src = open_model(ref.uri, "model", ctx.endpoint_url, cache)
        except ConfigError as exc:
            raise InputError(str(exc).removeprefix(f"{ref.uri}: "), path=ref.uri) from None
        tok = locate(ref.tokenizer_uri, "tokenizer", cache, ctx.endpoint_url) if ref.tokenizer_uri else None
        adapter = locate(ref.adapter_uri, "adapter", cache, ctx.endpoint_url) if ref.adapter_uri else None
        models.append(
            model_source(
                ref.label,
                src.path,
                ref.uri,
                src.manifest,
                tokenizer_dir=tok,
                adapter_dir=adapter,
                base_model_dir=adapter_base_dir(src, cache, ctx.endpoint_url),
            )
        )
    cpt = None
    if ctx.has_input("cpt"):
        art = ctx.input("cpt")
        cpt = model_source("cpt", art.path, f"artifact {art.manifest.artifact_id}", art.manifest)
        models.append(cpt)
    if ctx.has_input("sft"):
        art = ctx.input("sft")
        try:
            models.append(sft_model(art, cpt, ctx, cache))
        except InputError as exc:
            if config.on_unloadable_model == "fail":
                raise InputError(
                    f"sft artifact {art.uri}: {exc} (set on_unloadable_model: skip to report without it)"
                ) from None
            log.warning("%s", exc)
            skipped.append(f"sft model: {exc}")
    return models, skipped
