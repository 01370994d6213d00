"""Eval stage: did the new tokenizer, the CPT and the SFT make the model better at Azerbaijani, by how
much, and what did it cost?

Story: read the text sets (capped) and give each its language → resolve tokenizers and models (the
pipeline's base `model` artifact as "base", models given in the config, the upstream cpt/sft) →
tokenizer metrics, parity, morpheme alignment → per model: bits per byte on every set and generations
for the prompts (progress with ETA) → per-set BPB change against the base, the headline (target-language
gain, other languages' retention), step-0 BPB per initialisation, tokenizer strategies, training
curves and costs from the upstream manifests → metrics.json, generations.jsonl, report.html /
report.md / plots/*.png in the artifact.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import time
from itertools import zip_longest
from pathlib import Path

from dilforge_shared import runtime_policy
from dilforge_shared.configs import EvalConfig
from dilforge_shared.configs.eval import BASE_LABEL
from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.metrics import read_metrics
from dilforge_shared.models import Resolved, adapter_base, open_model, resolve
from dilforge_shared.progress import Progress
from dilforge_shared.textmetrics import measure, tokenizers_encoder

from . import bpb as bpb_mod
from . import compare, downstream, harness, progress
from . import curves as curves_mod
from . import generate as gen_mod
from . import morph as morph_mod
from .report import write_report
from .resolve import (
    EvalModel,
    adapter_base_dir,
    cache_dir_for,
    find_adapter_dir,
    find_model_dir,
    find_tokenizer_dir,
    load_model,
    locate,
    model_source,
    open_root,
    tokenizer_json,
)

log = logging.getLogger("dilforge.eval")


def _capped(source, max_bytes: int | None) -> dict:
    """Reader bounds: a document never larger than the set's byte cap (the first one is truncated to it)."""
    bounds = source.bounds
    if max_bytes is not None and max_bytes < bounds["max_document_bytes"]:
        bounds = {"max_document_bytes": max(max_bytes, 64), "on_oversize": "truncate"}
    return bounds


def read_set(source, max_docs: int | None, max_bytes: int | None, endpoint: str | None) -> list[str]:
    """Documents of a text set, stopping at max_docs or once max_bytes are reached (at least one doc)."""
    docs, size = [], 0
    for text in iter_texts(source.uri, source.format, source.text_field, endpoint, **_capped(source, max_bytes)):
        n = len(text.encode("utf-8")) + 1
        if docs and max_bytes is not None and size + n > max_bytes:
            break
        docs.append(text)
        size += n
        if max_docs is not None and len(docs) >= max_docs:
            break
    if not docs:
        raise InputError("text set holds no text", path=source.uri)
    return docs


def read_parallel(pset, max_docs: int | None, max_bytes: int | None, endpoint: str | None) -> list[tuple[str, str]]:
    """Aligned (az, en) pairs: line i of one side with line i of the other; capped like a text set.

    Both sides are streamed together; past the cap the rest is only counted (to check alignment), not kept.
    """
    az = iter_texts(
        pset.az.uri, pset.az.format, pset.az.text_field, endpoint, skip_empty=False, **_capped(pset.az, max_bytes)
    )
    en = iter_texts(
        pset.en.uri, pset.en.format, pset.en.text_field, endpoint, skip_empty=False, **_capped(pset.en, max_bytes)
    )
    pairs: list[tuple[str, str]] = []
    size, full, num_az, num_en = 0, False, 0, 0
    for a, e in zip_longest(az, en):
        num_az += a is not None
        num_en += e is not None
        if full or a is None or e is None or not (a.strip() and e.strip()):
            continue
        n = len(a.encode("utf-8")) + 1
        if pairs and max_bytes is not None and size + n > max_bytes:
            full = True
            continue
        pairs.append((a, e))
        size += n
        full = max_docs is not None and len(pairs) >= max_docs
    if num_az != num_en:
        raise InputError(
            f"parallel set {pset.name!r}: {num_az} az documents but {num_en} en documents", path=pset.en.uri
        )
    if not pairs:
        raise InputError(f"parallel set {pset.name!r} holds no aligned pair", path=pset.az.uri)
    return pairs


