"""Stage names are defined once (dilforge_shared.manifest.STAGES); every other list is derived from it."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from dilforge_coordinator.cloud import SageMakerConfig
from dilforge_coordinator.config import STAGE_CONFIGS, PipelineConfig
from dilforge_coordinator.stage_images import IMAGES, image_of
from dilforge_shared.identity import STAGE_MODULES
from dilforge_shared.manifest import STAGES, Manifest

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_list_is_the_shared_one():
    assert STAGES == ("model", "curate", "tokenizer", "cpt", "sft", "eval")
    assert tuple(STAGE_CONFIGS) == STAGES
    assert all(config.stage == name for name, config in STAGE_CONFIGS.items())
    assert [name for name in PipelineConfig.model_fields if name in STAGES] == list(STAGES)
    assert typing.get_args(Manifest.model_fields["stage"].annotation) == STAGES
    assert set(STAGE_MODULES) == set(STAGES)


def test_each_stage_runs_a_module_that_its_image_holds():
    assert image_of("model") == "cpt" and [image_of(s) for s in STAGES[1:]] == list(IMAGES)
    for stage in STAGES:
        package, *rest = STAGE_MODULES[stage].split(".")
        module = ROOT / "services" / image_of(stage) / package / (f"{rest[0]}.py" if rest else "__main__.py")
        assert module.is_file(), (stage, module)


def test_sagemaker_sections_are_keyed_by_image():
    for field in ("images", "stages"):
        key_type = typing.get_args(SageMakerConfig.model_fields[field].annotation)[0]
        assert typing.get_args(key_type) == IMAGES


def test_image_of_names_the_image_and_refuses_what_is_not_a_stage():
    assert image_of("model") == "cpt" and image_of("eval") == "eval"
    with pytest.raises(ValueError, match="'serve' is not a pipeline stage"):
        image_of("serve")
