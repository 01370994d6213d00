"""Downstream tasks through lm-evaluation-harness: SIB-200 topics, translation az<->en, instruction answering
with the chat template, and Belebele/TUMLU-layout multiple choice (docs/eval.md).

Story: read each task's rows from the files (or S3 objects) the eval config names, check them (a missing
column, an unknown label or an empty file is a one-line error naming the file and the field) → write a
self-contained lm-eval task folder: the shipped templates (`tasks/_*.yaml`, `tasks/utils.py`), one small
YAML per task that includes a template and names its data, and the rows as JSONL under `data/` → per
model, run the tasks with `lm_eval.simple_evaluate` on an `HFLM` wrapping the model already loaded (the
chat tasks in a second call with the chat template) → value, standard error, 95 % interval and chance
level per metric. The folder is published with the eval artifact, so
`cd lm_eval_tasks && lm_eval run --include_path . --tasks ...` reproduces every figure (`commands.txt`).

The harness never touches a hub here: `dataset_path: json` reads the local JSONL, and HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE are set before it is imported.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from dilforge_shared.configs.eval import SIB_LABELS, DownstreamTasks, MultipleChoiceTask
from dilforge_shared.corpus import iter_located_texts, iter_records
from dilforge_shared.errors import InputError

log = logging.getLogger("dilforge.eval")

TASK_DIR = "lm_eval_tasks"
PREFIX = "dilforge_"
LANGUAGE_NAMES = {"az": "Azerbaijani", "en": "English"}
Z95 = 1.959964
SCALE_100 = ("chrf++", "chrf", "bleu")


@dataclass
class TaskSpec:
    """One lm-eval task the stage wrote: what it measures, in which language, and its chance level."""

    key: str  # report key, e.g. "sib200/az/5-shot"
    task: str  # lm-eval task name
    kind: str  # sib200 | translation | instruction | multiple_choice
    language: str  # language of what is scored (target language for translation)
    row: str  # headline row; the language is the column
    metrics: list[str]
    headline_metrics: list[str]
    num_examples: int
    num_fewshot: int = 0
    chat: bool = False
    chance: dict[str, float] = field(default_factory=dict)  # metric -> chance / trivial-baseline value
    chance_note: str = ""
    source: str = ""


# ------------------------------------------------------------------------------------------- reading rows


def read_rows(uri: str, endpoint_url: str | None = None) -> list[tuple[int, dict]]:
    """(line, record) of a JSONL, TSV or CSV file (header row names the columns)."""
    name = uri.lower()
    if name.endswith((".jsonl", ".json")):
        return list(iter_records(uri, endpoint_url))
    if not name.endswith((".tsv", ".csv")):
        raise InputError("task file must be .jsonl, .tsv or .csv", path=uri)
    delimiter = "\t" if name.endswith(".tsv") else ","
    rows, header = [], None
    for _, lineno, line in iter_located_texts(uri, "txt", endpoint_url=endpoint_url, skip_empty=False):
        if not line.strip():
            continue
        quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
        cells = next(csv.reader(io.StringIO(line), delimiter=delimiter, quoting=quoting))
        if header is None:
            header = cells
            continue
        if len(cells) != len(header):
            raise InputError(f"{len(cells)} columns, the header has {len(header)}", path=uri, line=lineno)
        rows.append((lineno, dict(zip(header, cells, strict=False))))
    return rows


def need(rec: dict, key: str, uri: str, lineno: int, kind: type = str) -> Any:
    """A field of a row, of the right type and not empty; else a one-line error naming file, line and field."""
    if key not in rec:
        raise InputError(f"field {key!r} missing (fields: {sorted(rec)})", path=uri, line=lineno)
    value = rec[key]
    if not isinstance(value, kind) or (isinstance(value, str | list) and not value):
        raise InputError(f"field {key!r} empty or not a {kind.__name__}", path=uri, line=lineno)
    return value


def _nonempty(rows: list, uri: str, what: str) -> list:
    if not rows:
        raise InputError(f"task file holds no {what}", path=uri)
    return rows


def sib_rows(cfg, endpoint: str | None) -> dict[str, dict[str, list[dict]]]:
    """language -> split -> [{text, label, topic}] from the SIB-200 file."""
    rows = _nonempty(read_rows(cfg.uri, endpoint), cfg.uri, "rows")
    out: dict[str, dict[str, list[dict]]] = {lang: {"train": [], "test": []} for lang in cfg.languages}
    for lineno, rec in rows:
        split = need(rec, cfg.split_field, cfg.uri, lineno)
        topic = need(rec, cfg.label_field, cfg.uri, lineno)
        if topic not in SIB_LABELS:
            raise InputError(
                f"field {cfg.label_field!r}: unknown label {topic!r} (SIB-200 labels: {', '.join(SIB_LABELS)})",
                path=cfg.uri,
                line=lineno,
            )
        for lang, column in cfg.languages.items():
            text = need(rec, column, cfg.uri, lineno)
            if split in ("train", "test"):
                out[lang][split].append({"text": text, "label": SIB_LABELS.index(topic), "topic": topic})
    for splits in out.values():
        if not splits["test"]:
            raise InputError(f"field {cfg.split_field!r}: no row of split 'test' to score", path=cfg.uri)
        if max(cfg.num_fewshot) > len(splits["train"]):
            raise InputError(
                f"field {cfg.split_field!r}: {len(splits['train'])} 'train' rows, fewer than "
                f"num_fewshot {max(cfg.num_fewshot)}",
                path=cfg.uri,
            )
        splits["test"] = splits["test"][: cfg.max_examples]
    return out


def instruction_rows(cfg, endpoint: str | None) -> list[dict]:
    rows = _nonempty(read_rows(cfg.uri, endpoint), cfg.uri, "rows")[: cfg.max_examples]
    return [
        {
            "instruction": need(rec, cfg.instruction_field, cfg.uri, n),
            "response": need(rec, cfg.response_field, cfg.uri, n),
        }
        for n, rec in rows
    ]


def mc_rows(uri: str, layout: str, endpoint: str | None) -> list[dict]:
    """Rows of a Belebele- or TUMLU-layout file, checked; TUMLU `choices` may be a JSON list in a TSV cell."""
    out = []
    for n, rec in _nonempty(read_rows(uri, endpoint), uri, "rows"):
        if layout == "belebele":
            row = {
                k: need(rec, k, uri, n)
                for k in ("flores_passage", "question", "mc_answer1", "mc_answer2", "mc_answer3", "mc_answer4")
            }
            answer = str(need(rec, "correct_answer_num", uri, n, (str, int))).strip()
            if answer not in ("1", "2", "3", "4"):
                raise InputError(f"field 'correct_answer_num': unknown label {answer!r} (1-4)", path=uri, line=n)
            row["correct_answer_num"] = answer
        else:
            choices = rec.get("choices")
            if isinstance(choices, str):
                try:
                    choices = json.loads(choices)
                except ValueError:
                    raise InputError("field 'choices': not a JSON list", path=uri, line=n) from None
            if (
                not isinstance(choices, list)
                or not 2 <= len(choices) <= 5
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise InputError("field 'choices' missing or not a list of 2-5 strings", path=uri, line=n)
            answer = need(rec, "answer", uri, n).strip()
            letters = "ABCDE"[: len(choices)]
            if answer not in letters:
                raise InputError(
                    f"field 'answer': unknown label {answer!r} (one of {', '.join(letters)})", path=uri, line=n
                )
            row = {"question": need(rec, "question", uri, n), "choices": choices, "answer": answer}
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------- task folder


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


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return str(path.relative_to(path.parent.parent))


def write_commands(
    out: Path, specs: list[TaskSpec], tasks: DownstreamTasks, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> list[str]:
    """commands.txt in the task folder: the lm_eval lines that reproduce the stage's figures."""
    system = tasks.instructions.system_prompt if tasks.instructions else None
    commands = lm_eval_commands(specs, tasks, system, dtype, device, seed)
    lines = [
        "# Run inside this folder; MODEL_DIR is an HF model folder (for an SFT adapter add peft=ADAPTER_DIR to",
        "# --model_args). Same numbers as the eval stage's metrics.json `downstream` section.",
        *commands,
    ]
    (out / "commands.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return commands


def _copy_templates(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for entry in files("dilforge_eval.tasks").iterdir():
        if entry.name.endswith((".yaml", ".py")) and entry.name != "__init__.py":
            shutil.copyfile(str(entry), out / entry.name)


def _copy_scores(pairs: list[tuple[str, str]]) -> dict[str, float]:
    """chrF++ / chrF / BLEU of answering with the source itself: the floor a model must beat."""
    import sacrebleu

    hyp, ref = [p[0] for p in pairs], [[p[1] for p in pairs]]
    return {
        "chrf++": sacrebleu.corpus_chrf(hyp, ref, word_order=2).score,
        "chrf": sacrebleu.corpus_chrf(hyp, ref).score,
        "bleu": sacrebleu.corpus_bleu(hyp, ref).score,
    }


def prepare(tasks: DownstreamTasks, out: Path, endpoint: str | None, read_parallel) -> list[TaskSpec]:
    """Read and check every task's rows, write the lm-eval task folder `out`; the specs of the tasks in it."""
    _copy_templates(out)
    specs: list[TaskSpec] = []

    def task_file(spec: TaskSpec, body: dict) -> None:
        (out / f"{spec.task}.yaml").write_text(_yaml({"task": spec.task, **body}), encoding="utf-8")
        specs.append(spec)

    if tasks.sib200:
        cfg = tasks.sib200
        for lang, splits in sib_rows(cfg, endpoint).items():
            files_ = {
                split: _write_jsonl(out / "data" / f"sib200_{lang}.{split}.jsonl", rows)
                for split, rows in splits.items()
            }
            counts = [sum(r["label"] == i for r in splits["test"]) for i in range(len(SIB_LABELS))]
            for k in cfg.num_fewshot:
                spec = TaskSpec(
                    key=f"sib200/{lang}/{k}-shot",
                    task=f"{PREFIX}sib200_{lang}_{k}shot",
                    kind="sib200",
                    language=lang,
                    row=f"SIB-200 topics, {k}-shot",
                    metrics=["acc", "acc_norm"],
                    headline_metrics=["acc"],
                    num_examples=len(splits["test"]),
                    num_fewshot=k,
                    source=cfg.uri,
                    chance={
                        "acc": 1 / len(SIB_LABELS),
                        "acc_norm": 1 / len(SIB_LABELS),
                        "majority": max(counts) / len(splits["test"]),
                    },
                    chance_note=f"uniform 1/{len(SIB_LABELS)}; majority class share",
                )
                task_file(spec, {"include": "_sib200.yaml", "num_fewshot": k, "dataset_kwargs": {"data_files": files_}})
    for t in tasks.translation:
        pairs = read_parallel(t, t.max_examples, None, endpoint)
        for direction in t.directions:
            src, tgt = direction.split("-")
            rows = [
                {"source": p[0], "target": p[1]} if src == "az" else {"source": p[1], "target": p[0]} for p in pairs
            ]
            name = f"{PREFIX}translation_{t.name}_{src}_{tgt}".replace("-", "_").replace(".", "_")
            data = _write_jsonl(out / "data" / f"translation_{t.name}.{direction}.jsonl", rows)
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
            task_file(
                spec,
                {
                    "include": "_translation.yaml",
                    "doc_to_text": f"{LANGUAGE_NAMES[src]}: {{{{source}}}}\n{LANGUAGE_NAMES[tgt]}:",
                    "generation_kwargs": {
                        "until": ["\n"],
                        "do_sample": False,
                        "max_gen_toks": tasks.translation_max_new_tokens,
                    },
                    "dataset_kwargs": {"data_files": {"test": data}},
                },
            )
    if tasks.instructions:
        cfg = tasks.instructions
        rows = instruction_rows(cfg, endpoint)
        data = _write_jsonl(out / "data" / f"instruction_{cfg.name}.jsonl", rows)
        import sacrebleu

        copy = sacrebleu.corpus_chrf(
            [r["instruction"] for r in rows], [[r["response"] for r in rows]], word_order=2
        ).score
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
            chance={"chrf++": copy},
            chance_note="chrF++: repeating the instruction",
        )
        gen = {
            "until": ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>"],
            "do_sample": False,
            "max_gen_toks": tasks.instruction_max_new_tokens,
        }
        task_file(
            spec,
            {
                "include": "_instruction.yaml",
                "process_results": Fn(f"utils.process_instruction_{cfg.language}"),
                "generation_kwargs": gen,
                "dataset_kwargs": {"data_files": {"test": data}},
            },
        )
    for t in tasks.multiple_choice:
        specs.append(_mc_task(t, out, endpoint))
    write_commands(out, specs, tasks)
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
        "test": _write_jsonl(out / "data" / f"mc_{t.name}.test.jsonl", test),
        "fewshot": _write_jsonl(out / "data" / f"mc_{t.name}.fewshot.jsonl", shots),
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
    body: dict = {"include": f"_{t.layout}.yaml", "num_fewshot": t.num_fewshot, "dataset_kwargs": {"data_files": data}}
    if t.layout == "tumlu":
        body["doc_to_text"] = Fn(f"utils.tumlu_text_{'az' if t.language == 'az' else 'en'}")
    (out / f"{name}.yaml").write_text(_yaml({"task": name, **body}), encoding="utf-8")
    return spec


# -------------------------------------------------------------------------------------------- running


def _offline_env(cache: Path) -> None:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_DATASETS_CACHE", str(cache / "hf-datasets"))
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap pool: one process per core otherwise
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def seeds(seed: int) -> dict[str, int]:
    """simple_evaluate's seeds for the stage seed (lm-eval's defaults 0/1234/1234/1234 at seed 0)."""
    return {
        "random_seed": seed,
        "numpy_random_seed": 1234 + seed,
        "torch_random_seed": 1234 + seed,
        "fewshot_random_seed": 1234 + seed,
    }


def lm_eval_commands(
    specs: list[TaskSpec],
    tasks: DownstreamTasks,
    system_prompt: str | None,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
) -> list[str]:
    """The `lm_eval` command lines (run inside the task folder) that reproduce the stage's figures."""
    base = (
        f"lm_eval run --model hf --model_args pretrained=MODEL_DIR,dtype={dtype},max_length={tasks.max_length} "
        f"--include_path . --batch_size {tasks.batch_size} --device {device} "
        f"--seed {','.join(str(v) for v in seeds(seed).values())}"
    )
    plain = [s.task for s in specs if not s.chat]
    chat = [s.task for s in specs if s.chat]
    cmds = []
    if plain:
        cmds.append(f"{base} --tasks {','.join(plain)}")
    if chat:
        sys_arg = f" --system_instruction {json.dumps(system_prompt, ensure_ascii=False)}" if system_prompt else ""
        cmds.append(f"{base} --tasks {','.join(chat)} --apply_chat_template{sys_arg}")
    return cmds


def _ensure_chat_template(tokenizer, source: str) -> None:
    """A tokenizer without a chat template gets its family's (as the generations do)."""
    if getattr(tokenizer, "chat_template", None):
        return
    from .generate import model_family

    family = model_family(tokenizer, source)
    if family is not None:
        tokenizer.chat_template = family.chat_template


def run_model(
    model,
    tokenizer,
    specs: list[TaskSpec],
    task_dir: Path,
    tasks: DownstreamTasks,
    cache: Path,
    seed: int,
    source: str,
    system_prompt: str | None = None,
) -> tuple[dict, list[dict]]:
    """Every task on one loaded model: {task key: {metric: {value, stderr, ci95}, ...}} and the per-example
    records (prompt, answer, reference) of the generative tasks."""
    _offline_env(cache)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=tasks.batch_size, max_length=tasks.max_length)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    results: dict = {}
    samples: list[dict] = []
    with contextlib.chdir(task_dir):  # data_files are relative to the task folder, as in the lm_eval command
        for chat in (False, True):
            group = [s for s in specs if s.chat == chat]
            if not group:
                continue
            if chat:
                _ensure_chat_template(tokenizer, source)
            out = simple_evaluate(
                model=lm,
                tasks=[s.task for s in group],
                task_manager=manager,
                bootstrap_iters=tasks.bootstrap_iters,
                apply_chat_template=chat,
                system_instruction=system_prompt if chat else None,
                log_samples=True,
                **seeds(seed),
            )
            for s in group:
                results[s.key] = summarize(out["results"][s.task], s)
                if s.kind == "instruction":
                    answers = [row["filtered_resps"][0] for row in out["samples"][s.task]]
                    results[s.key]["ended_turn"] = ended_turn(answers, tokenizer, tasks.instruction_max_new_tokens)
                if s.kind in ("translation", "instruction"):
                    for row in out["samples"][s.task]:
                        samples.append(
                            {
                                "task": s.key,
                                "doc_id": row["doc_id"],
                                "target": row["target"],
                                "answer": row["filtered_resps"][0],
                            }
                        )
    return results, samples


