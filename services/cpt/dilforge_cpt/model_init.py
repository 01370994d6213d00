"""The model training starts from: a random Llama, a base model as is, or one moved onto the stage's vocabulary
(the transplant), scored at step 0: `locate_base_model` → `load_model` → `initialise`."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from dilforge_shared.contract import StageContext
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.models import Choice, choose, resolve
from tokenizers import Tokenizer

from . import leakage, transplant
from .config import CptConfig
from .data import TokenIds, load_tokenizer
from .runtime import Runtime
from .validation import bpb_by_set, evaluate

log = logging.getLogger("dilforge.cpt")


def base_model_source(config: CptConfig, ctx: StageContext) -> Choice | None:
    """Which base model a run uses (`models.choose`): `base_model` when set, else the upstream `model` artifact,
    else None (a scratch model)."""
    return choose("base_model", config.base_model, ctx.request.inputs, order=("model",))


@dataclass(frozen=True)
class BaseModel:
    path: Path  # the local HF folder
    source: str  # what the user named, for error messages


def locate_base_model(config: CptConfig, ctx: StageContext, rt: Runtime) -> BaseModel | None:
    """The base model's local HF folder through the shared resolver: the verified artifact, a local folder
    as is, or an s3:// prefix downloaded once per host (local rank 0 first, the others after the barrier)."""
    choice = base_model_source(config, ctx)
    if choice is None:
        return None
    uri = choice.uri
    try:
        target = ctx.input(choice.input) if choice.input else uri
        find = functools.partial(resolve, target, "model", endpoint_url=ctx.endpoint_url, cache_dir=ctx.cache_dir)
        found = find() if rt.local_rank == 0 else None
        rt.barrier()
        found = found or find()
    except ConfigError as exc:
        raise InputError(f"base_model: {str(exc).removeprefix(f'{uri}: ')}", path=uri) from None
    return BaseModel(found.path, uri)


@dataclass
class PendingTransplant:
    """A base model resized to the new vocabulary whose new rows are not written yet."""

    base_rows: dict[str, torch.Tensor]
    mapping: transplant.VocabMapping
    report: dict
    base_tok: Tokenizer | None = None


def scratch_model(config: CptConfig, vocab: int, ids: TokenIds):
    from transformers import LlamaConfig, LlamaForCausalLM

    special = {"bos_token_id": ids.bos, "eos_token_id": ids.doc_end, "pad_token_id": ids.pad}
    cfg = LlamaConfig(vocab_size=vocab, **config.scratch_model.model_dump(), **special)  # ScratchModel: LlamaConfig's
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(cfg)


def load_model(config: CptConfig, base: BaseModel | None, tok: Tokenizer, ids: TokenIds, rt: Runtime):
    """(model on rt.device, PendingTransplant or None, transplant report)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if base is None:
        model = scratch_model(config, vocab, ids).to(rt.device)
        return model, None, {"method": "none", "reason": "scratch model on the stage's tokenizer"}
    if not (base.path / "tokenizer.json").is_file():  # named as the user configured it, not the cached folder
        raise InputError(
            "base_model: no tokenizer.json beside the weights (needed to compare vocabularies)", path=base.source
        )
    base_tok = load_tokenizer(base.path)
    same = transplant.same_vocab(base_tok, tok)
    if not same and config.transplant == "none":
        raise InputError(
            f"the tokenizer artifact ({vocab} tokens) differs from the base model's tokenizer "
            f"({base_tok.get_vocab_size(with_added_tokens=True)} tokens) and transplant is 'none'; set transplant "
            "to mean_of_pieces or use the base model's tokenizer",
            path=base.source,
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32, trust_remote_code=False)
    if same:
        if model.get_input_embeddings().weight.shape[0] < vocab:
            raise InputError(
                f"base_model: embedding has {model.get_input_embeddings().weight.shape[0]} rows, "
                f"fewer than the tokenizer's {vocab} tokens",
                path=base.source,
            )
        return model.to(rt.device), None, {"method": "none", "reason": "same tokenizer as the base model"}
    mapping = transplant.build_mapping(base_tok, tok)
    rows = transplant.prepare(model, vocab)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids.bos, ids.doc_end, ids.pad
    report = {
        "method": config.transplant,
        "num_kept": mapping.num_kept,
        "num_new": vocab - mapping.num_kept,
        "base_vocab_size": base_tok.get_vocab_size(with_added_tokens=True),
        "new_vocab_size": vocab,
        "tied": tied,
    }
    return model.to(rt.device), PendingTransplant(rows, mapping, report, base_tok), report


def row_masks(
    config: CptConfig, pending: PendingTransplant | None, vocab: int, scratch: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(new rows, kept rows), a bool per vocabulary row: the rows of tokens the base model did not have (all of a
    scratch model) for phase 1 `new_rows`, and those it had (all with its own tokenizer) for phase 2
    `kept_rows_learning_rate`; None where the setting does not use it."""
    if pending is None:
        kept = torch.full((vocab,), not scratch, dtype=torch.bool)
    else:
        kept = torch.tensor([k >= 0 for k in pending.mapping.kept], dtype=torch.bool)
    new = None
    if config.phase1.trainable == "new_rows" and config.phase1.num_steps:
        if not scratch and pending is None:
            raise ConfigError(
                "phase1.trainable: new_rows, but the tokenizer equals the base model's: there are no new "
                "rows to train (use trainable: embeddings or a new tokenizer)"
            )
        new = ~kept
    return new, (kept if config.phase2.kept_rows_learning_rate is not None else None)


def initialise(model, pending: PendingTransplant, val, config: CptConfig, rt: Runtime, probe=None):
    """Write the transplant's rows and score them at step 0: validation BPB per set and, with a probe,
    the leakage (leakage.py). Returns (the step-0 validation result, the leakage rows or None)."""
    transplant.transplant(model, pending.base_rows, pending.mapping)
    result = evaluate(model, val, config, rt, desc=f"step-0 {config.transplant}")
    pending.report["step0_val_bpb"] = {config.transplant: result["val_bpb"]}
    pending.report["step0_val_bpb_by_set"] = {config.transplant: bpb_by_set(result)}
    log.info(
        "transplant %s: step-0 val_bpb=%.4f val_loss=%.4f", config.transplant, result["val_bpb"], result["val_loss"]
    )
    rows = None
    if probe is not None:
        rows = leakage.measure(model, probe, config, rt)
        pending.report["step0_leakage"] = {config.transplant: leakage.step0_row(bpb_by_set(result), rows)}
        if rt.is_main:
            log.info("step-0 leakage:\n%s", leakage.format_table(pending.report["step0_leakage"]))
    return result, rows
