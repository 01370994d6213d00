"""Eval stage: did the new tokenizer, the CPT and the SFT make the model better at Azerbaijani, and at what cost?
parse → tokenizer measures → per model: BPB, generations, tasks, assistant answers → compare → publish."""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilforge_shared import runtime_policy
from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.errors import InputError, field_errors
from dilforge_shared.progress import Progress
from pydantic import ValidationError

from . import assistant as assistant_mod
from . import compare, downstream, measures, tables
from . import generate as gen_mod
from . import morph as morph_mod
from .config import EvalConfig
from .metrics import (
    AssistantSection,
    AssistantThresholds,
    BpbFigures,
    Downstream,
    EvalMetrics,
    EvalTokenizer,
    GenerationFigures,
    Share,
    TextSet,
)
from .metrics import EvalModel as ModelFigures
from .report import write_report
from .resolve import EvalModel, load_model, load_tokenizers, resolve_models
from .texts import read_parallel, read_set

log = logging.getLogger("dilforge.eval")


def run(config: EvalConfig, ctx: StageContext) -> StageResult:
    t_start, c_start = time.perf_counter(), time.process_time()
    inputs = parse(config, ctx)
    log_config(config, inputs.derived(config))
    if not inputs.models and not inputs.toks:
        raise InputError(
            "nothing to evaluate: no upstream artifacts and no models/tokenizers in the config", path="eval.models"
        )
    t_tok = time.perf_counter()
    tokenizers = measure_tokenizers(config, inputs)
    seconds = {"tokenizer_metrics": round(time.perf_counter() - t_tok, 2)}
    evaluated = evaluate_models(config, inputs)
    seconds |= {**evaluated.seconds, "total": round(time.perf_counter() - t_start, 2)}
    upstream = upstream_sections(ctx)
    upstream["cost"]["eval"] = eval_cost(seconds, c_start, evaluated)
    metrics = EvalMetrics(
        **tokenizers,
        **comparisons(config, inputs, evaluated),
        **upstream,
        models=evaluated.models,
        bpb=evaluated.bpb,
        downstream=evaluated.downstream,
        assistant=evaluated.assistant if evaluated.assistant and evaluated.assistant.figures else None,
        skipped=inputs.skipped,
        seconds=seconds,
    )
    return StageResult(metrics=publish(ctx, metrics, evaluated))


@dataclass
class Inputs:
    """Everything read and resolved before any model is scored."""

    device: str
    dtype: Any  # torch dtype
    cache: Path
    sets: dict[str, list[str]]
    languages: dict[str, str]
    parallel: dict[str, list[tuple[str, str]]]
    prompts: list
    task_dir: Path
    specs: list[downstream.TaskSpec]
    assistant: dict[str, list[assistant_mod.AssistantPrompt]]  # prompt group -> prompts
    models: list[EvalModel]
    skipped: list[str]
    toks: dict  # label -> tokenizers.Tokenizer (identical ones once)
    tok_info: dict
    gold: dict[str, list[morph_mod.GoldWord]]

    def derived(self, config: EvalConfig) -> dict:
        """The derived numbers logged with the resolved config."""
        return {
            "device": self.device,
            "dtype": str(self.dtype),
            "models": [m.label for m in self.models],
            "tokenizers": list(self.toks),
            "set_languages": self.languages,
            "reference_model": compare.reference_label(m.label for m in self.models),
            "text_set_bytes": {k: measures.text_bytes(v) for k, v in self.sets.items()},
            "parallel_pairs": {k: len(v) for k, v in self.parallel.items()},
            "num_prompts": len(self.prompts),
            "morph_words": {k: len(v) for k, v in self.gold.items()},
            "num_generations": len(self.prompts) * len(config.generation.modes) * len(self.models),
            "assistant_prompts": {group: len(p) for group, p in self.assistant.items()},
            "tasks": {s.key: s.num_examples for s in self.specs},
        }


