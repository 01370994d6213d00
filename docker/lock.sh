#!/usr/bin/env bash
# Every lock file, compiled from its input by uv (`uv pip compile`; uv is pinned in requirements-dev.txt):
#   requirements-dev.txt → requirements-dev.lock: the dev/CI venv (scripts/setup.sh installs with it as constraints);
#   then, each constrained by requirements-dev.lock, so the images and the SDK extra pin exactly the versions the
#   tests run with: requirements-sagemaker.txt → requirements-sagemaker.lock,
#   docker/requirements-{common,coordinator}.in → .lock, services/<stage>/requirements.txt → requirements.lock.
# Target: CPython 3.11 on x86-64 Linux (the venv and the CPU images) with torch's CPU build: the wheel in
# $BUILD_WHEELHOUSE when it has one, else the one pip fetches as scripts/setup.sh installs it (the machine's local
# wheels, or $TORCH_INDEX_URL). A lock keeps the versions it already pins unless its input asks for others (uv
# prefers the output file's pins); extra arguments go to uv (--upgrade-package NAME moves one package).
#
#   bash docker/lock.sh            # write every lock
#   bash docker/lock.sh --check    # write nothing; exit 1 naming each lock a fresh compile would change
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-$( [[ -x .venv/bin/uv ]] && echo .venv/bin/uv || command -v uv || true)}
[[ -n $UV ]] || { echo "lock.sh: uv not found (bash scripts/setup.sh installs it into .venv)" >&2; exit 2; }
check=0
if [[ ${1:-} == --check ]]; then check=1; shift; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
WHEELS=${BUILD_WHEELHOUSE:-}
if [[ -z $WHEELS ]] || ! compgen -G "$WHEELS/torch-*+cpu-cp311-*.whl" >/dev/null; then
  WHEELS=$tmp/wheels
  torch=$(grep -m1 '^torch==' requirements-dev.txt)
  "${PYTHON:-.venv/bin/python}" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} --dest "$WHEELS" "$torch"
  if ! compgen -G "$WHEELS/torch-*+cpu-*.whl" >/dev/null; then
    echo "lock.sh: pip found no CPU build of $torch; set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
    exit 2
  fi
fi
stale=0

compile() {  # INPUT LOCK [uv options]
  local input=$1 lock=$2 out=$2
  shift 2
  if ((check)); then
    out=$tmp/${lock//\//_}
    if [[ -f $lock ]]; then cp "$lock" "$out"; fi
  fi
  "$UV" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links "$WHEELS" \
    --no-annotate --custom-compile-command "bash docker/lock.sh" "$@" "$input" --output-file "$out"
  if ((check)) && ! cmp -s "$lock" "$out"; then
    echo "lock.sh: $lock is out of date with $input; run: bash docker/lock.sh"
    diff "$lock" "$out" || true
    stale=1
  fi
}

compile requirements-dev.txt requirements-dev.lock "$@"
compile requirements-sagemaker.txt requirements-sagemaker.lock --constraint requirements-dev.lock "$@"
for name in common coordinator; do
  compile "docker/requirements-$name.in" "docker/requirements-$name.lock" --constraint requirements-dev.lock "$@"
done
for req in services/*/requirements.txt; do
  compile "$req" "${req%.txt}.lock" --constraint requirements-dev.lock "$@"
done
exit $stale
