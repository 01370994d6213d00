"""Downstream tasks (docs/eval.md): rows read and checked (`task_rows`), written as a self-contained lm-eval task
folder (YAML per task, JSONL rows) that is published, so its `commands.txt` reproduces every figure offline; run
with lm-eval's `simple_evaluate` on the model the stage loaded (plain tasks, then chat tasks with the chat
template), offline, each metric as value, standard error and 95 % interval."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from importlib.resources import files
from pathlib import Path

from dilforge_shared.errors import InputError
from pydantic import Field

from .compare import language_name
from .config import SIB_LABELS, DownstreamTasks, MultipleChoiceTask
from .metrics import Downstream, DownstreamTask, HarnessInfo, TaskScore
from .task_rows import instruction_rows, mc_rows, sib_rows
from .texts import read_parallel

TASK_DIR = "lm_eval_tasks"
PREFIX = "dilforge_"


class TaskSpec(DownstreamTask):
    """One lm-eval task the stage wrote, under its report key (e.g. "sib200/az/5-shot"); published without it."""

    key: str = Field(exclude=True)


class Fn(str):
    """A `!function utils.NAME` value: written as a YAML tag, not a string."""


def _yaml(d: dict) -> str:
    """Task YAML with JSON values (a YAML subset lm-eval reads), keys in order; Fn values as tags."""
    return (
        "\n".join(
            f"{k}: !function {v}" if isinstance(v, Fn) else f"{k}: {json.dumps(v, ensure_ascii=False)}"
            for k, v in d.items()
        )
        + "\n"
    )


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """The rows as JSONL; the path relative to its grandparent (how a task YAML names its data file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return str(path.relative_to(path.parent.parent))


def _task_file(out: Path, spec: TaskSpec, body: dict, data_files: dict[str, str]) -> TaskSpec:
    """The task's YAML in the task folder, reading its rows from `data_files` (split -> file)."""
    body = {"task": spec.task, **body, "dataset_kwargs": {"data_files": data_files}}
    (out / f"{spec.task}.yaml").write_text(_yaml(body), encoding="utf-8")
    return spec


def _copy_scores(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """chrF++ / chrF / BLEU of answering with the source itself: the floor a model must beat."""
    import sacrebleu

    hyp, ref = [p[0] for p in pairs], [[p[1] for p in pairs]]
    return {
        "chrf++": sacrebleu.corpus_chrf(hyp, ref, word_order=2).score,
        "chrf": sacrebleu.corpus_chrf(hyp, ref).score,
        "bleu": sacrebleu.corpus_bleu(hyp, ref).score,
    }


def prepare(tasks: DownstreamTasks, out: Path, endpoint: str | None) -> list[TaskSpec]:
    """Read and check every task's rows, write the lm-eval task folder `out`; the specs of the tasks in it."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in files("dilforge_eval.tasks").iterdir():  # the shared task configs and utils.py
        if entry.name.endswith((".yaml", ".py")) and entry.name != "__init__.py":
            shutil.copyfile(str(entry), out / entry.name)
    specs: list[TaskSpec] = []

    if tasks.sib200:
        cfg = tasks.sib200
        for lang, splits in sib_rows(cfg, endpoint).items():
            files_ = {
                split: write_jsonl(out / "data" / f"sib200_{lang}.{split}.jsonl", rows)
                for split, rows in splits.items()
            }
            test, uniform = splits["test"], 1 / len(SIB_LABELS)
            majority = max(sum(r["label"] == i for r in test) for i in range(len(SIB_LABELS))) / len(test)
            for k in cfg.num_fewshot:
                spec = TaskSpec(
                    key=f"sib200/{lang}/{k}-shot",
                    task=f"{PREFIX}sib200_{lang}_{k}shot",
                    kind="sib200",
                    language=lang,
                    row=f"SIB-200 topics, {k}-shot",
                    metrics=["acc", "acc_norm"],
                    headline_metrics=["acc"],
                    num_examples=len(test),
                    num_fewshot=k,
                    source=cfg.uri,
                    chance={"acc": uniform, "acc_norm": uniform, "majority": majority},
                    chance_note=f"uniform 1/{len(SIB_LABELS)}; majority class share",
                )
                specs.append(_task_file(out, spec, {"include": "_sib200.yaml", "num_fewshot": k}, files_))
    for t in tasks.translation:
        pairs = read_parallel(t, t.max_examples, None, endpoint)
        for direction in t.directions:
            src, tgt = direction.split("-")
            rows = [{"source": a, "target": e} if src == "az" else {"source": e, "target": a} for a, e in pairs]
            name = f"{PREFIX}translation_{t.name}_{src}_{tgt}".replace("-", "_").replace(".", "_")
            data = write_jsonl(out / "data" / f"translation_{t.name}.{direction}.jsonl", rows)
            spec = TaskSpec(
                key=f"translation/{t.name}/{direction}",
                task=name,
                kind="translation",
                language=tgt,
                row=f"{t.name} translation into",
                metrics=["chrf++", "chrf", "bleu"],
                headline_metrics=["chrf++", "bleu"],
                num_examples=len(rows),
                source=t.az.uri,
                chance=_copy_scores([(r["source"], r["target"]) for r in rows]),
                chance_note="copying the source sentence",
            )
            gen = {"until": ["\n"], "do_sample": False, "max_gen_toks": tasks.translation_max_new_tokens}
            prompt = f"{language_name(src)}: {{{{source}}}}\n{language_name(tgt)}:"
            body = {"include": "_translation.yaml", "doc_to_text": prompt, "generation_kwargs": gen}
            specs.append(_task_file(out, spec, body, {"test": data}))
    if tasks.instructions:
        cfg = tasks.instructions
        rows = instruction_rows(cfg, endpoint)
        data = write_jsonl(out / "data" / f"instruction_{cfg.name}.jsonl", rows)
        spec = TaskSpec(
            key=f"instruction/{cfg.name}",
            task=f"{PREFIX}instruction_{cfg.name}".replace("-", "_"),
            kind="instruction",
            language=cfg.language,
            chat=True,
            source=cfg.uri,
            row=f"{cfg.name} instructions (chat template)",
            metrics=["chrf++", "answer_in_language", "repetition_rate", "empty_answer"],
            headline_metrics=["chrf++", "answer_in_language", "repetition_rate", "ended_turn"],
            num_examples=len(rows),
            chance={"chrf++": _copy_scores([(r["instruction"], r["response"]) for r in rows])["chrf++"]},
            chance_note="chrF++: repeating the instruction",
        )
        until = ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>"]
        gen = {"until": until, "do_sample": False, "max_gen_toks": tasks.instruction_max_new_tokens}
        body = {
            "include": "_instruction.yaml",
            "process_results": Fn(f"utils.process_instruction_{cfg.language}"),
            "generation_kwargs": gen,
        }
        specs.append(_task_file(out, spec, body, {"test": data}))
    for t in tasks.multiple_choice:
        specs.append(_mc_task(t, out, endpoint))
    return specs


def _mc_task(t: MultipleChoiceTask, out: Path, endpoint: str | None) -> TaskSpec:
    rows = mc_rows(t.uri, t.layout, endpoint)
    shots = mc_rows(t.fewshot_uri, t.layout, endpoint) if t.fewshot_uri else []
    test = rows[: t.max_examples]
    if not shots:  # the rows after the scored ones, else the scored ones themselves (first_n skips the doc)
        shots = rows[len(test) :] or rows
    if t.num_fewshot > len(shots):
        raise InputError(
            f"num_fewshot {t.num_fewshot} but only {len(shots)} rows to take shots from", path=t.fewshot_uri or t.uri
        )
    name = f"{PREFIX}mc_{t.name}".replace("-", "_").replace(".", "_")
    data = {
        "test": write_jsonl(out / "data" / f"mc_{t.name}.test.jsonl", test),
        "fewshot": write_jsonl(out / "data" / f"mc_{t.name}.fewshot.jsonl", shots),
    }
    sizes = [4 if t.layout == "belebele" else len(r["choices"]) for r in test]
    chance = sum(1 / s for s in sizes) / len(sizes)
    spec = TaskSpec(
        key=f"multiple_choice/{t.name}",
        task=name,
        kind="multiple_choice",
        language=t.language,
        row=f"{t.name} ({t.layout} layout, {t.num_fewshot}-shot)",
        metrics=["acc", "acc_norm"],
        headline_metrics=["acc"],
        num_examples=len(test),
        num_fewshot=t.num_fewshot,
        source=t.uri,
        chance={"acc": chance, "acc_norm": chance},
        chance_note="uniform over the options",
    )
    body: dict = {"include": f"_{t.layout}.yaml", "num_fewshot": t.num_fewshot}
    if t.layout == "tumlu":
        body["doc_to_text"] = Fn(f"utils.tumlu_text_{'az' if t.language == 'az' else 'en'}")
    return _task_file(out, spec, body, data)


def seeds(seed: int) -> dict[str, int]:
    """simple_evaluate's seeds for the stage seed (lm-eval's defaults 0/1234/1234/1234 at seed 0)."""
    names = ("numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    return {"random_seed": seed, **dict.fromkeys(names, 1234 + seed)}


def write_commands(
    out: Path, specs: list[TaskSpec], tasks: DownstreamTasks, dtype: str, device: str, seed: int
) -> list[str]:
    """commands.txt in the task folder: the `lm_eval` lines (run inside it) that reproduce the stage's figures."""
    base = (
        f"lm_eval run --model hf --model_args pretrained=MODEL_DIR,dtype={dtype},max_length={tasks.max_length} "
        f"--include_path . --batch_size {tasks.batch_size} --device {device} "
        f"--seed {','.join(str(v) for v in seeds(seed).values())}"
    )
    plain = [s.task for s in specs if not s.chat]
    chat = [s.task for s in specs if s.chat]
    commands = [f"{base} --tasks {','.join(plain)}"] if plain else []
    if chat:
        system = tasks.system_prompt
        sys_arg = f" --system_instruction {json.dumps(system, ensure_ascii=False)}" if system else ""
        commands.append(f"{base} --tasks {','.join(chat)} --apply_chat_template{sys_arg}")
    lines = [
        "# Run inside this folder; MODEL_DIR is an HF model folder (for an SFT adapter add peft=ADAPTER_DIR to",
        "# --model_args). Same numbers as the eval stage's metrics.json `downstream` section.",
        *commands,
    ]
    (out / "commands.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return commands


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
        if (value := res.get(f"{m},none")) is not None:
            se = res.get(f"{m}_stderr,none")
            out[m] = score(value, se if isinstance(se, int | float) else None, 100.0 if m in SCALE_100 else 1.0)
    return out
