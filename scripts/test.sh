#!/usr/bin/env bash
# The test command (README and CI): every test that needs neither a GPU nor a Docker engine.
#   scripts/test.sh           the full suite (CI)
#   scripts/test.sh --fast    the fast tier: no test marked slow (stage runs, subprocess pipelines); every
#                             production module is still imported and unit-tested (tests/unit/test_imports.py)
# Both times, measured, are in docs/architecture.md (Tests). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export DILFORGE_DATA=${DILFORGE_DATA:-$(cd .. && pwd)/shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
marker="not gpu and not docker"
if [[ ${1:-} == --fast ]]; then
  marker="$marker and not slow"
  shift
fi
exec .venv/bin/python -m pytest -m "$marker" --durations=30 "$@"
