"""What the eval stage measures: per tokenizer, fertility and bytes per token, parity with English and morpheme
alignment; per model (`evaluate_model`), bits per byte on every set, the generations and the downstream tasks.

Bits per byte is the shared definition (`dilforge_shared.bpb.sliding_window_bpb`) applied with a transformers
tokenizer, whose family (`dilforge_shared.families`) gives the document separators: CPT validation computes the
same number for the same model, text and window."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dilforge_shared.bpb import BpbResult, TokenStream, build_stream, sliding_window_bpb
from dilforge_shared.families import detect_family
from dilforge_shared.metrics.tokenizer import SetFigures
from dilforge_shared.progress import Progress
from dilforge_shared.textmetrics import measure, tokenizers_encoder

from . import downstream, harness
from . import generate as gen_mod
from . import morph as morph_mod
from .assistant import AssistantPrompt
from .config import EvalConfig
from .metrics import BpbFigures, MorphFigures, ParityFigures
from .metrics import EvalModel as ModelFigures
from .resolve import EvalModel, load_model

log = logging.getLogger("dilforge.eval")


# ---- bits per byte ------------------------------------------------------------------------------------------
def text_bytes(docs: Sequence[str]) -> int:
    """The BPB denominator: UTF-8 bytes of the documents' text (separators are not text)."""
    return sum(len(d.encode("utf-8")) for d in docs)


def encode_stream(tokenizer, docs: Sequence[str], source: str = "tokenizer") -> TokenStream:
    """The documents as one stream framed by the tokenizer family's separators (see dilforge_shared.bpb)."""
    family = detect_family(tokenizer.get_vocab(), source)
    bos = tokenizer.convert_tokens_to_ids(family.bos) if family.bos is not None else None
    doc_end = tokenizer.convert_tokens_to_ids(family.doc_end)
    encoded = [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]
    return build_stream(list(docs), encoded, bos, doc_end)


def bits_per_byte(
    model, tokenizer, docs: Sequence[str], window: int, stride: int, batch_size: int = 8, on_batch=None
) -> BpbResult:
    return sliding_window_bpb(model, encode_stream(tokenizer, docs), window, stride, batch_size, on_batch=on_batch)


def bpb_summary(res: BpbResult) -> BpbFigures:
    """The row eval's report and manifest keep for one model and set."""
    return BpbFigures(
        bpb=round(res.bpb, 5),
        bits_per_token=round(res.bits_per_token, 5),
        bytes_per_second=round(res.num_bytes / res.seconds, 1) if res.seconds else None,
        **{k: v for k, v in asdict(res).items() if k != "nll_nats"},
        bits=round(res.bits, 3),
    )


def default_window(model, requested: int | None, cap: int = 2048) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or cap
    return min(requested or cap, limit) if requested else min(limit, cap)


# ---- tokenizers -------------------------------------------------------------------------------------------------
def tokenizer_metrics(toks, sets: dict[str, list[str]]) -> dict[str, dict[str, SetFigures]]:
    return {
        label: {name: SetFigures(**measure(docs, tokenizers_encoder(tok)).summary()) for name, docs in sets.items()}
        for label, tok in toks.items()
    }


def parity_metrics(toks, parallel: dict[str, list[tuple[str, str]]]) -> dict[str, dict[str, ParityFigures]]:
    out: dict = {}
    for label, tok in toks.items():
        for name, pairs in parallel.items():
            az = sum(len(e.ids) for e in tok.encode_batch([p[0] for p in pairs], add_special_tokens=False))
            en = sum(len(e.ids) for e in tok.encode_batch([p[1] for p in pairs], add_special_tokens=False))
            out.setdefault(label, {})[name] = ParityFigures(
                tokens_az=az, tokens_en=en, num_pairs=len(pairs), parity=round(az / en, 4) if en else None
            )
    return out


def morph_metrics(toks, gold: dict[str, list[morph_mod.GoldWord]]) -> dict[str, dict[str, MorphFigures]]:
    out: dict = {}
    for label, tok in toks.items():
        total = morph_mod.AlignmentStats()
        for source, words in gold.items():
            stats = morph_mod.alignment(tok, words)
            out.setdefault(label, {})[source] = MorphFigures(**stats.summary())
            for k, v in stats.__dict__.items():
                setattr(total, k, getattr(total, k) + v)
        if len(gold) > 1:
            out[label]["all"] = MorphFigures(**total.summary())
    return out


