"""The model training starts from: a random Llama, a base model as is, or a base model moved onto the
stage's vocabulary (the transplant), and the step-0 comparison of the transplant's initialisations.

The stage calls these as explicit steps before the loop: `locate_base_model` (where the base comes
from and its lineage, in one place) → `load_model` → `apply_transplant` / `compare_initialisations`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from dilforge_shared.bpb import eval_mode
from dilforge_shared.configs.cpt import CptConfig
from dilforge_shared.contract import StageContext
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.models import Choice, choose, resolve
from tokenizers import Tokenizer

from . import fitted_init, leakage, transplant
from .data import PackedData, TokenIds, load_tokenizer
from .runtime import Runtime
from .validation import bpb_by_set, evaluate

log = logging.getLogger("dilforge.cpt")


def base_model_source(config: CptConfig, ctx: StageContext) -> Choice | None:
    """Which base model a run uses, by the shared precedence rule (`models.choose`): `base_model` when
    set, else the upstream `model` artifact, else None (a scratch model). No extra lineage: the contract
    records the base model (input `model`, or `identity.config_refs` for base_model) by exactly the ref the
    coordinator fingerprinted."""
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
    cache = ctx.opt.root / "base_model"

    def find():
        return resolve(
            ctx.input(choice.input) if choice.input else uri, "model", endpoint_url=ctx.endpoint_url, cache_dir=cache
        )

    try:
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
    calibration: transplant.Calibration | None = None  # fitted once, for the calibrated methods
    step0_leakage: dict | None = None  # leakage.measure of the trained initialisation at step 0
    fit: fitted_init.Fit | None = None  # the fitted method's output rows, fitted once


def scratch_model(config: CptConfig, vocab: int, ids: TokenIds):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = config.scratch_model
    assert s is not None
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        max_position_embeddings=s.max_position_embeddings,
        rope_theta=s.rope_theta,
        tie_word_embeddings=s.tie_word_embeddings,
        bos_token_id=ids.bos,
        eos_token_id=ids.doc_end,
        pad_token_id=ids.pad,
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(cfg)


def load_model(config: CptConfig, base: BaseModel | None, tok: Tokenizer, ids: TokenIds, rt: Runtime):
    """(model on rt.device, PendingTransplant or None, transplant report)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if base is None:
        model = scratch_model(config, vocab, ids).to(rt.device)
        return model, None, {"method": "none", "reason": "scratch model on the stage's tokenizer"}
    if not (base.path / "tokenizer.json").is_file():
        raise InputError(
            "base_model: no tokenizer.json beside the weights (needed to compare vocabularies)", path=base.source
        )
    base_tok = load_tokenizer(base.path)
    same = transplant.same_vocab(base_tok, tok)
    if not same and config.transplant == "none":
        raise InputError(
            f"the tokenizer artifact ({vocab} tokens) differs from the base model's tokenizer "
            f"({base_tok.get_vocab_size(with_added_tokens=True)} tokens) and transplant is 'none'; set transplant "
            "to mean_of_pieces (or mean_of_all / random) or use the base model's tokenizer",
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
    if config.untie_embeddings and tied:
        transplant.untie(model)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = ids.bos, ids.doc_end, ids.pad
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.bos_token_id, model.generation_config.eos_token_id = ids.bos, ids.doc_end
        model.generation_config.pad_token_id = ids.pad
    report = {
        "method": config.transplant,
        "num_kept": mapping.num_kept,
        "num_new": vocab - mapping.num_kept,
        "base_vocab_size": base_tok.get_vocab_size(with_added_tokens=True),
        "new_vocab_size": vocab,
        "tied": tied and not config.untie_embeddings,
        "untied_here": tied and config.untie_embeddings,
    }
    return model.to(rt.device), PendingTransplant(rows, mapping, report, base_tok), report


def new_row_mask(
    config: CptConfig, pending: PendingTransplant | None, vocab: int, scratch: bool
) -> torch.Tensor | None:
    """For phase 1 `new_rows`: True for rows of tokens the base model did not have (all rows of a
    scratch model); None when phase 1 trains whole matrices."""
    if config.phase1.trainable != "new_rows" or config.phase1.num_steps == 0:
        return None
    if pending is None:
        if scratch:
            return torch.ones(vocab, dtype=torch.bool)
        raise ConfigError(
            "phase1.trainable: new_rows, but the tokenizer equals the base model's: there are no new "
            "rows to train (use trainable: embeddings or a new tokenizer)"
        )
    return torch.tensor([k < 0 for k in pending.mapping.kept], dtype=torch.bool)


def kept_row_mask(
    config: CptConfig, pending: PendingTransplant | None, vocab: int, scratch: bool
) -> torch.Tensor | None:
    """For phase 2 `kept_rows_learning_rate`: True for rows of tokens the base model had (none of a
    scratch model, all when the tokenizer is the base model's); None when the field is unset."""
    if config.phase2.kept_rows_learning_rate is None:
        return None
    if pending is None:
        return torch.full((vocab,), not scratch, dtype=torch.bool)
    return torch.tensor([k >= 0 for k in pending.mapping.kept], dtype=torch.bool)


def sample_hidden(model, data: PackedData, config: CptConfig, rt: Runtime) -> transplant.Sample:
    """Final hidden states of `model` on the first windows of the training corpora: half of
    `calibration_num_windows` from the retain corpora (`retain_corpora`), half from the others (all
    from every corpus when there are no retain corpora), spread evenly over the corpora of each kind.
    Deterministic: the same windows on every rank and every run."""
    windows, flags = calibration_windows(data, config)
    x = torch.from_numpy(np.stack(windows)).to(rt.device)
    hidden = final_hidden(model, x, config.micro_batch_size, rt)
    positions = x.shape[1] - 1
    return transplant.Sample(
        hidden, x[:, 1:].reshape(-1).cpu(), torch.tensor(flags, dtype=torch.bool).repeat_interleave(positions)
    )


def calibration_windows(data: PackedData, config: CptConfig) -> tuple[list[np.ndarray], list[bool]]:
    labels = [tf.label for tf in data.files]
    retain = [i for i, name in enumerate(labels) if name in config.retain_corpora]
    other = [i for i in range(len(labels)) if i not in retain]
    kinds = [(retain, True), (other, False)] if retain and other else [(list(range(len(labels))), False)]
    per_kind = max(1, config.calibration_num_windows // len(kinds))
    windows, flags = [], []
    for corpora, is_retain in kinds:
        for j, c in enumerate(corpora):
            n = per_kind // len(corpora) + (1 if j < per_kind % len(corpora) else 0)
            for i in range(min(n, data.files[c].windows(config.seq_len))):
                windows.append(data.window(c, i))
                flags.append(is_retain)
    return windows, flags


@torch.no_grad()
def final_hidden(model, x: torch.Tensor, batch_size: int, rt: Runtime) -> torch.Tensor:
    """[windows × (len - 1), d] final hidden states (after the last norm) predicting each next token.
    The model's own forward runs (logits_to_keep=1) with a hook on its decoder, so FSDP2's root hooks
    gather the embedding and norm as in training."""
    from dilforge_shared.bpb import _reshard

    out: list[torch.Tensor] = []
    decoder = model.get_decoder()

    def grab(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        out.append(hidden[:, :-1].float().reshape(-1, hidden.shape[-1]).cpu())

    handle = decoder.register_forward_hook(grab)
    try:
        with eval_mode(model), rt.autocast():
            for k in range(0, len(x), batch_size):
                model(input_ids=x[k : k + batch_size], logits_to_keep=1)
    finally:
        handle.remove()
    if rt.fsdp:
        _reshard(model)
    return torch.cat(out)


def calibrate(
    model, pending: PendingTransplant, data: PackedData, config: CptConfig, rt: Runtime, seed: int
) -> transplant.Calibration:
    """The directions and offsets of the calibrated methods, fitted once on hidden states of the
    mean-of-pieces model (which `model` holds afterwards)."""
    if pending.calibration is None:
        transplant.transplant(model, pending.base_rows, pending.mapping, "mean_of_pieces", seed)
        sample = sample_hidden(model, data, config, rt)
        const, retain = transplant.fit_directions(sample.hidden, sample.is_retain if config.retain_corpora else None)
        cal = transplant.fit_offsets(
            sample,
            model.get_output_embeddings().weight.detach().cpu(),
            pending.mapping,
            const,
            retain,
            retain_weight=config.calibration_retain_weight,
        )
        pending.calibration = cal
        pending.report["calibration"] = {
            **cal.to_report(),
            "num_positions": len(sample.targets),
            "num_retain_positions": int(sample.is_retain.sum()),
        }
        log.info(
            "calibration on %d sampled positions (%d retain): alpha=%.3f beta=%.3f gamma=%.3f |b|=%.3f",
            len(sample.targets),
            int(sample.is_retain.sum()),
            cal.alpha,
            cal.beta,
            cal.gamma,
            cal.const.norm(),
        )
    return pending.calibration


def fit_output_rows(model, pending: PendingTransplant, data: PackedData, config: CptConfig, rt: Runtime, seed: int):
    """The fitted method's new output rows (fitted_init.py), fitted once on the base model's hidden states
    over the calibration windows in the base tokenisation (same windows as `sample_hidden`)."""
    if pending.fit is None:
        transplant.transplant(model, pending.base_rows, pending.mapping, "mean_of_pieces", seed)
        windows, flags = calibration_windows(data, config)
        stage = fitted_init.stage_ids_of_base(pending.mapping)
        x = torch.tensor([fitted_init.base_tokenised(w, pending.mapping, stage, config.seq_len) for w in windows])
        hidden = final_hidden(model, x.to(rt.device), config.micro_batch_size, rt)
        sample = fitted_init.PieceSample(
            hidden.reshape(len(x), x.shape[1] - 1, -1), x[:, 1:], torch.tensor(flags, dtype=torch.bool)
        )
        prior = model.get_output_embeddings().weight.detach().float().cpu()
        pending.fit = fitted_init.fit_rows(sample, prior, prior, pending.mapping, ridge=config.fit_ridge)
        pending.report["fit"] = pending.fit.to_report()
    return pending.fit


def recalibrate(
    model, mapping: transplant.VocabMapping, data: PackedData, config: CptConfig, rt: Runtime
) -> transplant.Calibration:
    """The loop's counter-measure against leakage that returns during training: the calibrated offsets
    fitted again, from zero, on the current model's hidden states and added to its trained new output
    rows (the LM head, or the tied matrix). Every rank computes the same (deterministic) fit."""
    sample = sample_hidden(model, data, config, rt)
    const, retain = transplant.fit_directions(sample.hidden, sample.is_retain if config.retain_corpora else None)
    head = model.get_output_embeddings().weight
    full = head.full_tensor() if hasattr(head, "full_tensor") else head
    rows = full.detach().float().cpu()
    cal = transplant.fit_offsets(sample, rows, mapping, const, retain, start=(0.0, 0.0, 0.0))
    moved = transplant.offset_rows(rows, mapping, cal).to(device=full.device, dtype=full.dtype)
    with torch.no_grad():
        if hasattr(head, "device_mesh"):  # FSDP2: write each rank's shard of the new matrix
            from torch.distributed.tensor import distribute_tensor

            head.copy_(distribute_tensor(moved, head.device_mesh, head.placements))
        else:
            head.copy_(moved)
    log.info(
        "leakage counter-measure: new output rows re-calibrated (alpha=%.3f beta=%.3f gamma=%.3f)",
        cal.alpha,
        cal.beta,
        cal.gamma,
    )
    return cal


def apply_transplant(
    model,
    pending: PendingTransplant,
    method: str,
    seed: int,
    data: PackedData | None = None,
    config: CptConfig | None = None,
    rt: Runtime | None = None,
) -> None:
    cal = fit = None
    if method in transplant.CALIBRATED + transplant.FITTED and (data is None or config is None or rt is None):
        raise ValueError(f"transplant {method!r} samples hidden states of the training corpora: pass data")
    if method in transplant.CALIBRATED:
        cal = calibrate(model, pending, data, config, rt, seed)
        if method == "offset":
            cal = transplant.Calibration(cal.const)
    if method in transplant.FITTED:
        fit = fit_output_rows(model, pending, data, config, rt, seed)
        fit = (fit.new_ids, fit.rows)
    transplant.transplant(model, pending.base_rows, pending.mapping, method, seed, calibration=cal, head_new_rows=fit)


def compare_initialisations(
    model,
    pending: PendingTransplant,
    val,
    config: CptConfig,
    rt: Runtime,
    data: PackedData | None = None,
    probe: leakage.LeakageProbe | None = None,
    methods: list[str] | None = None,
) -> dict[str, float]:
    """Step-0 validation of every initialisation (the trained one last, so the model ends with its
    rows); each measured once, with the leakage measure (`leakage.py`) when there is a probe. Returns
    the trained initialisation's result (the run's step 0)."""
    compared = methods if methods is not None else transplant.COMPARED if config.compare_transplant_inits else []
    methods = [m for m in compared if m != config.transplant] + [config.transplant]
    result: dict[str, float] = {}
    table = {}
    for method in methods:
        apply_transplant(model, pending, method, config.seed, data, config, rt)
        result = evaluate(model, val, config, rt, desc=f"step-0 {method}")
        pending.report.setdefault("step0_val_bpb", {})[method] = result["val_bpb"]
        pending.report.setdefault("step0_val_bpb_by_set", {})[method] = bpb_by_set(result)
        log.info("transplant %s: step-0 val_bpb=%.4f val_loss=%.4f", method, result["val_bpb"], result["val_loss"])
        if probe is not None:
            pending.step0_leakage = leakage.measure(model, probe, config, rt)
            table[method] = leakage.step0_row(bpb_by_set(result), pending.step0_leakage)
            log.info(
                "transplant %s: step-0 leakage %s",
                method,
                ", ".join(
                    f"{name} base tokenisation ×{r['base_tokenization_vs_base']:.4f} extended ×{r['extended_vs_base']:.4f}"
                    for name, r in table[method].items()
                    if "bpb_base_model" in r
                ),
            )
    if table:
        pending.report["step0_leakage"] = table
        if rt.is_main:
            log.info("step-0 leakage table:\n%s", leakage.format_table(table))
    return result
