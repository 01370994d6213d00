"""The assistant recipe's parts in the SFT stage: the language mix of the training answers (measured, warned about)
and the repetition control written into the published generation_config.json."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from dilforge_coordinator.config import load_pipeline
from dilforge_sft.config import GenerationDefaults, SftConfig
from dilforge_sft.data import DataCounts, count_answer_languages, fold_user_turns, load_splits
from dilforge_sft.outputs import write_generation_defaults
from dilforge_sft.stage import check_answer_languages
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
AZ = "Bakı Azərbaycanın paytaxtı və ən böyük şəhəridir, Xəzər dənizinin sahilində yerləşir."
EN = "Baku is the capital and the largest city of Azerbaijan, on the shore of the Caspian Sea."


def conv(answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Bakı haqqında danış."}, {"role": "assistant", "content": answer}]


def test_the_language_of_each_last_answer_is_counted():
    counts = DataCounts()
    share = count_answer_languages([conv(AZ), conv(EN), conv(EN), conv(AZ), conv(AZ)], "az", counts)
    assert counts.answer_languages == {"az": 3, "en": 2}
    assert share == pytest.approx(0.6)
    assert asdict(counts)["answer_languages"] == {"az": 3, "en": 2}  # what the manifest's metrics carry


def test_a_mostly_english_answer_set_is_warned_about(caplog):
    with caplog.at_level("INFO", logger="dilforge.sft"):
        check_answer_languages([conv(EN), conv(EN), conv(AZ)], "az", DataCounts())
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "only 33% of the training answers are in az (az 1, en 2)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="dilforge.sft"):
        check_answer_languages([conv(AZ), conv(AZ), conv(EN)], "az", DataCounts())
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "67% in az" in caplog.text


def test_generation_defaults_are_added_to_the_published_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    write_generation_defaults(tmp_path, GenerationDefaults(repetition_penalty=1.2))
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": [2, 0],
        "repetition_penalty": 1.2,
    }  # an unset key is not written
    write_generation_defaults(tmp_path / "missing", GenerationDefaults())  # nothing to write: no folder touched
    assert not (tmp_path / "missing").exists()


def test_a_penalty_below_one_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="generation.repetition_penalty"):
        SftConfig.model_validate({"train": [{"uri": "a.jsonl"}], "generation": {"repetition_penalty": 0.8}})


def test_a_share_of_user_turns_is_folded_to_ascii_and_the_answers_keep_their_letters():
    convs = [conv(AZ) for _ in range(10)]
    counts = DataCounts()
    out = fold_user_turns(convs, 0.3, seed=0, counts=counts)
    folded = [c for c in out if c[0]["content"] == "Baki haqqinda danis."]
    assert len(folded) == 3 and counts.num_user_turns_folded == 3
    assert all(c[1]["content"] == AZ for c in out)  # answers untouched
    assert fold_user_turns(convs, 0.3, seed=0, counts=DataCounts()) == out  # seeded
    assert convs[0][0]["content"] == "Bakı haqqında danış."  # the input is not modified


def test_folding_needs_the_azerbaijani_target():
    with pytest.raises(ValidationError, match="target_language: az"):
        SftConfig.model_validate({"train": [{"uri": "a.jsonl"}], "folded_user_share": 0.5})


def test_the_modelfile_carries_the_published_repetition_penalty():
    from dilforge_serve.export import modelfile
    from dilforge_shared.families import FAMILIES

    chatml = FAMILIES["chatml"]
    text = modelfile("m.gguf", chatml, None, {"repetition_penalty": 1.2, "no_repeat_ngram_size": 3})
    assert text.splitlines()[-1] == "PARAMETER repeat_penalty 1.2"
    assert "no_repeat" not in text  # Ollama has no such parameter
    assert "repeat_penalty" not in modelfile("m.gguf", chatml, None, {"eos_token_id": [2, 0]})


@pytest.mark.parametrize("preset", ["az-small.yaml", "az-full.yaml"])
def test_the_presets_train_an_assistant_that_answers_in_azerbaijani(preset, data_root, monkeypatch):
    """Most training answers of the shipped presets are Azerbaijani, they publish repetition control, and no
    system turn picks the answer's language for the user (docs/sft.md, "No system prompt")."""
    monkeypatch.setenv("DILFORGE_VAR_BASE_MODEL", "unused")
    pipeline = load_pipeline(ROOT / "configs" / preset)
    sft = pipeline.sft
    assert sft.target_language == "az"
    assert sft.system_prompt is None
    assert (
        pipeline.eval.tasks is None
        or pipeline.eval.tasks.instructions is None
        or not (pipeline.eval.tasks.instructions.system_prompt)
    )
    assert sft.generation.repetition_penalty and sft.generation.repetition_penalty > 1
    train, _, counts, _ = load_splits(sft)
    assert count_answer_languages(train, "az", counts) >= 0.6
