"""Every checked-in preset validates, and every local data path it names exists."""

from pathlib import Path

import pytest
from dilforge_coordinator.config import load_pipeline

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(p for p in CONFIGS.glob("*.yaml"))


def test_presets_exist():
    assert {p.name for p in PRESETS} >= {"az-tiny.yaml", "az-tokenizer.yaml", "az-full.yaml"}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_validates_and_its_local_data_exists(preset, data_root):
    config = load_pipeline(preset)
    assert config.stages(), f"{preset.name} configures no stage"
    for _, stage in config.stages():
        for source in stage.file_sources():
            if "://" not in source.uri:
                assert Path(source.uri).exists(), f"{preset.name}: {source.uri} does not exist"