def load_tokenizers(config: EvalConfig, ctx: StageContext, models: list[EvalModel], cache: Path):
    """label -> tokenizers.Tokenizer; tokenizers with identical tokenizer.json are listed once, with aliases."""
    from tokenizers import Tokenizer

    entries: list[tuple[str, Path, str]] = []
    if ctx.has_input("tokenizer"):
        art = ctx.input("tokenizer")
        tdir = find_tokenizer_dir(art.path)
        if tdir is None:
            raise InputError("tokenizer artifact holds no tokenizer.json", path=art.uri)
        entries.append(("tokenizer", tdir, f"artifact {art.manifest.artifact_id}"))
    for ref in config.tokenizers:
        entries.append((ref.label, locate(ref.uri, "tokenizer", cache, ctx.endpoint_url).path, ref.uri))
    for m in models:
        entries.append((m.label, m.tokenizer_dir, f"tokenizer of model {m.label}"))
    out, info, by_hash = {}, {}, {}
    for label, tdir, origin in entries:
        path = tokenizer_json(tdir)
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
    if find_model_dir(art.path) is None and (adapter := find_adapter_dir(art.path)) is not None:
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
        src = open_root(ref.uri, cache, ctx.endpoint_url)
        tok = locate(ref.tokenizer_uri, "tokenizer", cache, ctx.endpoint_url).path if ref.tokenizer_uri else None
        adapter = locate(ref.adapter_uri, "adapter", cache, ctx.endpoint_url).path if ref.adapter_uri else None
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


def tokenizer_metrics(toks, sets: dict[str, list[str]]) -> dict:
    return {
        label: {name: measure(docs, tokenizers_encoder(tok)).summary() for name, docs in sets.items()}
        for label, tok in toks.items()
    }


def parity_metrics(toks, parallel: dict[str, list[tuple[str, str]]]) -> dict:
    out: dict = {}
    for label, tok in toks.items():
        for name, pairs in parallel.items():
            az = sum(len(e.ids) for e in tok.encode_batch([p[0] for p in pairs], add_special_tokens=False))
            en = sum(len(e.ids) for e in tok.encode_batch([p[1] for p in pairs], add_special_tokens=False))
            out.setdefault(label, {})[name] = {
                "tokens_az": az,
                "tokens_en": en,
                "num_pairs": len(pairs),
                "parity": round(az / en, 4) if en else None,
            }
    return out


def morph_metrics(toks, gold: dict[str, list[morph_mod.GoldWord]]) -> dict:
    out: dict = {}
    for label, tok in toks.items():
        total = morph_mod.AlignmentStats()
        for source, words in gold.items():
            stats = morph_mod.alignment(tok, words)
            out.setdefault(label, {})[source] = stats.summary()
            for k, v in stats.__dict__.items():
                setattr(total, k, getattr(total, k) + v)
        if len(gold) > 1:
            out[label]["all"] = total.summary()
    return out


def upstream_metrics(ctx: StageContext, stage: str):
    """An upstream stage's metrics, typed (`dilforge_shared.metrics`), or None without that input."""
    if not ctx.has_input(stage):
        return None
    art = ctx.input(stage)
    return read_metrics(stage, art.manifest.metrics, art.uri)


