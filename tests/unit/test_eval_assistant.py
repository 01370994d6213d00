"""The assistant measures (services/eval assistant.py): each measure counts what it says and misses what it
should not, the intervals are Wilson's, and the shipped held-out prompts load."""

from __future__ import annotations

import json

import pytest
from dilforge_eval import assistant as A
from dilforge_shared.errors import InputError

AZ_Q = "Azərbaycanın paytaxtı haradır?"


def ans(answer: str, prompt: str = AZ_Q, language: str = "az", ended: bool = True, ref: str | None = None):
    return A.Answer(prompt=prompt, answer=answer, language=language, ended_turn=ended, reference=ref)


def test_language_id_names_the_answer_language():
    assert A.detect_language("Azərbaycanın paytaxtı Bakıdır və orada çoxlu muzey var.") == "az"
    assert A.detect_language("Azerbaycanin paytaxti Bakidir ve orada coxlu muzey var.") == "az"
    assert A.detect_language("The capital of Azerbaijan is Baku, on the Caspian Sea.") == "en"
    assert A.detect_language("   ") is None


def test_in_language_counts_only_answers_in_the_prompts_language():
    figures = A.score(
        [
            ans("Azərbaycanın paytaxtı Bakı şəhəridir."),
            ans("You're right, the capital is a big city."),
            ans(""),  # an empty answer is not in the language
            ans("Bakı Xəzər dənizinin sahilində yerləşən böyük şəhərdir."),
        ]
    )
    assert (figures.in_language.count, figures.in_language.n) == (2, 4)
    english = A.score([ans("The capital of Azerbaijan is Baku.", "What is the capital of Azerbaijan?", "en")])
    assert english.in_language.count == 1 and english.language == "en"


def test_ended_turn_is_the_generation_flag():
    figures = A.score([ans("Bakı.", ended=True), ans("Bakı, Bakı şəhəri", ended=False), ans("Bakıdır.")])
    assert figures.ended_turn.count == 2 and figures.ended_turn.value == pytest.approx(0.6667)


@pytest.mark.parametrize(
    ("text", "looping"),
    [
        ("bir bir bir bir bir bir bir", True),
        ("SABIN. SABIN. SABIN. SABIN. SABIN.", True),
        ("No. No. No. No. No. No.", True),
        ("Paytaxt Bakıdır. Paytaxt Bakıdır. Paytaxt Bakıdır.", True),
        ("Azərbaycanın paytaxtı Bakıdır. Şəhər Xəzər dənizinin sahilində yerləşir və çox qədimdir.", False),
        ("No, no.", False),  # under 3 words: never a loop
    ],
)
def test_looping(text, looping):
    assert A.loops(text) is looping
    assert A.score([ans(text)]).looping.count == int(looping)


@pytest.mark.parametrize(
    ("prompt", "answer", "parroting"),
    [
        (AZ_Q, "Azərbaycanın paytaxtı haradır?", True),
        (AZ_Q, "Azərbaycanın paytaxtı haradır? Azərbaycanın paytaxtı haradır?", True),
        (AZ_Q, "Azərbaycanın paytaxtı Bakıdır.", False),  # restates the question, then answers
        ('Bu cümləni düzəlt: "Mən dünən mağazaya gedəcəm."', "Mən dünən mağazaya gedəcəm.", True),
        ('Bu cümləni düzəlt: "Mən dünən mağazaya gedəcəm."', "Mən dünən mağazaya getdim.", False),
        ("What is the opposite of hot?", "hot", True),
        ("What is the opposite of hot?", "cold", False),
        (AZ_Q, "", False),
    ],
)
def test_parroting(prompt, answer, parroting):
    assert A.parrots(prompt, answer) is parroting


def test_chrf_only_over_answers_with_a_reference():
    ref = "Azərbaycanın paytaxtı Bakıdır."
    good = A.score([ans(ref, ref=ref), ans("Bakı paytaxtdır.", ref="Bakı paytaxtdır."), ans("Bilmirəm.")])
    bad = A.score([ans("You're right.", ref=ref), ans("No, no.", ref="Bakı paytaxtdır."), ans("Bakıdır.")])
    assert good.chrf.n == 2 and good.chrf.score == pytest.approx(100.0)
    assert bad.chrf.score < 20 and 0 <= bad.chrf.low <= bad.chrf.score <= bad.chrf.high <= 100
    assert A.score([ans("Bakı.")]).chrf is None


