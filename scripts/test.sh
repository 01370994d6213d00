#!/usr/bin/env bash
# The test command (README and CI): every test that needs neither a GPU nor a Docker engine.
set -euo pipefail
cd "$(dirname "$0")/.."
export DILFORGE_DATA=${DILFORGE_DATA:-$(cd .. && pwd)/shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -m "not gpu and not docker" --durations=30 "$@"