def evaluate_model(
    src: EvalModel,
    config: EvalConfig,
    sets: dict[str, list[str]],
    prompts,
    device: str,
    dtype,
    tasks: tuple[list[downstream.TaskSpec], Path, Path] | None = None,
    assistant_groups: dict[str, list[AssistantPrompt]] | None = None,
) -> tuple[ModelFigures, dict[str, BpbFigures], list[dict], dict, AssistantRun | None]:
    """BPB per set, generations, the downstream tasks (specs, task folder, cache) and the answers to the
    assistant prompt groups of one model; the model is freed afterwards."""
    import torch

    t0 = time.perf_counter()
    model, tokenizer = load_model(src, device, dtype)
    window = default_window(model, config.bpb.window)
    stride = min(config.bpb.stride or max(1, window // 2), window)
    info = ModelFigures(
        origin=src.origin,
        num_parameters=sum(p.numel() for p in model.parameters()),
        adapter=src.adapter_dir is not None,
        bpb_window=window,
        bpb_stride=stride,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        load_seconds=round(time.perf_counter() - t0, 2),
    )
    log.info("model %s: %s parameters, window %d stride %d", src.label, f"{info.num_parameters:,}", window, stride)
    bpb = {}
    for name, docs in sets.items():
        with Progress(f"bpb {src.label}/{name}", unit="batches", log=log) as bar:
            res = bits_per_byte(model, tokenizer, docs, window, stride, config.bpb.batch_size, on_batch=bar.batches)
        bpb[name] = bpb_summary(res)
        log.info(
            "bpb %s / %s: %.4f (%d tokens, %d bytes, %.0f bytes/s)",
            src.label,
            name,
            res.bpb,
            res.num_tokens,
            res.num_bytes,
            res.num_bytes / max(res.seconds, 1e-9),
        )
    generations = []
    if prompts:
        total = len(prompts) * len(config.generation.modes)
        # closed on an error too: its heartbeat thread must not outlive the pass
        with Progress(f"generate {src.label}", total, unit="answers", log=log) as bar:
            for mode in config.generation.modes:
                for row in gen_mod.generate(
                    model,
                    tokenizer,
                    prompts,
                    mode,
                    config.generation,
                    config.seed,
                    source=str(src.tokenizer_dir),
                    progress=bar,
                ):
                    generations.append({"model": src.label, **row})
    answers = assistant_answers(model, tokenizer, src, config, assistant_groups) if assistant_groups else None
    scores: dict = {}
    if tasks and tasks[0]:
        specs, task_dir, cache = tasks
        t_tasks, c_tasks = time.perf_counter(), time.process_time()
        scores["results"], scores["samples"] = harness.run_model(
            model,
            tokenizer,
            specs,
            task_dir,
            config.tasks,
            cache,
            config.seed,
            str(src.tokenizer_dir),
            config.tasks.instructions.system_prompt if config.tasks.instructions else None,
        )
        info.tasks_seconds = round(time.perf_counter() - t_tasks, 2)
        info.tasks_cpu_seconds = round(time.process_time() - c_tasks, 2)  # all threads; shared CPUs inflate wall
        for key, res in scores["results"].items():
            log.info(
                "task %s / %s: %s",
                src.label,
                key,
                ", ".join(
                    f"{m} {v.value:.4g}" + (f" ± {v.stderr:.2g}" if v.stderr is not None else "")
                    for m, v in res.items()
                ),
            )
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info, bpb, generations, scores, answers


@dataclass
class AssistantRun:
    """One model's answers to the assistant prompts, the generation defaults they were decoded with, seconds."""

    rows: list[dict]
    generation_config: dict
    seconds: float


def assistant_answers(model, tokenizer, src: EvalModel, config: EvalConfig, groups: dict) -> AssistantRun:
    """The model's answers to every assistant prompt group, as a server gives them: its published generation
    config, its chat template with the SFT system prompt a server inserts by default, batched."""
    settings = config.assistant
    gen_config = gen_mod.published_generation_config(model, (src.model_dir, src.adapter_dir))
    manifest = src.manifest
    system_prompt = (manifest.config.get("system_prompt") or None) if manifest and manifest.stage == "sft" else None
    asked = [(group, p) for group, prompts in groups.items() for p in prompts]
    t0 = time.perf_counter()
    # every group in one call: batches of similar length across the groups
    with Progress(f"assistant {src.label}", len(asked), unit="answers", log=log) as bar:
        answered = gen_mod.answer_batched(
            model,
            tokenizer,
            [p.prompt for _, p in asked],
            gen_config,
            settings.max_new_tokens,
            settings.batch_size,
            config.seed,
            system_prompt,
            source=str(src.tokenizer_dir),
            progress=bar,
        )
    rows = [
        {
            "model": src.label,
            "group": group,
            "prompt_id": p.id,
            "language": p.language,
            "prompt": p.prompt,
            "answer": text,
            "ended_turn": ended,
            "num_new_tokens": num_new,
            "reference": p.reference,
        }
        for (group, p), (text, ended, num_new) in zip(asked, answered, strict=True)
    ]
    log.info("assistant %s: %d answers in %.1f s", src.label, len(rows), time.perf_counter() - t0)
    return AssistantRun(rows, gen_config.to_diff_dict(), round(time.perf_counter() - t0, 2))
