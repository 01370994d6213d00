"""The full-size tokenizer preset through `coordinator run-all` on the shared Azerbaijani corpus.

Done-when check: `replace` at 50k gives <= 1.50 tokens per word on the FLORES dev sentences, with the
Llama 3.2 tokenizer's figures beside it (the `llama32_tokenizer` fixture builds it offline; about 20-40 s
on 2 CPU cores), and issue 13's extend bars on the compare preset (corpus plus the word-frequency list).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.cli import app
from dilforge_shared.store import fetch
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

PRESET = Path(__file__).resolve().parents[2] / "configs/az-tokenizer.yaml"


def test_full_preset_replace_50k_on_flores(tmp_path, data_root, llama32_tokenizer):
    section = yaml.safe_load(PRESET.read_text())["tokenizer"]
    base = str(llama32_tokenizer)
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
    flores = row["sets"]["az"]
    assert flores["num_texts"] == 510
    assert flores["tokens_per_word"] <= 1.50, flores
    table = re.sub(r" *\| *", " | ", (art.path / "sweep.md").read_text())  # one space around each cell
    assert "| 50000 (selected) | az |" in table and "| 50000 (selected) | en |" in table
    assert set(m["languages"]) == {"az", "en"} and m["languages"]["en"]["tokens_per_word"] > 1.5  # English paid
    assert [r["strategy"] for r in m["comparison"]] == ["replace"] * 3
    assert m["base"]["sets"]["az"]["tokens_per_word"] > 2 * flores["tokens_per_word"]
    assert "base tokens/word" in table


COMPARE = Path(__file__).resolve().parents[2] / "configs/az-tokenizer-compare.yaml"


def test_compare_preset_extend_beats_replace_and_keeps_english(tmp_path, data_root, llama32_tokenizer):
    """Issue 13's bars on Llama 3.2 (the `llama32_tokenizer` fixture builds it offline from PyPI)."""
    section = yaml.safe_load(COMPARE.read_text())["tokenizer"]
    section["base_tokenizer"] = str(llama32_tokenizer)
    cfg = {"run_id": "tok-cmp", "store": {"uri": str(tmp_path / "store")}, "tokenizer": section}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    os.environ["DILFORGE_WORKDIR"] = str(tmp_path / "work")
    result = CliRunner().invoke(app, ["run-all", "--config", str(tmp_path / "p.yaml"), "--data", str(data_root)])
    assert result.exit_code == 0, result.output
    m = fetch(result.output.strip().splitlines()[-1].split("artifact: ")[1]).manifest.metrics
    rows = {(r["strategy"], r["num_new_tokens"] if r["strategy"] == "extend" else 0): r for r in m["comparison"]}
    llama, replace = rows[("base", 0)], rows[("replace", 0)]
    ext32, ext64 = rows[("extend", 32000)], rows[("extend", 64000)]
    for ext in (ext32, ext64):  # English never worse than Llama 3.2's: an extension only merges further
        assert ext["languages"]["en"]["tokens_per_word"] <= llama["languages"]["en"]["tokens_per_word"]
    assert replace["languages"]["en"]["tokens_per_word"] > 1.5 * llama["languages"]["en"]["tokens_per_word"]
    # issue 13's bars (corpus + word-frequency list, configs/az-tokenizer-compare.yaml; measured 1.4825 / 1.3970
    # unpruned, 1.3972 published): 32k <= 1.50, 64k <= 1.40 with <= 2 % dead, and better than replace 50k
    assert ext32["languages"]["az"]["tokens_per_word"] <= 1.50 and ext32["dead_new_tokens_frac"] <= 0.02
    assert ext64["languages"]["az"]["tokens_per_word"] < replace["languages"]["az"]["tokens_per_word"]
    assert ext64["selected"] and m["selection"]["retain_met"]
    assert m["languages"]["az"]["tokens_per_word"] <= 1.40 and m["dead_tokens"]["dead_new_tokens_frac"] <= 0.02
    assert m["languages"]["en"]["tokens_per_word"] <= llama["languages"]["en"]["tokens_per_word"]
    freq = m["corpus"]["sources"]["word_freq"]
    assert freq["lines_read"] == 86_173 and freq["lines_heldout"] == 0 and freq["words_recased"] > 5_000
