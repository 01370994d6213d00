"""Downstream tasks: the shipped lm-eval task configs scored by the harness against hand-computed values, the
letter-statistics language ID on FLORES/X-WMT, and bad task files failing in one line naming file and field."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import metrics_samples
import pytest
from dilforge_eval import downstream
from dilforge_eval.config import SIB_LABELS, DownstreamTasks
from dilforge_eval.tasks import utils
from dilforge_eval.texts import read_parallel
from dilforge_shared.errors import InputError
from pydantic import ValidationError


class FakeLM:
    """An lm-eval LM that prefers one continuation and answers from a lookup table."""

    def __new__(cls, *args, **kwargs):
        from lm_eval.api.model import LM

        class _LM(LM):
            def __init__(self, preferred: str, answers: dict[str, str], default: str = ""):
                super().__init__()
                self.preferred, self.answers, self.default = preferred, answers, default

            def loglikelihood(self, requests):
                return [
                    (0.0 if cont.strip() == self.preferred else -5.0 - len(cont), False)
                    for cont in (r.args[1] for r in requests)
                ]

            def loglikelihood_rolling(self, requests):
                return [0.0 for _ in requests]

            def generate_until(self, requests):
                out = []
                for r in requests:
                    context = r.args[0]
                    out.append(next((a for k, a in self.answers.items() if k in context), self.default))
                return out

            def apply_chat_template(self, chat_history, add_generation_prompt=True):
                return "\n".join(m["content"] for m in chat_history)

            @property
            def tokenizer_name(self):
                return "fake"

        return _LM(*args, **kwargs)


def _run(lm, specs, task_dir, chat=False):
    downstream._offline_env(task_dir.parent / "cache")
    import contextlib

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    group = [s for s in specs if s.chat == chat]
    with contextlib.chdir(task_dir):
        out = simple_evaluate(
            model=lm,
            tasks=[s.task for s in group],
            bootstrap_iters=0,
            apply_chat_template=chat,
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        )
    return {s.key: downstream.summarize(out["results"][s.task], s) for s in group}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, data_root):
    tmp = tmp_path_factory.mktemp("tasks")
    flores = str(data_root / "az/dev/flores200.dev.partial_from_sib200.tsv")
    mc = tmp / "tumlu.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": f"{i} + 1 neçədir?", "choices": [str(i + 1), str(i), "0"], "answer": "ABC"[i % 3]})
            + "\n"
            for i in range(7)
        )
    )
    cfg = DownstreamTasks.model_validate(
        {
            "sib200": {"uri": flores, "num_fewshot": [0], "max_examples": 30},
            "translation": [
                {
                    "name": "flores",
                    "az": {"uri": flores, "text_field": "azj_Latn"},
                    "en": {"uri": flores, "text_field": "eng_Latn"},
                    "directions": ["az-en"],
                    "max_examples": 5,
                }
            ],
            "instructions": {"uri": str(data_root / "az/sft/khazar08_native_eval.jsonl"), "max_examples": 4},
            "multiple_choice": [{"name": "tumlu-az", "uri": str(mc), "layout": "tumlu", "language": "az"}],
        }
    )
    specs = downstream.prepare(cfg, tmp / "lm_eval_tasks", None)
    return cfg, specs, tmp / "lm_eval_tasks"


def test_a_model_preferring_one_label_scores_that_labels_share(prepared):
    _, specs, task_dir = prepared
    test_rows = [json.loads(x) for x in (task_dir / "data/sib200_az.test.jsonl").read_text().splitlines()]
    topic, count = Counter(r["topic"] for r in test_rows).most_common(1)[0]
    share = count / len(test_rows)
    assert len(test_rows) == 30 and 0 < share < 1
    sib = [s for s in specs if s.kind == "sib200"]
    got = _run(FakeLM(topic, {}), sib, task_dir)
    assert got["sib200/az/0-shot"]["acc"].value == pytest.approx(share, abs=1e-6)
    assert got["sib200/en/0-shot"]["acc"].value == pytest.approx(share, abs=1e-6)
    assert got["sib200/az/0-shot"]["acc"].stderr is None  # bootstrap_iters=0: none asked for
    spec = next(s for s in sib if s.key == "sib200/az/0-shot")
    assert spec.chance["acc"] == pytest.approx(1 / 7)
    assert spec.chance["majority"] == pytest.approx(max(Counter(r["topic"] for r in test_rows).values()) / 30)
    tumlu = _run(FakeLM("A", {}), [s for s in specs if s.kind == "multiple_choice"], task_dir)
    assert tumlu["multiple_choice/tumlu-az"]["acc"].value == pytest.approx(3 / 7, abs=1e-6)  # answers A at i = 0, 3, 6


def test_translating_into_the_reference_scores_100_and_instruction_metrics(prepared):
    _, specs, task_dir = prepared
    rows = [json.loads(x) for x in (task_dir / "data/translation_flores.az-en.jsonl").read_text().splitlines()]
    perfect = FakeLM("", {r["source"]: r["target"] for r in rows})
    got = _run(perfect, [s for s in specs if s.kind == "translation"], task_dir)["translation/flores/az-en"]
    assert got["chrf++"].value == pytest.approx(100.0) and got["bleu"].value == pytest.approx(100.0)
    assert got["chrf"].value == pytest.approx(100.0)
    spec = next(s for s in specs if s.kind == "translation")
    assert 0 < spec.chance["chrf++"] < 40  # copying the Azerbaijani source into English scores low

    # answers: half the reference itself, half a looping English line
    inst = [json.loads(x) for x in (task_dir / "data/instruction_khazar.jsonl").read_text().splitlines()]
    answers = {r["instruction"]: r["response"] for r in inst[:2]}
    lm = FakeLM("", answers, default="the cat the cat the cat")
    got = _run(lm, [s for s in specs if s.chat], task_dir, chat=True)["instruction/khazar"]
    assert got["answer_in_language"].value == pytest.approx(0.5)
    # "the cat the cat the cat": 3-grams (the cat the) x2, (cat the cat) x2 -> 2 repeats of 4; references: 0
    ref_rates = [utils.repeated_ngram_rate(r["response"]) for r in inst[:2]]
    assert got["repetition_rate"].value == pytest.approx((sum(ref_rates) + 0.5 + 0.5) / 4)
    assert utils.repeated_ngram_rate("bir iki üç bir iki üç") == pytest.approx(0.25)
    assert got["empty_answer"].value == 0.0


def test_language_id_on_flores_and_xwmt(data_root):
    """The letter-statistics language ID on 2,220 aligned sentences (docs/eval.md quotes the result)."""
    flores = data_root / "az/dev/flores200.dev.partial_from_sib200.tsv"
    pairs = read_parallel(downstream_pairs(flores), None, None, None)
    xwmt = [
        (a, e)
        for a, e in zip(
            (data_root / "az/dev/xwmt_test.az-en.az.txt").read_text().splitlines(),
            (data_root / "az/dev/xwmt_test.az-en.en.txt").read_text().splitlines(),
            strict=False,
        )
    ]
    texts = [(a, "az") for a, _ in pairs + xwmt] + [(e, "en") for _, e in pairs + xwmt]
    wrong = [t for t, lang in texts if utils.detect_language(t) != lang]
    assert len(texts) == 2220 and len(wrong) <= 2, wrong
    assert utils.detect_language("Salam, necəsən? Bu gün hava çox gözəldir.") == "az"
    assert utils.detect_language("It was a cold day in Istanbul.") == "en"
    assert utils.detect_language("Привет, как дела?") == "other" and utils.detect_language("123 !!") == "other"


def downstream_pairs(flores: Path):
    from dilforge_eval.config import TranslationSet

    return TranslationSet(
        name="f", az={"uri": str(flores), "text_field": "azj_Latn"}, en={"uri": str(flores), "text_field": "eng_Latn"}
    )


BELEBELE_ROW = {
    "flores_passage": "p",
    "question": "q",
    **{f"mc_answer{i}": f"a{i}" for i in range(1, 5)},
    "correct_answer_num": "2",
}


def _sib(tmp: Path, body: str, **kw) -> DownstreamTasks:
    path = tmp / "sib.tsv"
    path.write_text(body)
    return DownstreamTasks.model_validate({"sib200": {"uri": str(path), "num_fewshot": [0], **kw}})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "flores_dev_line\tsib_split\tsib_category\tazj_Latn\n1\ttest\ttravel\tSalam\n",
            "sib.tsv:2: field 'eng_Latn' missing",
        ),
        (
            "sib_split\tsib_category\tazj_Latn\teng_Latn\ntest\tcooking\tSalam\tHello\n",
            "sib.tsv:2: field 'sib_category': unknown label 'cooking'",
        ),
        ("", "sib.tsv: task file holds no rows"),
        (
            "sib_split\tsib_category\tazj_Latn\teng_Latn\ntrain\ttravel\tSalam\tHello\n",
            "sib.tsv: field 'sib_split': no row of split 'test'",
        ),
    ],
)
def test_bad_sib_files_fail_in_one_line_naming_file_and_field(tmp_path, body, message):
    with pytest.raises(InputError) as exc:
        downstream.prepare(_sib(tmp_path, body), tmp_path / "out", None)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("layout", "row", "message"),
    [
        (
            "belebele",
            {
                "flores_passage": "p",
                "question": "q",
                "mc_answer1": "a",
                "mc_answer2": "b",
                "mc_answer3": "c",
                "mc_answer4": "d",
                "correct_answer_num": "5",
            },
            "mc.jsonl:1: field 'correct_answer_num': unknown label",
        ),
        ("belebele", {"flores_passage": "p", "question": "q"}, "mc.jsonl:1: field 'mc_answer1' missing"),
        *[
            (
                "belebele",
                {**BELEBELE_ROW, "correct_answer_num": bad},
                f"mc.jsonl:1: field 'correct_answer_num' is {shown}",
            )
            for bad, shown in (("", "''"), (1.0, "1.0"), (None, "None"), (True, "True"))
        ],
        (
            "tumlu",
            {"question": "q", "choices": ["a", "b"], "answer": "C"},
            "mc.jsonl:1: field 'answer': unknown label 'C'",
        ),
        ("tumlu", {"question": "q", "answer": "A"}, "mc.jsonl:1: field 'choices' missing"),
    ],
)
def test_bad_multiple_choice_files(tmp_path, layout, row, message):
    (tmp_path / "mc.jsonl").write_text(json.dumps(row) + "\n")
    cfg = DownstreamTasks.model_validate(
        {"multiple_choice": [{"name": "mc", "uri": str(tmp_path / "mc.jsonl"), "layout": layout, "language": "az"}]}
    )
    with pytest.raises(InputError) as exc:
        downstream.prepare(cfg, tmp_path / "out", None)
    assert message in str(exc.value)


def test_bom_tsv_and_multi_line_csv_cells_are_read_as_their_writers_meant(tmp_path):
    import csv

    from dilforge_eval.task_rows import mc_rows

    header = list(BELEBELE_ROW)
    (tmp_path / "mc.tsv").write_bytes(
        ("\ufeff" + "\t".join(header) + "\n" + "\t".join(str(v) for v in BELEBELE_ROW.values()) + "\n").encode()
    )
    assert mc_rows(str(tmp_path / "mc.tsv"), "belebele", None)[0]["flores_passage"] == "p"
    with (tmp_path / "mc.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerow(
            [{"flores_passage": "line one\nline two, with a comma"}.get(k, v) for k, v in BELEBELE_ROW.items()]
        )
        writer.writerow(BELEBELE_ROW.values())
    rows = mc_rows(str(tmp_path / "mc.csv"), "belebele", None)
    assert [r["flores_passage"] for r in rows] == ["line one\nline two, with a comma", "p"]
    # the second record starts on line 4 (its first cell spans lines 2-3): errors name that line
    text = (tmp_path / "mc.csv").read_text()
    (tmp_path / "bad.csv").write_text(text[: text.rindex(",2\n")] + ",9\n")
    with pytest.raises(InputError, match=r"bad\.csv:4: field 'correct_answer_num': unknown label '9'"):
        mc_rows(str(tmp_path / "bad.csv"), "belebele", None)
    lines = (tmp_path / "mc.csv").read_text().splitlines()
    (tmp_path / "open.csv").write_text("\n".join([lines[0], lines[3], '"never closed,q,a,b,c,d,1']) + "\n")
    with pytest.raises(InputError, match=r"open\.csv:3: not valid CSV: unexpected end of data"):
        mc_rows(str(tmp_path / "open.csv"), "belebele", None)


def test_instruction_file_missing_field_and_config_checks(tmp_path):
    (tmp_path / "inst.jsonl").write_text(json.dumps({"instruction": "Salam"}) + "\n")
    cfg = DownstreamTasks.model_validate({"instructions": {"uri": str(tmp_path / "inst.jsonl")}})
    with pytest.raises(InputError, match=r"inst.jsonl:1: field 'response' missing"):
        downstream.prepare(cfg, tmp_path / "out", None)
    with pytest.raises(ValidationError, match="duplicate names"):
        DownstreamTasks.model_validate(
            {
                "instructions": {"uri": "x.jsonl", "name": "a"},
                "multiple_choice": [{"name": "a", "uri": "m.jsonl", "layout": "tumlu", "language": "az"}],
            }
        )
    assert len(SIB_LABELS) == 7


def test_task_folder_is_self_contained_and_commands_name_every_task(prepared):
    cfg, specs, task_dir = prepared
    downstream.write_commands(task_dir, specs, cfg, "float32", "cpu", 0)
    names = {p.name for p in task_dir.iterdir()}
    assert {
        "_sib200.yaml",
        "_translation.yaml",
        "_instruction.yaml",
        "_belebele.yaml",
        "_tumlu.yaml",
        "utils.py",
        "commands.txt",
        "data",
    } <= names
    commands = (task_dir / "commands.txt").read_text()
    for s in specs:
        assert s.task in commands and (task_dir / f"{s.task}.yaml").is_file()
    assert "--apply_chat_template" in commands and "--system_instruction" not in commands
    # the instruction task's system turn is the one the stage passes to lm-eval and the chat command names
    system = cfg.instructions.model_copy(update={"system_prompt": 'Sən "köməkçisən".'})
    with_system = cfg.model_copy(update={"instructions": system})
    assert with_system.system_prompt == 'Sən "köməkçisən".'
    chat = downstream.write_commands(task_dir, specs, with_system, "float32", "cpu", 0)[-1]
    assert chat.endswith('--apply_chat_template --system_instruction "Sən \\"köməkçisən\\"."')
    # data paths are relative to the folder, so the published copy works wherever it is fetched to
    for s in specs:
        assert str(task_dir) not in (task_dir / f"{s.task}.yaml").read_text()


def test_task_files_read_from_s3_like_local_files(tmp_path, s3_server, s3_bucket, data_root):
    """Task files given as s3:// URIs (SageMaker inputs) give the same task folder as local files."""
    client = s3_server.client()
    bucket = s3_bucket.removeprefix("s3://")
    flores = data_root / "az/dev/flores200.dev.partial_from_sib200.tsv"
    khazar = data_root / "az/sft/khazar08_native_eval.jsonl"
    for path in (flores, khazar):
        client.upload_file(str(path), bucket, f"tasks/{path.name}")

    def section(flores_uri: str, khazar_uri: str) -> DownstreamTasks:
        return DownstreamTasks.model_validate(
            {
                "sib200": {"uri": flores_uri, "num_fewshot": [0], "max_examples": 5},
                "translation": [
                    {
                        "name": "f",
                        "az": {"uri": flores_uri, "text_field": "azj_Latn"},
                        "en": {"uri": flores_uri, "text_field": "eng_Latn"},
                        "max_examples": 3,
                    }
                ],
                "instructions": {"uri": khazar_uri, "max_examples": 3},
            }
        )

    downstream.prepare(section(str(flores), str(khazar)), tmp_path / "local", None)
    downstream.prepare(
        section(f"{s3_bucket}/tasks/{flores.name}", f"{s3_bucket}/tasks/{khazar.name}"),
        tmp_path / "s3",
        s3_server.endpoint_url,
    )
    local = sorted(p.name for p in (tmp_path / "local/data").iterdir())
    assert local == sorted(p.name for p in (tmp_path / "s3/data").iterdir()) and len(local) == 7
    for name in local:
        assert (tmp_path / "local/data" / name).read_text() == (tmp_path / "s3/data" / name).read_text()


