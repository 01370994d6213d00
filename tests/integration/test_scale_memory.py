"""The tokenizer stage's memory does not grow with the corpus: bench/scale.py's generated corpora (distinct words
keep growing with the size), the stage run through the coordinator, PSS of the whole process tree sampled."""

from __future__ import annotations

import pytest
from factories import load_bench

pytestmark = pytest.mark.slow


def test_extend_peak_memory_is_flat_from_2_to_8_mb(tmp_path, data_root, smollm2_dir):
    from dilforge_shared.settings import cache_root

    scale = load_bench("scale")
    peaks = {}
    for size in (2, 8):
        corpus = scale.generate(data_root, tmp_path / f"az-{size}.txt", size)
        # a budget below both corpora's distinct pre-tokens, as a large corpus meets the default
        row = scale.run_stage(
            "tokenizer-extend",
            corpus,
            data_root,
            cache_root(),
            tmp_path / f"run-{size}",
            base_tokenizer=str(smollm2_dir),
            max_pretokens=20_000,
        )
        assert row["rc"] == 0, (tmp_path / f"run-{size}" / "log.txt").read_text()[-3000:]
        assert all(c.get("dropped", 0) > 0 for c in row["pretokens"].values()), row["pretokens"]  # budget met
        peaks[size] = row["peak_gib"]
    assert peaks[8] <= 1.3 * peaks[2], peaks
