"""Every downstream task on tiny models end to end through the eval stage (coordinator `run eval`), and the
documented `lm_eval` command on the published task folder giving the same numbers as the stage."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import factories
import pytest
from dilforge_shared.store import fetch, read_manifest


def _env(tmp: Path) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp / "work"),
        "DILFORGE_CACHE": str(tmp / "cache"),
        "HF_DATASETS_CACHE": str(tmp / "hf-datasets"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "DISABLE_MULTIPROC": "1",
    }


def _tasks(data: Path, tmp: Path) -> dict:
    flores = str(data / "az/dev/flores200.dev.partial_from_sib200.tsv")
    belebele = tmp / "belebele.jsonl"
    belebele.write_text(
        "".join(
            json.dumps(
                {
                    "flores_passage": "Bakı Azərbaycanın paytaxtıdır və Xəzər dənizinin sahilindədir.",
                    "question": f"Sual {i}?",
                    "mc_answer1": "Xəzər",
                    "mc_answer2": "Dağ",
                    "mc_answer3": "Səhra",
                    "mc_answer4": "Ada",
                    "correct_answer_num": str(1 + i % 4),
                },
                ensure_ascii=False,
            )
            + "\n"
            for i in range(5)
        )
    )
    tumlu = tmp / "tumlu.tsv"
    tumlu.write_text(
        "question\tchoices\tanswer\n"
        + "".join(f"{i} + 1 neçədir?\t{json.dumps([str(i + 1), str(i), '0'])}\t{'ABC'[i % 3]}\n" for i in range(5))
    )
    return {
        "sib200": {"uri": flores, "num_fewshot": [0, 2], "max_examples": 4},
        "translation": [
            {
                "name": "flores-dev",
                "az": {"uri": flores, "text_field": "azj_Latn"},
                "en": {"uri": flores, "text_field": "eng_Latn"},
                "max_examples": 2,
            },
            {
                "name": "xwmt",
                "az": {"uri": str(data / "az/dev/xwmt_test.az-en.az.txt")},
                "en": {"uri": str(data / "az/dev/xwmt_test.az-en.en.txt")},
                "max_examples": 2,
            },
        ],
        "instructions": {"uri": str(data / "az/sft/khazar08_native_eval.jsonl"), "max_examples": 2},
        "multiple_choice": [
            {
                "name": "belebele-az",
                "uri": str(belebele),
                "layout": "belebele",
                "language": "az",
                "num_fewshot": 1,
                "max_examples": 3,
            },
            {"name": "tumlu-az", "uri": str(tumlu), "layout": "tumlu", "language": "az", "max_examples": 3},
        ],
        "translation_max_new_tokens": 6,
        "instruction_max_new_tokens": 6,
        "batch_size": 4,
        "max_length": 512,
    }


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory, data_root, tiny_tokenizer_dir, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("eval-tasks")
    other = factories.build_tiny_llama(tmp / "other", tiny_tokenizer_dir, seed=3)
    section = {
        "models": [{"label": "base", "uri": str(tiny_llama_dir)}, {"label": "other", "uri": str(other)}],
        "tasks": _tasks(data_root, tmp),
    }
    cfg = tmp / "pipe.json"
    cfg.write_text(json.dumps({"run_id": "tasks", "store": {"uri": str(tmp / "store")}, "eval": section}))
    proc = subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", "run", "eval", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=_env(tmp),
        timeout=600,
        cwd=tmp,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = proc.stdout.strip().splitlines()[-1].split("artifact: ")[1]
    manifest, _ = read_manifest(uri)
    return {
        "tmp": tmp,
        "manifest": manifest,
        "path": fetch(uri).path,
        "model": tiny_llama_dir,
        "cfg": cfg,
        "section": section,
    }


def test_every_task_scored_for_every_model_with_intervals_and_chance(stage_run):
    m = stage_run["manifest"].metrics["downstream"]
    keys = {
        "sib200/az/0-shot",
        "sib200/az/2-shot",
        "sib200/en/0-shot",
        "sib200/en/2-shot",
        "translation/flores-dev/az-en",
        "translation/flores-dev/en-az",
        "translation/xwmt/az-en",
        "translation/xwmt/en-az",
        "instruction/khazar",
        "multiple_choice/belebele-az",
        "multiple_choice/tumlu-az",
    }
    assert set(m["tasks"]) == keys and set(m["results"]) == {"base", "other"}
    for model in ("base", "other"):
        assert set(m["results"][model]) == keys
        for key, res in m["results"][model].items():
            assert set(res) == set(m["tasks"][key]["metrics"]) | ({"ended_turn"} if "instruction" in key else set())
            for metric, v in res.items():
                top = 100 if metric in ("chrf++", "chrf", "bleu") else 1
                assert 0 <= v["value"] <= top and v["stderr"] is not None, (key, metric)
                assert v["ci95"][0] <= v["value"] <= v["ci95"][1]
    t = m["tasks"]
    assert t["sib200/az/2-shot"]["num_fewshot"] == 2 and t["sib200/az/0-shot"]["num_examples"] == 4
    assert t["sib200/en/0-shot"]["chance"]["acc"] == pytest.approx(1 / 7)
    assert t["multiple_choice/belebele-az"]["chance"]["acc"] == 0.25
    assert t["multiple_choice/tumlu-az"]["chance"]["acc"] == pytest.approx(1 / 3)
    assert t["translation/xwmt/en-az"]["language"] == "az" and t["instruction/khazar"]["chat"] is True
    assert t["translation/flores-dev/az-en"]["chance"]["chrf++"] > 0  # copy-the-source floor
    for key, res in m["results"]["other"].items():  # change = other - base, per metric
        for metric, v in res.items():
            assert m["changes"]["other"][key][metric] == pytest.approx(
                v["value"] - m["results"]["base"][key][metric]["value"], abs=1e-5
            )
    files = {f.path for f in stage_run["manifest"].files}
    assert {
        "lm_eval_tasks/commands.txt",
        "lm_eval_tasks/utils.py",
        "lm_eval_tasks/_sib200.yaml",
        "lm_eval_tasks/data/sib200_az.test.jsonl",
        "task_answers.jsonl",
    } <= files
    answers = [json.loads(x) for x in (stage_run["path"] / "task_answers.jsonl").read_text().splitlines()]
    assert {a["model"] for a in answers} == {"base", "other"} and len(answers) == 2 * (4 * 2 + 2)
    html = (stage_run["path"] / "report.html").read_text()
    assert "Headline: downstream tasks" in html and "SIB-200 topics, 2-shot" in html
    assert html.index("Headline: downstream tasks") < html.index("Downstream tasks: all figures")
    assert re.search(r">\s*other az\s*<", html) and re.search(r">\s*other en\s*<", html)  # tabulate pads cells
    assert stage_run["manifest"].metrics["cost"]["eval"]["seconds_tasks"] > 0


def test_lm_eval_command_on_the_published_tasks_gives_the_stage_numbers(stage_run):
    """The command in commands.txt, run by hand with the stock `lm_eval` CLI on the base model's folder."""
    m = stage_run["manifest"].metrics["downstream"]
    work = stage_run["tmp"] / "by-hand"
    shutil.copytree(stage_run["path"] / "lm_eval_tasks", work)
    lm_eval = Path(sys.executable).with_name("lm_eval")
    got: dict = {}
    for i, command in enumerate(m["commands"]):
        assert command.startswith("lm_eval run ") and "--include_path ." in command
        args = command.replace("MODEL_DIR", str(stage_run["model"])).split()[1:]
        proc = subprocess.run(
            [str(lm_eval), *args, "--output_path", str(work / f"out{i}")],
            cwd=work,
            capture_output=True,
            text=True,
            env=_env(stage_run["tmp"]),
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        (results,) = (work / f"out{i}").rglob("results_*.json")
        got.update(json.loads(results.read_text())["results"])
    for key, spec in m["tasks"].items():
        for metric, v in m["results"]["base"][key].items():
            if metric == "ended_turn":  # the stage's own count of answers that stopped before the limit
                continue
            assert got[spec["task"]][f"{metric},none"] == pytest.approx(v["value"], abs=1e-6), (key, metric)
            assert got[spec["task"]][f"{metric}_stderr,none"] == pytest.approx(v["stderr"], abs=1e-6), (key, metric)


def test_a_bad_task_file_fails_the_stage_in_one_line_and_publishes_nothing(stage_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": "Z"}) + "\n")
    section = {
        "models": stage_run["section"]["models"][:1],
        "tasks": {"multiple_choice": [{"name": "bad", "uri": str(bad), "layout": "tumlu", "language": "az"}]},
    }
    cfg = tmp_path / "pipe.json"
    cfg.write_text(json.dumps({"run_id": "bad", "store": {"uri": str(tmp_path / "store")}, "eval": section}))
    proc = subprocess.run(
        [sys.executable, "-m", "dilforge_coordinator.cli", "run", "eval", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert f"{bad}:1: field 'answer': unknown label 'Z' (one of A, B)" in proc.stderr
    assert not list((tmp_path / "store").rglob("manifest.json"))
