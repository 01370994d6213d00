#!/usr/bin/env bash
# The test command (README and CI): every test that needs neither a GPU nor a Docker engine.
#   scripts/test.sh           the full suite (CI)
#   scripts/test.sh --fast    the fast tier: tests/unit without the tests marked slow (no stage run end to end,
#                             no subprocess pipeline); every production module is still imported
#                             (tests/unit/test_imports.py) and unit-tested
# Both run on every core this process may use (`nproc`, pytest-xdist; a test file stays on one worker, so its module
# fixtures are built once); DILFORGE_TEST_WORKERS=N sets the count. Both times, measured, are in
# docs/architecture.md (Tests). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export DILFORGE_DATA=${DILFORGE_DATA:-$(cd .. && pwd)/shared/data}
workers=${DILFORGE_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}  # nproc honours OMP_*
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
marker="not gpu and not docker"
paths=()
if [[ ${1:-} == --fast ]]; then
  marker="$marker and not slow"
  paths=(tests/unit)
  shift
fi
exec .venv/bin/python -m pytest -m "$marker" -n "$workers" --dist loadfile --durations=30 \
  "${paths[@]}" "$@"
