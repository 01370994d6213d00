#!/bin/sh
# pip install inside an image build: the CA bundle secret when given, local wheels first, and the
# variant's filter on lock files:
#   VARIANT=cpu  drops CUDA-only packages (liger-kernel, triton, nvidia-*): the stages use them on CUDA only
#   VARIANT=gpu  drops torch, triton, nvidia-*: the base image's (AWS DLC) CUDA build of torch stays
set -eu
if [ -s /run/secrets/ca_bundle ]; then
  export PIP_CERT=/run/secrets/ca_bundle SSL_CERT_FILE=/run/secrets/ca_bundle REQUESTS_CA_BUNDLE=/run/secrets/ca_bundle
fi
case "${VARIANT:-cpu}" in
  cpu) drop='^(liger-kernel|triton|nvidia-[a-z0-9-]+)==' ;;
  gpu) drop='^(torch|triton|nvidia-[a-z0-9-]+)==' ;;
  *) echo "pip-install.sh: VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 2 ;;
esac
if [ "${1:-}" = "-r" ]; then
  grep -v -E "$drop" "$2" > /tmp/requirements.lock
  shift 2
  set -- -r /tmp/requirements.lock "$@"
fi
args=""
[ -d /wheels ] && args="--find-links /wheels"
[ -n "${TORCH_INDEX_URL:-}" ] && args="$args --extra-index-url $TORCH_INDEX_URL"
# shellcheck disable=SC2086
exec python3 -m pip install --no-compile --progress-bar off $args "$@"
