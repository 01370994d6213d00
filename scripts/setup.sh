#!/usr/bin/env bash
# Create .venv and install dilforge (shared, coordinator, the four services) with pinned dependencies.
# --sagemaker: also the SageMaker SDK extra (requirements-sagemaker.txt/.lock; --backend sagemaker and
# sagemaker-local; the test command and CI install it, the main job does not need it). Idempotent. Uses pip (not uv): `pip install torch==2.13.0` takes the local CPU wheel where one exists.
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
if [[ ${1:-} == --sagemaker ]]; then
  .venv/bin/python -m pip install -q -r requirements-sagemaker.txt -c requirements-dev.lock -c requirements-sagemaker.lock
fi
.venv/bin/python -m pip check >/dev/null || { .venv/bin/python -m pip check; exit 1; }
echo "setup: ok ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
