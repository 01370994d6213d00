"""The full-size tokenizer preset through `coordinator run-all` on the shared Azerbaijani corpus.

Done-when check: `replace` at 50k gives <= 1.50 tokens per word on the FLORES dev sentences. With
DILFORGE_LLAMA32_TOKENIZER pointing at a folder built by scripts/build_llama32_tokenizer.py, the
Llama 3.2 tokenizer's figures are measured beside it (about 20-40 s on 2 CPU cores).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.cli import app
from dilforge_shared.store import fetch
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

PRESET = Path(__file__).resolve().parents[2] / "configs/az-tokenizer.yaml"


def test_full_preset_replace_50k_on_flores(tmp_path, data_root):
    section = yaml.safe_load(PRESET.read_text())["tokenizer"]
    base = os.environ.get("DILFORGE_LLAMA32_TOKENIZER")
    if base:
        section["base_tokenizer"] = base
    cfg = {"run_id": "tok-e2e", "store": {"uri": str(tmp_path / "store")}, "tokenizer": section}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    os.environ["DILFORGE_WORKDIR"] = str(tmp_path / "work")
    result = CliRunner().invoke(app, ["run-all", "--config", str(tmp_path / "p.yaml"), "--data", str(data_root)])
    assert result.exit_code == 0, result.output
    art = fetch(result.output.strip().splitlines()[-1].split("artifact: ")[1])
    m = art.manifest.metrics
    assert m["selected_vocab_size"] == 50_000
    row = next(r for r in m["sweep"] if r["vocab_size"] == 50_000)
    flores = row["sets"]["flores_dev"]
    assert flores["num_texts"] == 510
    assert flores["tokens_per_word"] <= 1.50, flores
    table = (art.path / "sweep.md").read_text()
    assert "| 50000 (selected) | flores_dev |" in table
    if base:
        assert m["base"]["sets"]["flores_dev"]["tokens_per_word"] > 2 * flores["tokens_per_word"]
        assert "base tokens/word" in table