def share(flags: list[bool]) -> dict:
    """A share with lm-eval's binomial standard error (sample std / sqrt(n)) and its 95 % interval."""
    import math

    n = len(flags)
    p = sum(flags) / n if n else 0.0
    se = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None
    return {
        "value": round(p, 6),
        "stderr": None if se is None else round(se, 6),
        "ci95": None if se is None else [round(max(0.0, p - Z95 * se), 6), round(min(1.0, p + Z95 * se), 6)],
    }


def ended_turn(answers: list[str], tokenizer, max_new_tokens: int) -> dict:
    """Share of answers that stopped at the end of the turn, i.e. before the token limit (the stage counts the
    answer's tokens; lm-eval strips the stop token, so this one figure is the stage's, not the harness's)."""
    lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers]
    return share([n < max_new_tokens for n in lengths])


def metrics_header(
    specs: list[TaskSpec], tasks: DownstreamTasks, task_dir: Path, dtype: str, device: str, seed: int
) -> dict:
    """The manifest's `downstream` section before any model ran: what each task is, how to reproduce it
    (the commands are also written to the task folder's commands.txt)."""
    from importlib.metadata import version

    commands = write_commands(task_dir, specs, tasks, dtype, device, seed)
    return {
        "harness": {
            "name": "lm-evaluation-harness",
            "version": version("lm-eval"),
            "bootstrap_iters": tasks.bootstrap_iters,
            "batch_size": tasks.batch_size,
        },
        "task_dir": task_dir.name,
        "commands": commands,
        "tasks": {s.key: {k: v for k, v in asdict(s).items() if k != "key"} for s in specs},
        "results": {},
        "seconds": {},
    }


