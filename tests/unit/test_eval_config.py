"""EvalConfig: strict validation with field names, and every data source listed for lineage."""

from __future__ import annotations

import pytest
from dilforge_eval.config import EvalConfig
from dilforge_shared.configs import validate_model
from dilforge_shared.errors import ConfigError


def test_data_sources_list_every_file():
    cfg = EvalConfig.model_validate(
        {
            "text_sets": [{"uri": "/d/a.txt", "name": "a"}],
            "parallel_sets": [
                {
                    "name": "fl",
                    "az": {"uri": "/d/f.tsv", "text_field": "az"},
                    "en": {"uri": "/d/f.tsv", "text_field": "en"},
                }
            ],
            "morph": {"segmented": ["/m/s.tsv"], "lemma_forms": ["/m/u.tsv", "/m/w.tsv"], "conllu": ["/m/x.conllu"]},
            "prompts": "/p.jsonl",
        }
    )
    labels = [s.label for s in cfg.data_sources()]
    assert labels == [
        "a",
        "fl.az",
        "fl.en",
        "morph.segmented.0",
        "morph.lemma_forms.0",
        "morph.lemma_forms.1",
        "morph.conllu.0",
        "prompts",
    ]
    assert (EvalConfig.stage, EvalConfig.artifact_kind, EvalConfig.consumes) == (
        "eval",
        "eval_report",
        ("model", "tokenizer", "cpt", "sft"),
    )


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"models": [{"label": "cpt", "uri": "/x"}]}, "reserved"),
        ({"models": [{"label": "b", "uri": "/x"}, {"label": "b", "uri": "/y"}]}, "duplicate labels"),
        ({"text_sets": [{"uri": "/a/x.txt"}, {"uri": "/b/x.txt"}]}, "duplicate names"),
        ({"bpb": {"window": 64, "stride": 128}}, "bpb.stride"),
        ({"generation": {"modes": ["beam"]}}, "generation.modes"),
        ({"max_bytes_per_set": 0}, "max_bytes_per_set"),
        ({"modles": []}, "modles"),
        ({"set_languages": {"nope": "en"}}, "set_languages: 'nope' is not a text set name"),
        ({"text_sets": [{"uri": "/a.txt", "name": "a"}], "set_languages": {"a": "English"}}, r"set_languages\.a"),
        ({"target_language": "Azerbaijani"}, "target_language"),
        ({"generation": {"no_repeat_ngram_size": -1}}, "generation.no_repeat_ngram_size"),
        # issue 31: a built-in prompt set is a name, never a path; task names that lm-eval would merge
        (
            {"prompts": "builtin:../../../etc/passwd"},
            r"prompts: .*'builtin:\.\./\.\./\.\./etc/passwd': a built-in prompt set",
        ),
        ({"prompts": "builtin:"}, "a built-in prompt set is `builtin:` and a name"),
        (
            {
                "tasks": {
                    "multiple_choice": [
                        {"uri": "/b.tsv", "name": "bele-a", "layout": "belebele", "language": "az"},
                        {"uri": "/c.tsv", "name": "bele_a", "layout": "belebele", "language": "az"},
                    ]
                }
            },
            r"tasks: names \['bele-a', 'bele_a'\] become the same lm-eval task",
        ),
        (
            {
                "tasks": {
                    "translation": [
                        {"name": "x-wmt", "az": {"uri": "/a"}, "en": {"uri": "/e"}},
                        {"name": "x.wmt", "az": {"uri": "/a"}, "en": {"uri": "/e"}},
                    ]
                }
            },
            "become the same lm-eval task",
        ),
    ],
)
def test_bad_configs_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(EvalConfig, raw, "test")


def test_base_label_is_taken_by_the_pipeline_model_artifact():
    """With a `model` input, "base" is that artifact; a config model of the same label is an error naming the field."""
    from dilforge_eval.resolve import resolve_models

    class Ctx:
        def has_input(self, name):
            return name == "model"

    cfg = EvalConfig.model_validate({"models": [{"label": "stock", "uri": "/x"}, {"label": "base", "uri": "/y"}]})
    with pytest.raises(ConfigError, match=r"eval.models\[1\].label: 'base' is the pipeline's model artifact"):
        resolve_models(cfg, Ctx(), None)


def test_builtin_prompt_names_still_load():
    assert EvalConfig.model_validate({"prompts": "builtin:az-generation"}).prompts == "builtin:az-generation"
