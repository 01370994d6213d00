"""One name per idea across the stage configs (config schema 1.1): the old names still load for one minor version,
warn naming the new field, and give exactly the config the new names give; presets use only the new names."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from dilforge_shared.configs import CptConfig, SftConfig, load_pipeline, validate_model
from dilforge_shared.configs.cloud import StageResources
from dilforge_shared.configs.pipeline import CONFIG_SCHEMA_VERSION
from dilforge_shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CPT = {"scratch_model": {}, "corpora": [{"uri": "a.txt"}], "validation": [{"uri": "dev.txt"}]}
SFT = {"train": [{"uri": "chat.jsonl"}]}


def _load_old(model, raw: dict, *new_fields: str):
    with pytest.warns(DeprecationWarning) as caught:
        config = validate_model(model, raw, "old.yaml")
    messages = " | ".join(str(w.message) for w in caught)
    for field in new_fields:
        assert field in messages, f"the warning does not name {field}: {messages}"
    return config


def test_cpt_phase_lr_names():
    old = {**CPT, "phase1": {"num_steps": 2, "lr": 0.01}, "phase2": {"num_steps": 3, "lr": 1e-4, "embedding_lr": 1e-3}}
    new = {**CPT, "phase1": {"num_steps": 2, "learning_rate": 0.01},
           "phase2": {"num_steps": 3, "learning_rate": 1e-4, "embedding_learning_rate": 1e-3}}
    loaded = _load_old(CptConfig, old, "cpt.phase1.learning_rate", "cpt.phase2.learning_rate",
                       "cpt.phase2.embedding_learning_rate")
    assert loaded == validate_model(CptConfig, new, "new.yaml")
    assert (loaded.phase1.learning_rate, loaded.phase2.embedding_learning_rate) == (0.01, 1e-3)


@pytest.mark.parametrize("old, new", [(True, "auto"), (False, "off")])
def test_cpt_liger_bool_is_the_switch(old, new):
    base = {**CPT, "phase2": {"num_steps": 1}}
    loaded = _load_old(CptConfig, {**base, "liger": old}, f"cpt.liger: {new}")
    assert loaded == validate_model(CptConfig, {**base, "liger": new}, "new.yaml")


def test_sft_logging_and_checkpoint_names():
    loaded = _load_old(SftConfig, {**SFT, "logging_steps": 3, "save_steps": 7}, "sft.log_every", "sft.checkpoint_every")
    assert loaded == validate_model(SftConfig, {**SFT, "log_every": 3, "checkpoint_every": 7}, "new.yaml")
    assert (loaded.log_every, loaded.checkpoint_every) == (3, 7)


def test_old_and_new_name_together_is_an_error_naming_both():
    with pytest.raises(ConfigError, match="sft.save_steps and sft.checkpoint_every"):
        validate_model(SftConfig, {**SFT, "save_steps": 7, "checkpoint_every": 8}, "both.yaml")
    with pytest.raises(ConfigError, match="cpt.phase2.lr and cpt.phase2.learning_rate"):
        validate_model(CptConfig, {**CPT, "phase2": {"num_steps": 1, "lr": 1, "learning_rate": 2}}, "both.yaml")


def test_sagemaker_nproc_per_node_is_ignored_with_a_warning():
    loaded = _load_old(StageResources, {"instance_type": "ml.p4d.24xlarge", "nproc_per_node": 8},
                       "cpt.num_processes_per_node")
    assert loaded == StageResources(instance_type="ml.p4d.24xlarge")
    assert "nproc_per_node" not in StageResources.model_fields


def test_new_names_load_without_warnings_in_every_preset(data_root):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for preset in sorted((ROOT / "configs").glob("*.yaml")):
            load_pipeline(preset)


def test_exported_schema_carries_the_config_version():
    schema = json.loads((ROOT / "schemas" / "pipeline.schema.json").read_text())
    assert schema["x-dilforge-config-version"] == CONFIG_SCHEMA_VERSION == "1.1.0"
    props = schema["$defs"]
    assert "learning_rate" in props["Phase1"]["properties"] and "lr" not in props["Phase1"]["properties"]
    assert "nproc_per_node" not in props["StageResources"]["properties"]
