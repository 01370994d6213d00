"""Runs the downstream tasks with lm-eval's `simple_evaluate` on the model the stage loaded (plain tasks, then chat
tasks with the chat template), offline; each metric as value, standard error and 95 % interval."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from .config import DownstreamTasks
from .downstream import TaskSpec, seeds, write_commands
from .metrics import Downstream, DownstreamTask, HarnessInfo, TaskScore

Z95 = 1.959964
SCALE_100 = ("chrf++", "chrf", "bleu")


def _offline_env(cache: Path) -> None:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_DATASETS_CACHE", str(cache / "hf-datasets"))
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap pool: one process per core otherwise
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_model(
    model, tokenizer, specs: list[TaskSpec], task_dir: Path, tasks: DownstreamTasks, cache: Path, seed: int
) -> tuple[dict, list[dict]]:
    """Every task on one loaded model: {task key: {metric: {value, stderr, ci95}, ...}} and the per-example
    records (prompt, answer, reference) of the generative tasks."""
    _offline_env(cache)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=tasks.batch_size, max_length=tasks.max_length)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    results, samples = {}, []
    with contextlib.chdir(task_dir):  # data_files are relative to the task folder, as in the lm_eval command
        for chat in (False, True):
            group = [s for s in specs if s.chat == chat]
            if not group:
                continue
            out = simple_evaluate(
                model=lm,
                tasks=[s.task for s in group],
                task_manager=manager,
                bootstrap_iters=tasks.bootstrap_iters,
                apply_chat_template=chat,
                system_instruction=tasks.system_prompt if chat else None,
                log_samples=True,
                **seeds(seed),
            )
            for s in group:
                results[s.key] = summarize(out["results"][s.task], s)
                if s.kind == "instruction":
                    answers = [row["filtered_resps"][0] for row in out["samples"][s.task]]
                    results[s.key]["ended_turn"] = ended_turn(answers, tokenizer, tasks.instruction_max_new_tokens)
                if s.kind in ("translation", "instruction"):
                    samples += [
                        {"task": s.key, "doc_id": r["doc_id"], "target": r["target"], "answer": r["filtered_resps"][0]}
                        for r in out["samples"][s.task]
                    ]
    return results, samples


def score(value: float, se: float | None, top: float = 1.0) -> TaskScore:
    """A value with its standard error and the normal 95 % interval (value ± 1.96 se, clipped to [0, top])."""
    return TaskScore(
        value=round(float(value), 6),
        stderr=None if se is None else round(float(se), 6),
        ci95=None if se is None else (round(max(0.0, value - Z95 * se), 6), round(min(top, value + Z95 * se), 6)),
    )


def ended_turn(answers: list[str], tokenizer, max_new_tokens: int) -> TaskScore:
    """Share of answers that stopped at the end of the turn, i.e. before the token limit (the stage counts the
    answer's tokens; lm-eval strips the stop token, so this one figure is the stage's, not the harness's), with
    lm-eval's binomial standard error (sample std / sqrt(n))."""
    n = len(answers)
    p = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) < max_new_tokens for a in answers) / n
    return score(p, math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None)


def metrics_header(
    specs: list[TaskSpec], tasks: DownstreamTasks, task_dir: Path, dtype: str, device: str, seed: int
) -> Downstream:
    """The manifest's `downstream` section before any model ran: what each task is, how to reproduce it
    (the commands are also written to the task folder's commands.txt)."""
    from importlib.metadata import version

    return Downstream(
        harness=HarnessInfo(
            name="lm-evaluation-harness",
            version=version("lm-eval"),
            bootstrap_iters=tasks.bootstrap_iters,
            batch_size=tasks.batch_size,
        ),
        task_dir=task_dir.name,
        commands=write_commands(task_dir, specs, tasks, dtype, device, seed),
        tasks={s.key: DownstreamTask(**s.model_dump()) for s in specs},
        results={},
        seconds={},
    )


def changes(section: Downstream, reference: str | None) -> dict[str, dict[str, dict[str, float]]]:
    """model -> task -> metric -> value minus the reference model's (positive = higher)."""
    results = section.results  # the reference is one of them unless there are none
    out: dict = {}
    for model, tasks in results.items():
        if model == reference:
            continue
        for key, res in tasks.items():
            for m, v in res.items():
                ref = results[reference].get(key, {}).get(m)
                if ref is not None:
                    out.setdefault(model, {}).setdefault(key, {})[m] = round(v.value - ref.value, 6)
    return out


def summarize(res: dict, spec: TaskSpec) -> dict[str, TaskScore]:
    """lm-eval's `metric,none` / `metric_stderr,none` into value, stderr and the normal 95 % interval
    (value ± 1.96 stderr, clipped to the metric's range: 0-1 for shares, 0-100 for chrF/BLEU)."""
    out: dict[str, TaskScore] = {}
    for m in spec.metrics:
        value = res.get(f"{m},none")
        if value is None:
            continue
        se = res.get(f"{m}_stderr,none")
        out[m] = score(value, se if isinstance(se, int | float) else None, 100.0 if m in SCALE_100 else 1.0)
    return out