def test_wilson_interval():
    low, high = A.wilson(36, 40)  # 0.9: the textbook Wilson 95 % interval
    assert low == pytest.approx(0.7695, abs=1e-3) and high == pytest.approx(0.9604, abs=1e-3)
    assert A.wilson(0, 40)[0] == 0.0 and A.wilson(40, 40)[1] == 1.0 and A.wilson(40, 40)[0] > 0.9
    assert A.share([]).value is None


def test_without_diacritics_and_groups():
    assert A.without_diacritics("Şəhər İçərişəhər, çörək, ağac, göl, üzüm, qızıl, ƏLİ") == (
        "Seher Iceriseher, corek, agac, gol, uzum, qizil, ELI"
    )
    prompts = [A.AssistantPrompt("a1", "az", "Şifrəmi unutmuşam."), A.AssistantPrompt("e1", "en", "Hi")]
    grouped = A.groups(prompts)
    assert list(grouped) == ["az", "en", "az-no-diacritics"]
    assert (
        grouped["az-no-diacritics"][0].prompt == "Sifremi unutmusam."
        and grouped["az-no-diacritics"][0].id == "a1-no-diacritics"
    )
    assert grouped["az-no-diacritics"][0].language == "az"
    assert list(A.groups(prompts, no_diacritics=False)) == ["az", "en"]


def test_shipped_prompts_hold_40_per_language_and_load_capped():
    prompts = A.load_prompts("builtin:assistant")
    by_lang = {lang: [p for p in prompts if p.language == lang] for lang in ("az", "en")}
    assert len(by_lang["az"]) >= 40 and len(by_lang["en"]) >= 40
    assert sum(p.reference is not None for p in by_lang["az"]) >= 10
    assert all(A.without_diacritics(p.prompt) == p.prompt for p in by_lang["en"] if "Bu gün" not in p.prompt)
    capped = A.load_prompts("builtin:assistant", per_language=5)
    assert [p.language for p in capped].count("az") == 5 and [p.language for p in capped].count("en") == 5


def test_prompts_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"id": "a", "language": "az", "prompt": "Salam"})
        + "\n"
        + json.dumps({"id": "b", "prompt": "x"})
        + "\n"
    )
    with pytest.raises(InputError, match=r"p.jsonl:2: .*language"):
        A.load_prompts(str(path))


def test_parroting_a_quoted_text_is_not_a_summary():
    prompt = (
        'Mətni bir cümlə ilə xülasə et: "Şəhərdə yeni park açıldı. Parkda uşaq meydançası, velosiped yolu və kiçik '
        'göl var. Sakinlər parkdan çox razıdırlar."'
    )
    summary = "Şəhərdə uşaq meydançası, velosiped yolu və kiçik gölü olan yeni park açıldı və sakinlər ondan razıdır."
    copy = "Şəhərdə yeni park açıldı. Parkda uşaq meydançası, velosiped yolu və kiçik göl var."
    assert not A.parrots(prompt, summary) and A.parrots(prompt, copy)


def test_report_table_marks_what_the_gate_refuses():
    import metrics_samples
    from dilforge_eval.metrics import AssistantSection, AssistantThresholds
    from dilforge_eval.tables import assistant_table

    def figs(language: str, in_language: int, ended: int) -> dict:
        answers = [
            ans("Bakı.", language=language, ended=i < ended)
            if i < in_language
            else ans("", language=language, ended=i < ended)
            for i in range(10)
        ]
        return A.score(answers)

    section = AssistantSection(
        prompts="builtin:assistant",
        max_new_tokens=64,
        batch_size=40,
        thresholds=AssistantThresholds(language="az", min_in_language=0.9, min_ended_turn=0.9),
        figures={"sft": {"az": figs("az", 5, 10), "en": figs("en", 0, 2)}},
    )
    head, rows = assistant_table(metrics_samples.eval_metrics(assistant=section))
    cells = {(r[0], r[1]): r for r in rows}
    assert head[3] == "in language" and list(cells) == [("sft", "az"), ("sft", "en")]
    in_az, ended_az = cells["sft", "az"][3], cells["sft", "az"][4]
    assert in_az.text == "0.50 [0.24–0.76]" and "worse" in in_az.cls and "worse" not in ended_az.cls
    assert "worse" not in cells["sft", "en"][4].cls  # English answers are shown, the gate reads the target language
