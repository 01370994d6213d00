#!/usr/bin/env bash
# CI: the README main job's SFT artifact exported as GGUF (the docs/serve.md command, q8_0 and f16), then read
# by a real llama.cpp (llama-cpp-python, built by setup.sh --export): every line of the eval sets must tokenize
# as the HF tokenizer does, next-token agreement f16 >= 0.99 on held-out X-WMT text (q8_0 >= 0.90: measured
# 0.93-0.95, every miss a near-tie; issue 34 asked 0.97, docs/benchmarks.md), >= 0.99 for both files where
# transformers' choice is decisive, and a chat answer through llama.cpp's OpenAI-compatible server must end with
# finish_reason "stop" (bench/export.py --check).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DILFORGE_DATA:-$(cd .. && pwd)/shared/data}
out=$(mktemp -d /tmp/dilforge-export-XXXXXX)
trap 'rm -rf "$out"' EXIT
for quant in q8_0 f16; do
  # --force: the main job's SFT model is still below the assistant gate's thresholds (docs/eval.md); this checks the
  # GGUF against transformers, not the model. Remove it once the recipe passes the gate.
  .venv/bin/coordinator export --run az-small --out "$out" --quant "$quant" --force
done
merged=$(.venv/bin/python - <<'PY'
from dilforge_coordinator.records import run_artifact
from dilforge_serve.prepare import resolve_served_model
print(resolve_served_model(run_artifact("az-small", ".dilforge/store", "sft")).base_dir)
PY
)
OMP_NUM_THREADS=2 .venv/bin/python bench/export.py --hf "$merged" --data "$DATA" --chat \
  --gguf "$out/az-small-sft-f16.gguf" --gguf "$out/az-small-sft-q8_0.gguf" --check f16=0.99,q8_0=0.90 --decisive-bar 0.99