@dataclass
class Evaluated:
    """Per model: its description, BPB per set, generations, downstream results and the time each took."""

    models: dict[str, ModelFigures] = field(default_factory=dict)
    bpb: dict[str, dict[str, BpbFigures]] = field(default_factory=dict)
    generations: list[dict] = field(default_factory=list)
    downstream: Downstream | None = None  # downstream.metrics_header + results and seconds per model
    task_samples: list[dict] = field(default_factory=list)
    assistant: AssistantSection | None = None  # figures, generation config and seconds per model
    assistant_rows: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def parse(config: EvalConfig, ctx: StageContext) -> Inputs:
    """Device and dtype first (an impossible device fails before anything is read), then texts, prompts, the
    task folder, models, tokenizers and the morphology gold."""
    import torch

    torch.manual_seed(config.seed)
    endpoint, cap, a = ctx.endpoint_url, (config.max_docs_per_set, config.max_bytes_per_set), config.assistant
    policy = runtime_policy.decide("eval", device=config.device, precision=config.precision)
    sets = {s.label: read_set(s, *cap, endpoint) for s in config.text_sets}
    parallel = {p.name: read_parallel(p, *cap, endpoint) for p in config.parallel_sets}
    prompts = gen_mod.load_prompts(config.prompts, config.generation.num_prompts, endpoint) if config.prompts else []
    task_dir = ctx.opt.model_dir / downstream.TASK_DIR
    specs = downstream.prepare(config.tasks, task_dir, endpoint) if config.tasks else []
    if a:  # one prompt group per language, and the target language without diacritics
        assistant = assistant_mod.load_prompts(a.prompts, a.per_language, endpoint)
        assistant = assistant_mod.groups(assistant, config.target_language, a.no_diacritics)
    models, skipped = resolve_models(config, ctx, ctx.cache_dir)
    toks, tok_info = load_tokenizers(config, ctx, models, ctx.cache_dir)
    return Inputs(
        device=policy.device,
        dtype=policy.torch_dtype(),
        cache=ctx.cache_dir,
        sets=sets,
        languages={
            s.label: compare.infer_language(s, config.set_languages, config.target_language) for s in config.text_sets
        },
        parallel=parallel,
        prompts=prompts,
        task_dir=task_dir,
        specs=specs,
        assistant=assistant if a else {},
        models=models,
        skipped=skipped,
        toks=toks,
        tok_info=tok_info,
        gold=morph_mod.load_gold(config.morph, config.seed, endpoint) if config.morph else {},
    )


def measure_tokenizers(config: EvalConfig, inputs: Inputs) -> dict:
    """The tokenizer and text-set inventory and every tokenizer's fertility, parity and morpheme alignment."""
    sets, toks = inputs.sets, inputs.toks
    return {
        "tokenizers": {label: EvalTokenizer(**info) for label, info in inputs.tok_info.items()},
        "text_sets": {
            k: TextSet(
                uri=s.uri, language=inputs.languages[k], num_docs=len(sets[k]), num_bytes=measures.text_bytes(sets[k])
            )
            for k, s in zip(sets, config.text_sets, strict=False)
        },
        "tokenizer_metrics": measures.tokenizer_metrics(toks, sets),
        "parity": measures.parity_metrics(toks, inputs.parallel),
        "morph": measures.morph_metrics(toks, inputs.gold),
    }


def evaluate_models(config: EvalConfig, inputs: Inputs) -> Evaluated:
    """Each model in turn (loaded, scored, freed): BPB per set, generations, downstream tasks, assistant answers."""
    out = Evaluated()
    if inputs.specs:
        dtype = str(inputs.dtype).removeprefix("torch.")
        out.downstream = downstream.metrics_header(
            inputs.specs, config.tasks, inputs.task_dir, dtype, inputs.device, config.seed
        )
    if a := config.assistant:  # the gate's thresholds; each model adds its figures
        gate = AssistantThresholds(
            language=config.target_language, min_in_language=a.min_in_language, min_ended_turn=a.min_ended_turn
        )
        out.assistant = AssistantSection(
            prompts=a.prompts, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, thresholds=gate, figures={}
        )
    for src in inputs.models:
        t_model = time.perf_counter()
        evaluate_model(src, config, inputs, out)
        out.seconds[f"model.{src.label}"] = round(time.perf_counter() - t_model, 2)
        if (seconds := out.models[src.label].tasks_seconds) is not None:
            out.seconds[f"tasks.{src.label}"] = seconds
    if out.downstream is not None:
        out.downstream.changes = downstream.changes(out.downstream, compare.reference_label(out.downstream.results))
    return out


