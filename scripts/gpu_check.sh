#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in ONE call of at most 8 minutes on one H200 (scripts/gpu_check.py
# says what each phase measures): environment -> ceilings (matmul, HBM, attention per SDPA backend) ->
# the CPT stage's own step (plain / liger / compile_flce at the bisected max micro-batch) -> the GPU
# test suite. Each phase is clipped to the time left; the summary table is printed last; the results
# folder holds at most 8 files (logs tarred).
#
#   scripts/gpu_check.sh [RESULTS_DIR]            # default: $OUT, else ./gpu-results
#   scripts/gpu_check.sh --dry-run [RESULTS_DIR]  # no GPU: the same phases on tiny shapes (the CPU rehearsal)
#
# A bare GPU machine (no network) lacks some wheels: scripts/fetch_gpu_wheels.sh (where pip works) puts
# them in .whl/, carried with the checkout. They are installed here exactly so: pip --no-index --no-deps
# --target a private folder put first on PYTHONPATH, never over the machine's own torch/numpy; then every
# production module is imported before any device time is spent on phases. PYTHON selects the
# interpreter (default python3); TOTAL_S the budget (480); WHEELS the wheel folder (.whl).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
RESULTS=${1:-${OUT:-$PWD/gpu-results}}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-480}
WHEELS=${WHEELS:-.whl}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  site=${GPU_SITE:-${TMPDIR:-/tmp}/dilforge-gpu-site}
  rm -rf "$site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl \
    || { echo "gpu_check: installing $WHEELS/ failed" | tee "$RESULTS/summary.txt"; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/shared:$PWD/services/tokenizer:$PWD/services/cpt:$PWD/services/sft:$PWD/services/eval${PYTHONPATH:+:$PYTHONPATH}"

# every production module the device runs, imported now: a missing wheel fails here, in seconds
"$PY" scripts/gpu_imports.py || { echo "gpu_check: a production module does not import (above)" | tee "$RESULTS/summary.txt"; exit 2; }
if [ ${#DRY[@]} = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device (use --dry-run to check the script on CPU)" | tee "$RESULTS/summary.txt"
  exit 2
fi
exec "$PY" scripts/gpu_check.py "$RESULTS" --total-s "$TOTAL_S" "${DRY[@]}"