def evaluate_model(
    src: EvalModel,
    config: EvalConfig,
    sets: dict[str, list[str]],
    prompts,
    device: str,
    dtype,
    tasks: tuple[list[downstream.TaskSpec], Path, Path] | None = None,
):
    """BPB per set, generations and the downstream tasks (specs, task folder, cache) of one model; the model
    is freed afterwards."""
    import torch

    t0 = time.perf_counter()
    model, tokenizer = load_model(src, device, dtype)
    window = bpb_mod.default_window(model, config.bpb.window)
    stride = min(config.bpb.stride or max(1, window // 2), window)
    info = {
        "origin": src.origin,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "adapter": src.adapter_dir is not None,
        "bpb_window": window,
        "bpb_stride": stride,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "load_seconds": round(time.perf_counter() - t0, 2),
    }
    log.info("model %s: %s parameters, window %d stride %d", src.label, f"{info['num_parameters']:,}", window, stride)
    bpb = {}
    for name, docs in sets.items():
        num_tokens = len(tokenizer(bpb_mod.pack(docs), add_special_tokens=False)["input_ids"])
        total = progress.num_bpb_batches(num_tokens, window, stride, config.bpb.batch_size)
        with progress.forward_progress(model, total, f"bpb {src.label}/{name}"):
            res = bpb_mod.bits_per_byte(model, tokenizer, docs, window, stride, config.bpb.batch_size)
        bpb[name] = res.summary()
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
        bar = Progress(f"generate {src.label}", len(prompts) * len(config.generation.modes), unit="answer", log=log)
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
        bar.close()
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
        info["tasks_seconds"] = round(time.perf_counter() - t_tasks, 2)
        info["tasks_cpu_seconds"] = round(time.process_time() - c_tasks, 2)  # all threads; shared CPUs inflate wall
        for key, res in scores["results"].items():
            log.info(
                "task %s / %s: %s",
                src.label,
                key,
                ", ".join(
                    f"{m} {v['value']:.4g}" + (f" ± {v['stderr']:.2g}" if v["stderr"] is not None else "")
                    for m, v in res.items()
                ),
            )
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info, bpb, generations, scores


def run(config: EvalConfig, ctx: StageContext) -> StageResult:
    t_start, c_start = time.perf_counter(), time.process_time()
    import torch

    torch.manual_seed(config.seed)
    endpoint = ctx.endpoint_url
    cache = cache_dir_for(ctx.opt.root)
    policy = runtime_policy.decide("eval", device=config.device, precision=config.precision)
    device, dtype = policy.device, policy.torch_dtype()

    sets = {s.label: read_set(s, config.max_docs_per_set, config.max_bytes_per_set, endpoint) for s in config.text_sets}
    languages = {
        s.label: compare.infer_language(s, config.set_languages, config.target_language) for s in config.text_sets
    }
    parallel = {
        p.name: read_parallel(p, config.max_docs_per_set, config.max_bytes_per_set, endpoint)
        for p in config.parallel_sets
    }
    prompts = gen_mod.load_prompts(config.prompts, config.generation.num_prompts, endpoint) if config.prompts else []
    task_dir = ctx.model_dir / downstream.TASK_DIR
    specs = downstream.prepare(config.tasks, task_dir, endpoint, read_parallel) if config.tasks else []
    models, skipped = resolve_models(config, ctx, cache)
    toks, tok_info = load_tokenizers(config, ctx, models, cache)
    gold = (
        morph_mod.load_gold(
            config.morph.segmented,
            config.morph.lemma_forms,
            config.morph.conllu,
            config.morph.num_words_per_source,
            config.seed,
            endpoint,
        )
        if config.morph
        else {}
    )
    log_config(
        config,
        {
            "device": device,
            "dtype": str(dtype),
            "models": [m.label for m in models],
            "tokenizers": list(toks),
            "set_languages": languages,
            "reference_model": compare.reference_label(m.label for m in models),
            "text_set_bytes": {k: bpb_mod.text_bytes(v) for k, v in sets.items()},
            "parallel_pairs": {k: len(v) for k, v in parallel.items()},
            "num_prompts": len(prompts),
            "morph_words": {k: len(v) for k, v in gold.items()},
            "num_generations": len(prompts) * len(config.generation.modes) * len(models),
            "tasks": {s.key: s.num_examples for s in specs},
        },
    )
    if not models and not toks:
        raise InputError(
            "nothing to evaluate: no upstream artifacts and no models/tokenizers in the config", path="eval.models"
        )

    t_tok = time.perf_counter()
    metrics: dict = {
        "models": {},
        "tokenizers": tok_info,
        "text_sets": {
            k: {
                "uri": s.uri,
                "language": languages[k],
                "num_docs": len(sets[k]),
                "num_bytes": bpb_mod.text_bytes(sets[k]),
            }
            for k, s in zip(sets, config.text_sets, strict=False)
        },
        "tokenizer_metrics": tokenizer_metrics(toks, sets),
        "parity": parity_metrics(toks, parallel),
        "morph": morph_metrics(toks, gold),
    }
    seconds = {"tokenizer_metrics": round(time.perf_counter() - t_tok, 2)}

    metrics["bpb"], generations, task_samples = {}, [], []
    if specs:
        metrics["downstream"] = harness.metrics_header(
            specs, config.tasks, task_dir, str(dtype).removeprefix("torch."), device, config.seed
        )
    for src in models:
        t_model = time.perf_counter()
        info, bpb, gens, scores = evaluate_model(src, config, sets, prompts, device, dtype, (specs, task_dir, cache))
        metrics["models"][src.label] = info
        if bpb:
            metrics["bpb"][src.label] = bpb
        generations += gens
        if scores:
            metrics["downstream"]["results"][src.label] = scores["results"]
            metrics["downstream"]["seconds"][src.label] = info["tasks_seconds"]
            task_samples += [{"model": src.label, **row} for row in scores["samples"]]
        seconds[f"model.{src.label}"] = round(time.perf_counter() - t_model, 2)
        if "tasks_seconds" in info:
            seconds[f"tasks.{src.label}"] = info["tasks_seconds"]
    reference = compare.reference_label(metrics["bpb"])
    metrics["bpb_change"] = compare.bpb_changes(metrics["bpb"], reference, languages)
    metrics["headline"] = compare.headline(metrics["bpb_change"], reference, languages, config.target_language)
    for line in compare.headline_lines(metrics["headline"]):
        log.info("headline: %s", line)
    metrics["generation"] = {}
    for g in generations:
        metrics["generation"].setdefault(g["model"], {}).setdefault(g["mode"], []).append(g)
    metrics["generation"] = {
        m: {mode: gen_mod.mean_repetition(rows) for mode, rows in d.items()} for m, d in metrics["generation"].items()
    }

    metrics["curves"], metrics["cost"] = {}, {}
    for stage in ("cpt", "sft"):
        if (typed := upstream_metrics(ctx, stage)) is not None:
            if series := curves_mod.training_curves(typed):
                metrics["curves"][stage] = {k: [list(p) for p in v] for k, v in series.items()}
            if c := typed.cost():
                metrics["cost"][stage] = c
    if (tok := upstream_metrics(ctx, "tokenizer")) is not None:
        metrics["vocab_sweep"] = compare.vocab_sweep(tok)
        if comp := compare.tokenizer_comparison(tok):
            metrics["tokenizer_comparison"] = comp
    if (cpt := upstream_metrics(ctx, "cpt")) is not None and (step0 := compare.step0_bpb(cpt)):
        metrics["transplant"] = step0
    metrics["skipped"] = skipped
    seconds["total"] = round(time.perf_counter() - t_start, 2)
    metrics["cost"]["eval"] = {"seconds_total": seconds["total"]}
    metrics["cost"]["eval"]["cpu_seconds_total"] = round(time.process_time() - c_start, 2)
    if specs:
        metrics["cost"]["eval"]["seconds_tasks"] = round(sum(metrics["downstream"]["seconds"].values()), 2)
        metrics["cost"]["eval"]["cpu_seconds_tasks"] = round(
            sum(m.get("tasks_cpu_seconds", 0) for m in metrics["models"].values()), 2
        )
    metrics["seconds"] = seconds

    out = ctx.model_dir
    with open(out / "generations.jsonl", "w", encoding="utf-8") as f:
        for g in generations:
            f.write(json.dumps(g, ensure_ascii=False) + "\n")
    if specs:
        metrics["downstream"]["changes"] = harness.changes(
            metrics["downstream"], compare.reference_label(metrics["downstream"]["results"])
        )
        with open(out / "task_answers.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in task_samples)
    paths = write_report(metrics, generations, out, f"dilforge eval report — run {ctx.request.run_id}")
    metrics["report"] = {k: str(p.relative_to(out)) for k, p in paths.items()}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, ensure_ascii=False), encoding="utf-8")
    log.info("wrote %s (published with the artifact)", ", ".join(sorted(metrics["report"].values())))
    summary = {k: v for k, v in metrics.items() if k != "curves"}
    summary["curves"] = {stage: {k: v[-1] for k, v in s.items()} for stage, s in metrics["curves"].items()}
    return StageResult(metrics=summary)
