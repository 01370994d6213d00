#!/usr/bin/env bash
# The CPU rehearsal of the GPU machine: everything scripts/gpu_check.sh does there, here, on CPU, in a
# replica of that machine's Python environment, so that a missing wheel or a version conflict fails
# before any device time is spent.
#
#   scripts/gpu_rehearsal.sh [RESULTS_DIR]      # default /tmp/dilforge-gpu-rehearsal
#   scripts/gpu_rehearsal.sh --prepare          # only steps 1-2 (network-bound: CI overlaps them with the tests)
#
# 1. The replica: a venv with the device's own packages at the device's versions
#    (scripts/gpu_device_env.txt: torch 2.11.0 - PyPI's CUDA build, which runs on CPU - triton 3.6.0,
#    transformers 5.17.0, accelerate 1.15.0, ...), cached under $DILFORGE_CACHE (~/.cache/dilforge):
#    ~2.7 GB of wheels downloaded once (not kept: the venv is the cache, ~5.3 GB); rebuilt only when that file changes.
#    Python: the device has 3.12 (3.12.3). This machine's image has a CPython 3.12 that is not on PATH:
#    pyenv's (~/.pyenv/versions/3.12.*, `pyenv versions` lists it); the rehearsal finds python3.12 on
#    PATH or there. Without one (Debian bookworm ships 3.11 only, trixie/sid 3.13+; PyPI's
#    python-build-standalone installers and npm's portable-python download from GitHub at install
#    time, which is unreachable) it falls back to python3.11 with the same package versions, except
#    numpy, whose 2.5.2 has no 3.11 wheel (2.4.6, the project lock's, stands in), and says so.
# 2. The carried set: scripts/fetch_gpu_wheels.sh for the DEVICE (cp312, into .whl/ - what a device
#    call carries), checked by scripts/gpu_wheel_deps.py (every requirement carried or on the device,
#    one version each, within 64 MiB with the working tree); and the same names and versions for the
#    rehearsal's Python when that is not 3.12 (pydantic-core is the only compiled one).
# 3. scripts/gpu_check.sh --dry-run with the replica's python: the wheels installed exactly as on the
#    device (pip --no-index --no-deps --target, first on PYTHONPATH), every production module imported,
#    then the device script's phases on tiny shapes: environment, ceilings, bench/gpu_cpt.py --tiny
#    (one process per point), tests/gpu (CUDA parts skipped; the rehearsal tests run: a wheel removed
#    from the carried set must make the imports fail).
set -euo pipefail
cd "$(dirname "$0")/.."
PREPARE_ONLY=0
if [[ ${1:-} == --prepare ]]; then PREPARE_ONLY=1; shift; fi
RESULTS=${1:-${TMPDIR:-/tmp}/dilforge-gpu-rehearsal}
CACHE=${DILFORGE_CACHE:-$HOME/.cache/dilforge}/gpu-rehearsal
t0=$SECONDS
mkdir -p "$CACHE"

find_python312() {
  local p
  for p in $(command -v python3.12 2>/dev/null) "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if [ -x "$p" ] && "$p" -c 'import sys, venv, ssl; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$p"; return
    fi
  done
}
PY=$(find_python312)
PY=${PY:-$(command -v python3.11 || true)}
[ -n "$PY" ] || { echo "gpu_rehearsal: neither python3.12 nor python3.11 on PATH" >&2; exit 2; }
ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
reqs="$CACHE/device-env-py$ver.txt"
sed 's/ *#.*//; /^$/d' scripts/gpu_device_env.txt > "$reqs"
if [ "$ver" != "3.12" ]; then
  echo "gpu_rehearsal: NOTE the device runs Python 3.12; no 3.12 can be installed here, rehearsing on $ver"
  sed -i 's/^numpy==2\.5\.2$/numpy==2.4.6/' "$reqs"   # numpy 2.5 has no wheel for 3.11
fi
key=$(sha256sum "$reqs" | cut -c1-12)
venv="$CACHE/venv-py$ver-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "gpu_rehearsal: building the device replica $venv (cold: ~2.7 GB of wheels)"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  # straight from the index, no wheel folder kept: 2.7 GB less on disk (CI machines are tight); the venv is the cache
  "$venv/bin/python" -m pip install -q --no-cache-dir --only-binary=:all: -r "$reqs"
  touch "$venv/.complete"
fi
echo "gpu_rehearsal: replica ready at $((SECONDS - t0)) s: $("$venv/bin/python" -c 'import sys, torch, transformers, accelerate; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda build", torch.version.cuda, "transformers", transformers.__version__, "accelerate", accelerate.__version__)')"

# the carried set, for the device (cp312) and, if different, for this Python
PY_VERSION=3.12 PYTHON="$venv/bin/python" bash scripts/fetch_gpu_wheels.sh .whl >/dev/null
"$venv/bin/python" scripts/gpu_wheel_deps.py .whl --python 3.12
wheels=.whl
if [ "$ver" != "3.12" ]; then
  wheels="$CACHE/whl-py$ver"
  rm -rf "$wheels"
  PY_VERSION=$ver PYTHON="$venv/bin/python" bash scripts/fetch_gpu_wheels.sh "$wheels" >/dev/null
  "$venv/bin/python" scripts/gpu_wheel_deps.py "$wheels" --python "$ver" --limit-mib 1e9 >/dev/null
fi
echo "gpu_rehearsal: carried wheels ready at $((SECONDS - t0)) s"
if ((PREPARE_ONLY)); then echo "gpu_rehearsal: prepared (--prepare): replica and carried wheels only"; exit 0; fi

rm -rf "$RESULTS"
export DILFORGE_REHEARSAL_WHEELS="$PWD/$wheels" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
[[ "$wheels" = /* ]] && export DILFORGE_REHEARSAL_WHEELS="$wheels"
PYTHON="$venv/bin/python" WHEELS="$wheels" TOTAL_S=${TOTAL_S:-900} bash scripts/gpu_check.sh --dry-run "$RESULTS"
echo "gpu_rehearsal: passed in $((SECONDS - t0)) s (python $ver; results in $RESULTS)"
