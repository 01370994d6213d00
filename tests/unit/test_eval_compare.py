"""Per-set BPB change against the base, the per-language headline, and what eval reads from upstream manifests."""

from __future__ import annotations

import metrics_samples
import pytest
from dilforge_cpt.metrics import CptMetrics
from dilforge_eval import compare
from dilforge_eval.metrics import BpbFigures
from dilforge_shared.configs import DataSource
from dilforge_tokenizer.metrics import TokenizerMetrics

PRODUCERS = {"cpt": CptMetrics, "tokenizer": TokenizerMetrics}


def published(stage: str, **changes) -> dict:
    """A stage's sample metrics as its manifest holds them: validated by its own model, dumped."""
    return PRODUCERS[stage].model_validate(metrics_samples.sample(stage, **changes)).model_dump(mode="json")


@pytest.mark.parametrize(
    "source,expected",
    [
        (DataSource(uri="/d/flores.tsv", text_field="eng_Latn", name="flores-dev"), "en"),
        (DataSource(uri="/d/flores.tsv", text_field="azj_Latn", name="flores-dev-en"), "az"),  # the column decides
        (DataSource(uri="/d/xwmt_test.az-en.en.txt"), "en"),
        (DataSource(uri="/d/xwmt_test.az-en.az.txt"), "az"),
        (DataSource(uri="/d/tatoeba.tsv", text_field="eng", name="tatoeba_en"), "en"),
        (DataSource(uri="/d/flores.tsv", text_field="azj_Latn", name="flores-dev"), "az"),
        (DataSource(uri="/d/khazar08_native_eval.jsonl", text_field="response", name="sft-eval"), "az"),  # default
        (DataSource(uri="/d/legal.txt", name="legal-dev"), "az"),  # 'dev' is not a language
    ],
)
def test_language_of_a_text_set(source, expected):
    assert compare.infer_language(source, {}, "az") == expected


def test_explicit_language_wins():
    src = DataSource(uri="/d/x.txt", text_field="eng_Latn", name="x")
    assert compare.infer_language(src, {"x": "ru"}, "az") == "ru"


BPB = {
    model: {name: BpbFigures(**metrics_samples.bpb_figures(v)) for name, v in sets.items()}
    for model, sets in {
        "base": {"fl-az": 3.0, "wiki": 2.0, "fl-en": 1.0},
        "cpt": {"fl-az": 2.4, "wiki": 1.5, "fl-en": 1.5},
        "sft": {"fl-az": 2.25, "fl-en": 0.9},
    }.items()
}
LANGS = {"fl-az": "az", "wiki": "az", "fl-en": "en"}


def test_change_is_per_set_against_the_base():
    ch = compare.bpb_changes(BPB, "base", LANGS)
    assert set(ch) == {"cpt", "sft"}  # the reference has no change against itself
    row = ch["cpt"]["fl-az"].model_dump()
    assert row == {"language": "az", "bpb": 2.4, "reference_bpb": 3.0, "change": pytest.approx(-0.2)}
    assert ch["cpt"]["wiki"].change == pytest.approx(-0.25)
    assert ch["cpt"]["fl-en"].change == pytest.approx(0.5)
    assert set(ch["sft"]) == {"fl-az", "fl-en"}  # a set the model was not scored on has no row


def test_headline_gain_and_retention_sign():
    h = compare.headline(compare.bpb_changes(BPB, "base", LANGS), "base", LANGS, "az")
    assert h.reference == "base" and h.target_language == "az"
    assert h.gain["cpt"].set == "fl-az" and h.gain["cpt"].change == pytest.approx(-0.2)
    # English got worse after CPT (positive change) and better after SFT (negative change)
    assert h.retention["cpt"]["en"].change == pytest.approx(0.5)
    assert h.retention["sft"]["en"].change == pytest.approx(-0.1)
    assert "az" not in h.retention["cpt"]  # the target language is the gain, not a retention row


def test_reference_is_base_else_first_model():
    assert compare.reference_label(["cpt", "base", "sft"]) == "base"
    assert compare.reference_label(["stock", "cpt"]) == "stock"
    assert compare.reference_label([]) is None
    assert compare.bpb_changes(BPB, None, LANGS) == {}


@pytest.mark.parametrize(
    "transplant,expected",
    [
        (
            {
                "method": "mean_of_all",
                "step0_val_bpb": {"mean_of_all": 2.0},
                "step0_val_bpb_by_set": {"mean_of_all": {"flores-az": 3.3, "flores-en": 1.4}},
            },
            {"mean_of_all": {"flores-az": 3.3, "flores-en": 1.4}},
        ),
    ],
)
def test_step0_bpb_per_initialisation_and_set(transplant, expected):
    got = compare.step0_bpb(compare.CptRead.model_validate(published("cpt", transplant=transplant)).transplant)
    assert got.step0_bpb == expected and got.method == transplant["method"]
    assert got.sets == sorted({s for v in expected.values() for s in v})


@pytest.mark.parametrize("transplant", [None, {"method": "none", "reason": "same tokenizer as the base model"}])
def test_step0_bpb_absent_without_a_comparison(transplant):
    assert compare.step0_bpb(compare.CptRead.model_validate(published("cpt", transplant=transplant)).transplant) is None


def test_tokenizer_comparison_reads_the_published_metrics():
    tok = published("tokenizer")
    got = compare.tokenizer_comparison(compare.TokenizerRead.model_validate(tok), tok["comparison"])
    assert got.languages == ["az", "en"] and got.rows[0]["strategy"] == "replace"
    assert got.dead_tokens["num_dead_new_tokens"] == 5  # the audit is free-form: published as the tokenizer wrote it
    empty = compare.TokenizerRead.model_validate(published("tokenizer", comparison=[], dead_tokens={}))
    assert compare.tokenizer_comparison(empty, []) is None
