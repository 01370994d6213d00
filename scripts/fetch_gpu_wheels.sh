#!/usr/bin/env bash
# Download, into the git-ignored .whl/, the wheels that a bare GPU machine's Python lacks for
# scripts/gpu_check.sh (a PyTorch image: CUDA torch, triton, numpy, pandas, pyarrow, accelerate,
# huggingface-hub, tokenizers, safetensors are expected there; see docs/benchmarks.md). Versions are
# the project's own, read from requirements-dev.lock, so the GPU run tests the code with the libraries
# the CPU suite uses. Target: CPython 3.12 on x86-64 Linux (PY_VERSION to change: the CPU rehearsal
# fetches the same names and versions for its own Python).
#
#   scripts/fetch_gpu_wheels.sh [DEST]     # DEST default .whl/; then carry it to the GPU machine
#
# Then scripts/gpu_wheel_deps.py DEST checks that every requirement of every wheel is carried or on the
# device (pip --no-deps never does) and that the set fits the 64 MiB of one call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
DEST=${1:-.whl}
# pydantic-settings + python-dotenv: shared settings -> contract -> the CPT loop import them (without them
# every GPU test and bench point died with ModuleNotFoundError: pydantic_settings); tabulate: the reports'
# tables (tokenizer, CPT and eval stages import it)
PACKAGES="transformers trl datasets liger-kernel peft pydantic pydantic-core pydantic-settings python-dotenv
annotated-types typing-inspection typing-extensions dill multiprocess tabulate"
pins=()
for name in $PACKAGES; do
  # the lock spells names with - or _ and any case
  pattern=$(echo "$name" | sed 's/[-_]/[-_]/g')
  pin=$(grep -iE "^${pattern}==" requirements-dev.lock | head -1 || true)
  if [ -z "$pin" ]; then echo "fetch_gpu_wheels: $name is not in requirements-dev.lock" >&2; exit 1; fi
  pins+=("$pin")
done
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # this script owns the folder: no stale second version of any wheel
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" -d "$DEST" "${pins[@]}"
ls -la "$DEST"
