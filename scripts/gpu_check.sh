#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go, in at most 8 minutes on one H200: the GPU test suite
# (tests/gpu: CPT bf16 + Liger with fused linear cross entropy, CPT resume after SIGTERM, SFT bf16 +
# Liger + packing, eval on CUDA, the bench on the Llama-3.2-1B shape) and then the full CPT benchmark
# (bench/gpu_cpt.py) with whatever time is left. Results go to a folder:
#
#   scripts/gpu_check.sh [RESULTS_DIR]            # default: $OUT, else ./gpu-results
#   scripts/gpu_check.sh --dry-run [RESULTS_DIR]  # no GPU: checks the script itself (suite skips, bench --tiny)
#
# RESULTS_DIR gets env.txt (machine, driver, library versions), pytest.log + pytest.xml, bench.log +
# bench.json, and summary.txt. The exit status is non-zero when a test or the bench failed.
#
# A bare GPU machine (no network) needs the wheels its Python lacks: run scripts/fetch_gpu_wheels.sh
# where pip works, carry .whl/ with the checkout; they are installed into a private folder here, never
# over the machine's own torch/numpy. The repository's packages are used from the checkout (PYTHONPATH).
# PYTHON selects the interpreter (default python3). TOTAL_S overrides the 8-minute total.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
RESULTS=${1:-${OUT:-$PWD/gpu-results}}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-480}
mkdir -p "$RESULTS"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export DILFORGE_GPU_RESULTS="$RESULTS"

if ls .whl/*.whl >/dev/null 2>&1; then
  site=${TMPDIR:-/tmp}/dilforge-gpu-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "gpu_check: installing .whl/ failed" | tee "$RESULTS/summary.txt"; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/shared:$PWD/services/tokenizer:$PWD/services/cpt:$PWD/services/sft:$PWD/services/eval:$PWD/coordinator${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ); git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "nvidia-smi: none"
  "$PY" - <<'PYEOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("transformers", "trl", "peft", "datasets", "liger-kernel", "accelerate", "tokenizers", "numpy", "triton"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} missing")
PYEOF
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"
if [ "$DRY" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device (use --dry-run to check the script on CPU)" | tee "$RESULTS/summary.txt"
  exit 2
fi

# 1. the GPU suite (at most ~4 minutes; each test has its own timeout)
suite_budget=$((TOTAL_S * 60 / 100))
timeout "$suite_budget" "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rA --timeout 240 \
  --junitxml "$RESULTS/pytest.xml" > "$RESULTS/pytest.log" 2>&1
suite_rc=$?
tail -25 "$RESULTS/pytest.log"

# 2. the benchmark with the time left (new points stop 40 s before the end; the JSON is rewritten per point)
left=$((TOTAL_S - SECONDS - 10))
if [ "$DRY" = 1 ]; then bench_args=(--tiny); else bench_args=(--budget-s $((left > 80 ? left - 70 : 10))); fi
timeout "$((left > 30 ? left : 30))" "$PY" bench/gpu_cpt.py "${bench_args[@]}" --json "$RESULTS/bench.json" \
  > "$RESULTS/bench.log" 2>&1
bench_rc=$?
cat "$RESULTS/bench.log" | grep -v Warning

{
  echo "gpu_check $( [ "$DRY" = 1 ] && echo '(dry run, CPU)' ) finished in ${SECONDS}s"
  echo "pytest tests/gpu: exit $suite_rc ($(grep -Eo '[0-9]+ (passed|failed|skipped|error)[a-z]*' "$RESULTS/pytest.log" | tr '\n' ' '))"
  echo "bench/gpu_cpt.py: exit $bench_rc (124 = stopped at the time limit; bench.json holds the points done)"
} | tee "$RESULTS/summary.txt"
[ "$suite_rc" = 0 ] && [ "$bench_rc" = 0 ]
