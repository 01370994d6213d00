#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in ONE call of at most 8 minutes on one H200 (scripts/gpu_check.py
# says what each phase measures): environment -> ceilings (matmul, HBM, attention per SDPA backend on
# the model's GQA call) -> the CPT stage's own step (plain / liger at the batch fitted on a warm model)
# -> the GPU test suite. The 8 minutes (TOTAL_S) count from this script's first line; each phase's
# budget is checked before it starts; summary.txt is rewritten after every phase and the logs (kept
# outside the results folder) are tarred into it on exit and on SIGTERM/SIGINT: a killed run still
# leaves at most 8 files, a summary among them. Device tool: timeout_s = TOTAL_S + 60 (540).
#
#   scripts/gpu_check.sh [RESULTS_DIR]            # default: $OUT, else ./gpu-results
#   scripts/gpu_check.sh --dry-run [RESULTS_DIR]  # no GPU: the same phases on tiny shapes (the CPU rehearsal)
#   scripts/gpu_check.sh --second [RESULTS_DIR]   # optional second call: compile_flce + flex attention
#
# A bare GPU machine (no network) lacks some wheels: scripts/fetch_gpu_wheels.sh (where pip works) puts
# them in .whl/, carried with the checkout. They are installed here exactly so: pip --no-index --no-deps
# --target a private folder put first on PYTHONPATH, never over the machine's own torch/numpy; then every
# production module is imported before any device time is spent on phases. PYTHON selects the
# interpreter (default python3); TOTAL_S the budget (480); WHEELS the wheel folder (.whl).
export DILFORGE_GPU_T0=${DILFORGE_GPU_T0:-$(date +%s.%N)}  # the deadline counts from here
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY+=(--dry-run); shift ;;
    --second) DRY+=(--second); shift ;;
    *) break ;;
  esac
done
RESULTS=${1:-${OUT:-$PWD/gpu-results}}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-480}
WHEELS=${WHEELS:-.whl}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
stopped_in_setup() {
  echo "gpu_check: stopped by a signal during setup (wheels, imports, CUDA probe), $(($(date +%s) - ${DILFORGE_GPU_T0%.*})) s after the start" | tee "$RESULTS/summary.txt"
  exit 143
}
trap stopped_in_setup TERM INT HUP

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
if [[ " ${DRY[*]} " != *" --dry-run "* ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device (use --dry-run to check the script on CPU)" | tee "$RESULTS/summary.txt"
  exit 2
fi
trap - TERM INT HUP  # from here gpu_check.py packs on a signal
exec "$PY" scripts/gpu_check.py "$RESULTS" --total-s "$TOTAL_S" "${DRY[@]}"
