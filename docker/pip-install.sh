#!/bin/sh
# pip install inside an image build: the CA bundle secret when given, local wheels first, and the
# variant's filter on lock files:
#   VARIANT=cpu  drops CUDA-only packages (liger-kernel, triton, nvidia-*): the stages use them on CUDA only
#   VARIANT=gpu  keeps the base image's (AWS DLC) core stack exactly as it is: every core package the
#                image already has (torch, torchvision, torchaudio, triton, numpy, pandas, scipy, pyarrow,
#                nvidia-*) is dropped from the lock, pinned as a constraint at the image's own version,
#                and checked unchanged after the install. So the rest of the lock (transformers, TRL, PEFT,
#                liger-kernel, datasets, ...) is resolved against the DLC's torch/numpy, and a pin that
#                would need another torch or numpy fails the build instead of replacing the DLC's stack.
set -eu
if [ -s /run/secrets/ca_bundle ]; then
  export PIP_CERT=/run/secrets/ca_bundle SSL_CERT_FILE=/run/secrets/ca_bundle REQUESTS_CA_BUNDLE=/run/secrets/ca_bundle
fi
core='^(torch|torchvision|torchaudio|triton|numpy|pandas|scipy|pyarrow|nvidia-[a-z0-9-]+)=='
case "${VARIANT:-cpu}" in
  cpu) drop='^(liger-kernel|triton|nvidia-[a-z0-9-]+)==' ;;
  gpu) drop="$core" ;;
  *) echo "pip-install.sh: VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 2 ;;
esac
constraints=""
if [ "${VARIANT:-cpu}" = gpu ]; then
  # the DLC's core packages at their installed versions (names normalised: pip may print Torch or
  # nvidia_cudnn_cu12); `|| true`: grep finds nothing on a base image without them
  python3 -m pip list --format=freeze 2>/dev/null | tr 'A-Z_' 'a-z-' | grep -E "$core" | sort > /tmp/dlc-core.before || true
  constraints="-c /tmp/dlc-core.before"
fi
if [ "${1:-}" = "-r" ]; then
  grep -v -E "$drop" "$2" > /tmp/requirements.lock
  shift 2
  set -- -r /tmp/requirements.lock "$@"
fi
args=""
[ -d /wheels ] && args="--find-links /wheels"
[ -n "${TORCH_INDEX_URL:-}" ] && args="$args --extra-index-url $TORCH_INDEX_URL"
# shellcheck disable=SC2086
python3 -m pip install --no-compile --progress-bar off $args $constraints "$@"
if [ "${VARIANT:-cpu}" = gpu ]; then
  python3 -m pip list --format=freeze 2>/dev/null | tr 'A-Z_' 'a-z-' | grep -E "$core" | sort > /tmp/dlc-core.after || true
  if ! cmp -s /tmp/dlc-core.before /tmp/dlc-core.after; then
    echo "pip-install.sh: the install changed the base image's core stack (before < > after):" >&2
    diff /tmp/dlc-core.before /tmp/dlc-core.after >&2 || true
    exit 1
  fi
fi