def test_headline_task_table_puts_languages_side_by_side_and_shows_losses():
    from dilforge_eval.tables import downstream_table

    spec = {
        "row": "SIB-200 topics, 0-shot",
        "headline_metrics": ["acc"],
        "metrics": ["acc"],
        "num_examples": 10,
        "num_fewshot": 0,
        "chance": {"acc": 1 / 7},
    }
    tasks = {
        "sib/az": {**spec, "language": "az"},
        "sib/en": {**spec, "language": "en"},
        "tr/en-az": {
            "row": "flores translation into",
            "headline_metrics": ["chrf++"],
            "metrics": ["chrf++"],
            "num_examples": 10,
            "num_fewshot": 0,
            "chance": {"chrf++": 20.0},
            "language": "az",
        },
    }

    def v(x, se=0.1):
        return {"value": x, "stderr": se, "ci95": [max(0, x - 0.2), min(1, x + 0.2)] if x <= 1 else [x - 5, x + 5]}

    results = {
        "base": {"sib/az": {"acc": v(0.3)}, "sib/en": {"acc": v(0.6)}, "tr/en-az": {"chrf++": v(30.0)}},
        "cpt": {"sib/az": {"acc": v(0.5)}, "sib/en": {"acc": v(0.4)}, "tr/en-az": {"chrf++": v(35.5)}},
    }
    changes = {"cpt": {"sib/az": {"acc": 0.2}, "sib/en": {"acc": -0.2}, "tr/en-az": {"chrf++": 5.5}}}
    section = {
        "harness": {"name": "lm-evaluation-harness", "version": "0", "bootstrap_iters": 0, "batch_size": 1},
        "task_dir": "lm_eval_tasks",
        "commands": [],
        "tasks": {k: {"task": k, "kind": "test", **t} for k, t in tasks.items()},
        "results": results,
        "seconds": {},
        "changes": changes,
    }
    head, rows = downstream_table(metrics_samples.eval_metrics(downstream=section))
    assert head == ["task", "metric", "n", "chance", "base az", "base en", "cpt az", "cpt en"]
    sib, tr = rows
    assert [str(c) for c in sib[:4]] == ["SIB-200 topics, 0-shot", "accuracy", "10/10", "az 0.143, en 0.143"]
    assert str(sib[4]) == "0.300 [0.100, 0.500]" and str(sib[6]) == "0.500 [0.300, 0.700] (+0.200)"
    assert sib[6].cls == "num better" and sib[7].cls == "num worse"  # the English loss is shown, in red
    assert str(sib[7]) == "0.400 [0.200, 0.600] (-0.200)"
    assert str(tr[5]) == "–" and str(tr[6]) == "35.5 [30.5, 40.5] (+5.5)" and str(tr[3]) == "az 20.0"
