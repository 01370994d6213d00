"""What the report compares: the models (base, the config's, the upstream cpt/sft) and the tokenizers, found by
the shared resolver (`dilforge_shared.models`) and loaded here."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dilforge_shared.contract import StageContext
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.families import detect_family
from dilforge_shared.manifest import sha256_file
from dilforge_shared.models import Kind, resolve
from dilforge_shared.serving import ChatModel, resolve_chat_model
from dilforge_shared.store import Artifact

from .config import BASE_LABEL, EvalConfig

log = logging.getLogger("dilforge.eval")


def locate(source: str | Artifact, kind: Kind, cache_dir: Path | None, endpoint_url: str | None = None) -> Path:
    """The folder the shared resolver (`models.resolve`) finds, its ConfigError as an InputError naming the URI."""
    uri = source.uri if isinstance(source, Artifact) else source
    try:
        return resolve(source, kind, endpoint_url, cache_dir).path
    except ConfigError as exc:
        raise InputError(str(exc).removeprefix(f"{uri}: "), path=uri) from None


@dataclass(kw_only=True)
class EvalModel(ChatModel):
    """One model the eval stage scores: the folders `serving.resolve_chat_model` found, its report label and origin."""

    label: str
    origin: str = ""


def eval_model(
    label: str,
    source: str | Artifact,
    origin: str,
    cache_dir: Path | None,
    endpoint_url: str | None = None,
    tokenizer_uri: str | None = None,
    adapter_uri: str | None = None,
    fetched: Iterable[Artifact] = (),
) -> EvalModel:
    """One model under its report label, through the one resolver (`serving.resolve_chat_model`): its model folder
    (an SFT artifact's merged/ first), else its adapter on the base its lineage names (one of `fetched`, the
    upstream artifacts already here, when it is one). A config model's `tokenizer_uri` and `adapter_uri` replace
    what its folder holds."""
    uri = source.uri if isinstance(source, Artifact) else source
    try:
        spec = resolve_chat_model(
            source, endpoint_url=endpoint_url, prefer_merged=True, cache_dir=cache_dir, fetched=fetched
        )
    except ConfigError as exc:
        raise InputError(f"model {label!r}: {str(exc).removeprefix(f'{uri}: ')}", path=uri) from None
    tok = locate(tokenizer_uri, "tokenizer", cache_dir, endpoint_url) if tokenizer_uri else spec.tokenizer_dir
    if not (tok.is_file() or (tok / "tokenizer.json").is_file()):
        raise InputError(f"model {label!r}: no tokenizer.json next to the model; set tokenizer_uri", path=uri)
    adapter = locate(adapter_uri, "adapter", cache_dir, endpoint_url) if adapter_uri else spec.adapter_dir
    return EvalModel(spec.base_dir, adapter, tok, spec.description, spec.manifest, label=label, origin=origin)


def load_model(src: EvalModel, device: str, dtype):
    """(model in eval mode on device, transformers tokenizer); a PEFT adapter is merged in, and a tokenizer without
    a chat template gets its family's (for the chat prompts, the assistant answers and the chat tasks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src.tokenizer_dir), trust_remote_code=False)
    if not tokenizer.chat_template:  # one of no known family keeps none; generation warns of it once (model_family)
        with contextlib.suppress(InputError):
            tokenizer.chat_template = detect_family(tokenizer.get_vocab(), str(src.tokenizer_dir)).chat_template
    model = AutoModelForCausalLM.from_pretrained(str(src.base_dir), dtype=dtype, trust_remote_code=False)
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


def load_tokenizers(config: EvalConfig, ctx: StageContext, models: list[EvalModel], cache: Path):
    """label -> tokenizers.Tokenizer; tokenizers with identical tokenizer.json are listed once, with aliases."""
    from tokenizers import Tokenizer

    entries = [(r.label, locate(r.uri, "tokenizer", cache, ctx.endpoint_url), r.uri) for r in config.tokenizers]
    entries += [(m.label, m.tokenizer_dir, f"tokenizer of model {m.label}") for m in models]
    if ctx.has_input("tokenizer"):
        art = ctx.input("tokenizer")
        entries.insert(0, ("tokenizer", locate(art, "tokenizer", cache), f"artifact {art.manifest.artifact_id}"))
    out, info, by_hash = {}, {}, {}
    for label, tdir, origin in entries:
        path = tdir if tdir.is_file() else tdir / "tokenizer.json"
        digest = sha256_file(path)
        if digest in by_hash:
            info[by_hash[digest]]["aliases"].append(label)
            continue
        by_hash[digest] = label
        tok = out[label] = Tokenizer.from_file(str(path))
        info[label] = {"origin": origin, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "aliases": []}
    return out, info


def resolve_models(config: EvalConfig, ctx: StageContext, cache: Path | None) -> tuple[list[EvalModel], list[str]]:
    """The pipeline's `model` artifact first as "base" (the reference of every change), then the config's models,
    then cpt and sft (an SFT adapter on the upstream artifact already here, cpt or model, when its lineage names
    that one); an SFT model that cannot be loaded is skipped when the config says so."""
    if ctx.has_input("model") and BASE_LABEL in (labels := [m.label for m in config.models]):
        raise ConfigError(
            f"eval.models[{labels.index(BASE_LABEL)}].label: {BASE_LABEL!r} is the pipeline's model artifact here; "
            "give this model another label"
        )
    arts = {name: ctx.input(name) for name in ("model", "cpt", "sft") if ctx.has_input(name)}

    def upstream(label: str, name: str, cache_dir: Path | None, **kw) -> EvalModel:
        art = arts[name]
        return eval_model(label, art, f"artifact {art.manifest.artifact_id}", cache_dir, ctx.endpoint_url, **kw)

    models = [upstream(BASE_LABEL, "model", None)] if "model" in arts else []
    models += [
        eval_model(r.label, r.uri, r.uri, cache, ctx.endpoint_url, r.tokenizer_uri, r.adapter_uri)
        for r in config.models
    ]
    models += [upstream("cpt", "cpt", cache)] if "cpt" in arts else []
    skipped = []
    if "sft" in arts:
        try:
            models.append(upstream("sft", "sft", cache, fetched=[a for n, a in arts.items() if n != "sft"]))
        except InputError as exc:
            if config.on_unloadable_model == "fail":
                raise InputError(
                    f"sft artifact {arts['sft'].uri}: {exc} (set on_unloadable_model: skip to report without it)"
                ) from None
            log.warning("%s", exc)
            skipped.append(f"sft model: {exc}")
    return models, skipped
