#!/usr/bin/env bash
# Container part of CI (.ci/run calls it): Docker engine + Compose v2 + local python:3.11-slim base
# (../shared/tools/container-env.sh), the images (shared layers built once), then the tiny pipeline end to
# end with `coordinator run-all --backend compose`, and the serve image as SageMaker runs it (tests/docker),
# then through the SageMaker SDK's local container mode (`--backend sagemaker-local`: CPT on 2 hosts, a rerun
# that reuses everything, a 1-host reference, a spot SIGTERM survived, a broken image contract; needs the SDK
# extra, setup.sh --sagemaker). Prints image sizes and build times.
# Budget: about 15 minutes on 2 cores from a machine without Docker.
#
#   scripts/ci_containers.sh                 # PYTHON=.venv/bin/python by default
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
SETUP=${CONTAINER_ENV:-../shared/tools/container-env.sh}
start=$(date +%s)
step() { echo "== ci_containers: $* ($(( $(date +%s) - start )) s)"; }

step "container engine, compose, base image"
bash "$SETUP" >/dev/null
eval "$(bash "$SETUP" --env)"
export DILFORGE_REQUIRE_DOCKER=1 DOCKER_BUILDKIT=1 DILFORGE_IMAGES_RECORD=${DILFORGE_IMAGES_RECORD:-.dilforge/images.json}

step "images"
stages=(s3)
for s in curate tokenizer cpt sft eval serve; do [[ -f services/$s/pyproject.toml ]] && stages+=("$s"); done
args=(); for s in "${stages[@]}"; do args+=(--stage "$s"); done
"$PYTHON" -m dilforge_coordinator.cli images build "${args[@]}"

step "compose pipeline end to end; the serve image's /ping + /invocations (tests/docker)"
status=0
"$PYTHON" -m pytest -q -m docker tests/docker --ignore=tests/docker/test_sagemaker_local_mode.py \
  --ignore=tests/docker/test_curate_sagemaker_local.py -p no:cacheprovider \
  || status=$?

step "SageMaker local mode: az-tiny (CPT on 2 hosts), rerun, 1-host reference, spot interruption"
AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1} "$PYTHON" -m pytest -q -s -m docker \
  tests/docker/test_sagemaker_local_mode.py -p no:cacheprovider || status=$?

step "SageMaker local mode: the curate stage as Processing jobs on 2 instances, same output as the local run"
AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1} "$PYTHON" -m pytest -q -m docker \
  tests/docker/test_curate_sagemaker_local.py -p no:cacheprovider || status=$?

step "image sizes and build times"
"$PYTHON" - <<'PY'
import json, os
record = json.load(open(os.environ["DILFORGE_IMAGES_RECORD"]))
for name, entry in sorted(record.items()):
    b = entry.get("build")
    if b:
        print(f"  {b['ref']:<40} {b['size_bytes'] / 1e9:6.2f} GB  built in {b['build_s']:6.1f} s")
PY
/usr/bin/docker system df
/usr/bin/docker compose down --remove-orphans >/dev/null 2>&1 || true
step "done (exit $status)"
exit $status
