#!/usr/bin/env bash
# Create .venv and install dilforge (shared, coordinator, the four services) with pinned dependencies.
# --sagemaker: also the SageMaker SDK extra (requirements-sagemaker.txt/.lock; --backend sagemaker and
# sagemaker-local; the test command and CI install it, the main job does not need it).
# --export: also llama.cpp's runtime (requirements-export.txt: llama-cpp-python built from source, several
# minutes on 2 cores) for `coordinator export --quant q4_k_m` and the GGUF parity tests; the test command and CI
# install it. Idempotent. Uses pip (not uv): `pip install torch==2.13.0` takes the local CPU wheel where one exists.
# Elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, or PyPI serves the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
.venv/bin/python -m pip install -q -r requirements-dev.txt -c requirements-dev.lock
editable=(-e shared -e coordinator)
for svc in services/*/; do [[ -f $svc/pyproject.toml ]] && editable+=(-e "$svc"); done
.venv/bin/python -m pip install -q --no-deps "${editable[@]}"
for extra in "$@"; do
  case "$extra" in
    --sagemaker)
      .venv/bin/python -m pip install -q -r requirements-sagemaker.txt -c requirements-dev.lock -c requirements-sagemaker.lock ;;
    --export)
      # CPU build; no -march=native, so the wheel pip caches runs on any x86-64 machine this user has
      CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF"} CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        .venv/bin/python -m pip install -q -r requirements-export.txt -c requirements-dev.lock ;;
    *) echo "setup.sh: unknown option $extra (--sagemaker, --export)" >&2; exit 2 ;;
  esac
done
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check; exit 1; }
echo "setup: ok ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