def changes(section: dict, reference: str | None) -> dict:
    """model -> task -> metric -> value minus the reference model's (positive = higher; whether that is
    better is the metric's `higher_is_better`, see HIGHER_IS_BETTER)."""
    results = section["results"]
    if reference is None or reference not in results:
        return {}
    out: dict = {}
    for model, tasks in results.items():
        if model == reference:
            continue
        for key, res in tasks.items():
            for m, v in res.items():
                ref = results[reference].get(key, {}).get(m)
                if ref is not None:
                    out.setdefault(model, {}).setdefault(key, {})[m] = round(v["value"] - ref["value"], 6)
    return out


HIGHER_IS_BETTER = {
    "acc": True,
    "acc_norm": True,
    "chrf++": True,
    "chrf": True,
    "bleu": True,
    "answer_in_language": True,
    "repetition_rate": False,
    "empty_answer": False,
    "ended_turn": True,
}
STAGE_ONLY = ("ended_turn",)  # computed by the stage from lm-eval's answers; the lm_eval command omits it


def summarize(res: dict, spec: TaskSpec) -> dict:
    """lm-eval's `metric,none` / `metric_stderr,none` into value, stderr and the normal 95 % interval
    (value ± 1.96 stderr, clipped to the metric's range: 0-1 for shares, 0-100 for chrF/BLEU)."""
    out: dict[str, Any] = {}
    for m in spec.metrics:
        value = res.get(f"{m},none")
        if value is None:
            continue
        se = res.get(f"{m}_stderr,none")
        se = se if isinstance(se, int | float) else None
        top = 100.0 if m in SCALE_100 else 1.0
        out[m] = {
            "value": round(float(value), 6),
            "stderr": None if se is None else round(float(se), 6),
            "ci95": None
            if se is None
            else [round(max(0.0, value - Z95 * se), 6), round(min(top, value + Z95 * se), 6)],
        }
    return out


def spec_table(specs: list[TaskSpec]) -> list[dict]:
    return [asdict(s) for s in specs]
