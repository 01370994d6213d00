"""bench/gpu_cpt.py on the Llama-3.2-1B shape (a short sweep: eager, plain vs Liger FLCE and all kernels)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpu_helpers import stage_env

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_cpt.py"


def test_bench_llama_1b_shape_measures_liger_against_plain(tmp_path, results_dir):
    out = (results_dir or tmp_path) / "bench_pytest.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--modes", "eager", "--checkpointing", "off", "--start-batch", "4", "--max-batch", "8",
                           "--steps", "2", "--warmup", "1", "--json", str(out)], env=stage_env(),
                          capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    ran = [p for p in result["points"] if p["ok"]]
    assert {p["liger"] for p in ran} == {"plain", "liger_all", "liger_flce"}
    for p in ran:
        assert p["tok_s"] > 0 and 0 < p["mfu"] < 1 and p["peak_allocated_gb"] <= p["peak_reserved_gb"]
    cuts = {(c["liger"], c["checkpointing"]): c["memory_cut"] for c in result["equal_batch"]}
    assert cuts and all(cut > 0 for cut in cuts.values()), cuts  # Liger never uses more memory at equal batch