def evaluate_model(src: EvalModel, config: EvalConfig, inputs: Inputs, out: Evaluated) -> None:
    """One model into `out`: BPB per set, generations, the assistant answers and the downstream tasks; the model
    is freed afterwards."""
    import torch

    t0 = time.perf_counter()
    model, tokenizer = load_model(src, inputs.device, inputs.dtype)
    window = measures.default_window(model, config.bpb.window)
    stride = min(config.bpb.stride or max(1, window // 2), window)
    info = out.models[src.label] = ModelFigures(
        origin=src.origin,
        num_parameters=sum(p.numel() for p in model.parameters()),
        adapter=src.adapter_dir is not None,
        bpb_window=window,
        bpb_stride=stride,
        dtype=str(inputs.dtype).removeprefix("torch."),
        device=inputs.device,
        load_seconds=round(time.perf_counter() - t0, 2),
    )
    log.info("model %s: %s parameters, window %d stride %d", src.label, f"{info.num_parameters:,}", window, stride)
    for name, docs in inputs.sets.items():
        with Progress(f"bpb {src.label}/{name}", unit="batches", log=log) as bar:
            res = measures.bits_per_byte(model, tokenizer, docs, window, stride, config.bpb.batch_size, bar.batches)
        f = out.bpb.setdefault(src.label, {})[name] = measures.bpb_summary(res)
        log.info("bpb %s / %s: %.4f (%d tokens, %d bytes)", src.label, name, f.bpb, f.num_tokens, f.num_bytes)
    if inputs.prompts:  # closed on an error too: its heartbeat thread must not outlive the pass
        modes, source = config.generation.modes, str(src.tokenizer_dir)
        with Progress(f"generate {src.label}", len(inputs.prompts) * len(modes), unit="answers", log=log) as bar:
            for mode in modes:
                rows = gen_mod.generate(
                    model, tokenizer, inputs.prompts, mode, config.generation, config.seed, source, bar
                )
                out.generations += [{"model": src.label, **row} for row in rows]
    if inputs.assistant:
        assistant_answers(model, tokenizer, src, config, inputs.assistant, out)
    if inputs.specs:
        t_tasks, c_tasks = time.perf_counter(), time.process_time()
        results, samples = downstream.run_model(
            model, tokenizer, inputs.specs, inputs.task_dir, config.tasks, inputs.cache, config.seed
        )
        info.tasks_seconds = round(time.perf_counter() - t_tasks, 2)
        info.tasks_cpu_seconds = round(time.process_time() - c_tasks, 2)  # all threads; shared CPUs inflate wall
        out.downstream.results[src.label] = results
        out.downstream.seconds[src.label] = info.tasks_seconds
        out.task_samples += [{"model": src.label, **row} for row in samples]
        for key, res in results.items():
            figures = (
                f"{m} {v.value:.4g}" + (f" ± {v.stderr:.2g}" if v.stderr is not None else "") for m, v in res.items()
            )
            log.info("task %s / %s: %s", src.label, key, ", ".join(figures))
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def assistant_answers(model, tokenizer, src: EvalModel, config: EvalConfig, groups: dict, out: Evaluated) -> None:
    """The model's answers to every assistant prompt group, as a server gives them: its published generation
    config, its chat template with the SFT system prompt a server inserts by default, batched; scored per group
    into `out.assistant` (the gate's section, docs/eval.md), the answers into `out.assistant_rows`."""
    settings = config.assistant
    gen_config = gen_mod.published_generation_config(model, (src.base_dir, src.adapter_dir))
    manifest = src.manifest
    system_prompt = (manifest.config.get("system_prompt") or None) if manifest and manifest.stage == "sft" else None
    asked = [(group, p) for group, prompts in groups.items() for p in prompts]
    log.info("assistant %s: %d prompts in batches of %d", src.label, len(asked), settings.batch_size)
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
    seconds = round(time.perf_counter() - t0, 2)
    log.info("assistant %s: %d answers in %.1f s", src.label, len(asked), seconds)
    by_group = {}
    for (group, p), (text, ended, num_new) in zip(asked, answered, strict=True):
        row = {"model": src.label, "group": group, "prompt_id": p.id, "language": p.language, "prompt": p.prompt}
        row |= {"answer": text, "ended_turn": ended, "num_new_tokens": num_new, "reference": p.reference}
        out.assistant_rows.append(row)
        by_group.setdefault(group, []).append(assistant_mod.Answer(p.prompt, text, p.language, ended, p.reference))
    figures = out.assistant.figures[src.label] = {g: assistant_mod.score(answers) for g, answers in by_group.items()}
    for group, f in figures.items():
        shares = ", ".join(f"{k.replace('_', ' ')} {s.value:.2f}" for k, s in f if isinstance(s, Share))
        chrf = f", chrF++ {f.chrf.score:.1f}" if f.chrf else ""
        log.info("assistant %s / %s (n %d): %s%s", src.label, group, f.n, shares, chrf)
    out.assistant.generation_config[src.label] = gen_config.to_diff_dict()
    out.assistant.seconds[src.label] = out.seconds[f"assistant.{src.label}"] = seconds


def comparisons(config: EvalConfig, inputs: Inputs, evaluated: Evaluated) -> dict:
    """Per-set BPB change against the reference model, the headline and each model's generation repetition."""
    reference = compare.reference_label(evaluated.bpb)
    bpb_change = compare.bpb_changes(evaluated.bpb, reference, inputs.languages)
    headline = compare.headline(bpb_change, reference, inputs.languages, config.target_language)
    by_mode: dict = {}
    for g in evaluated.generations:
        by_mode.setdefault(g["model"], {}).setdefault(g["mode"], []).append(g)
    generation = {
        m: {mode: GenerationFigures(**gen_mod.mean_repetition(rows)) for mode, rows in d.items()}
        for m, d in by_mode.items()
    }
    return {"bpb_change": bpb_change, "headline": headline, "generation": generation}


def upstream_sections(ctx: StageContext) -> dict:
    """Training curves and costs (cpt, sft), the vocab sweep and strategies (tokenizer), step-0 BPB (cpt), from
    each upstream stage's manifest metrics (`compare.upstream`)."""
    out: dict[str, Any] = {"curves": {}, "cost": {}}
    for stage in ("cpt", "sft", "tokenizer"):
        if ctx.has_input(stage):
            art = ctx.input(stage)
            try:
                compare.upstream(stage, art.manifest.metrics, out)
            except ValidationError as exc:  # a field eval reads is missing or of another shape
                raise InputError(
                    f"{stage} metrics do not hold what eval reports ({field_errors(exc, within=('metrics',))}): "
                    "an artifact of another dilforge version?",
                    path=art.uri,
                ) from None
    return out


def eval_cost(seconds: dict[str, float], c_start: float, evaluated: Evaluated) -> dict:
    """The eval stage's own cost: wall and CPU seconds, and those of the downstream tasks."""
    cost = {"seconds_total": seconds["total"], "cpu_seconds_total": round(time.process_time() - c_start, 2)}
    if evaluated.downstream is not None:
        cost["seconds_tasks"] = round(sum(evaluated.downstream.seconds.values()), 2)
        cost["cpu_seconds_tasks"] = round(sum(m.tasks_cpu_seconds or 0 for m in evaluated.models.values()), 2)
    return cost


def publish(ctx: StageContext, typed: EvalMetrics, evaluated: Evaluated) -> dict:
    """generations.jsonl, task_answers.jsonl, the report and metrics.json into the artifact folder; returns the
    manifest's metrics (curves as their last points: the whole curves are in metrics.json). The report reads
    the typed model."""
    out = ctx.opt.model_dir
    downstream.write_jsonl(out / "generations.jsonl", evaluated.generations)
    if evaluated.downstream is not None:
        downstream.write_jsonl(out / "task_answers.jsonl", evaluated.task_samples)
    if evaluated.assistant_rows:
        downstream.write_jsonl(out / "assistant_answers.jsonl", evaluated.assistant_rows)
    paths = write_report(typed, evaluated.generations, out, f"dilforge eval report — run {ctx.request.run_id}")
    typed.report = {k: str(p.relative_to(out)) for k, p in paths.items()}
    dumped = typed.model_dump(mode="json")
    (out / "metrics.json").write_text(json.dumps(dumped, indent=2, ensure_ascii=False), encoding="utf-8")
    log.info("wrote %s (published with the artifact)", ", ".join(sorted(typed.report.values())))
    head, rows = tables.headline_table(typed)
    for model, *cells in rows:  # the report's headline, in the log
        log.info("headline: %s: %s", model, "; ".join(f"{h} {c}" for h, c in zip(head[1:], cells, strict=True)))
    summary = {k: v for k, v in dumped.items() if k != "curves"}
    summary["curves"] = {stage: {k: v[-1] for k, v in s.items()} for stage, s in dumped["curves"].items()}
    return summary
