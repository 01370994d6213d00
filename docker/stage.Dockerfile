# The dilforge stage images (curate, tokenizer, cpt, sft, eval: SageMaker bring-your-own-container, `IMAGE train`)
# and the serve image (an OpenAI-compatible server that is also a SageMaker real-time endpoint, `IMAGE serve`),
# from this one file: the build argument STAGE names the service folder, the target picks the command.
#
# Build from the repository root (the context must be the root: shared/, services/ and docker/ are inputs):
#   DOCKER_BUILDKIT=1 docker build -f docker/stage.Dockerfile --build-arg STAGE=cpt -t dilforge-cpt:dev \
#     --secret id=ca_bundle,src=$BUILD_CA_BUNDLE .        # CA bundle only where a proxy needs one
#   ... --build-arg STAGE=serve --target serve -t dilforge-serve:dev .
# or `coordinator images build` / `docker compose build`. CPU torch comes from docker/wheelhouse/ (local
# wheels, git-ignored) or from --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
# GPU variant on the AWS PyTorch training Deep Learning Container (keeps the DLC's CUDA torch):
#   --build-arg BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.9.0-gpu-py312-cu130-ubuntu22.04-sagemaker \
#   --build-arg VARIANT=gpu
# (see docs/containers.md for the tag). The `shared` target does not declare STAGE, so every stage image shares
# its layers (checked by tests/unit/test_images_build.py).
ARG BASE_IMAGE=python:3.11-slim
# A folder of services/; without it the build stops at "services/no-STAGE-build-arg/requirements.lock not found".
ARG STAGE=no-STAGE-build-arg

# The stage's package sources, bind-mounted into the install step below: never in a layer, and that step's
# cache follows this stage's files only.
FROM scratch AS stage-source
ARG STAGE
COPY services/${STAGE} /

FROM ${BASE_IMAGE} AS shared

# cpu: torch's CPU wheel, no CUDA-only packages; gpu: keep the base image's CUDA torch (docker/pip-install.sh).
ARG VARIANT=cpu
ARG TORCH_INDEX_URL=
# expandable_segments: fewer fragmentation OOMs when micro-batches or packed lengths vary (no effect on CPU)
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
WORKDIR /opt/dilforge

# Shared layer 1: pinned third-party libraries (torch, transformers, TRL, PEFT, ...). The CA bundle is a
# BuildKit secret and the wheelhouse a bind mount: neither ends up in a layer.
COPY docker/requirements-common.lock docker/pip-install.sh /opt/dilforge/
RUN --mount=type=secret,id=ca_bundle --mount=type=bind,source=docker/wheelhouse,target=/wheels \
    --mount=type=cache,target=/root/.cache/pip \
    sh /opt/dilforge/pip-install.sh -r /opt/dilforge/requirements-common.lock

# Shared layer 2: dilforge's own library and the container entrypoint (torchrun launcher, signal forwarding).
RUN --mount=type=bind,source=shared,target=/src/shared,rw \
    python3 -m pip install --no-deps --no-build-isolation --no-cache-dir /src/shared
COPY docker/entrypoint.py /usr/local/bin/dilforge-entrypoint

# ---- stage layer ----
FROM shared AS stage
ARG STAGE
COPY services/${STAGE}/requirements.lock /opt/dilforge/requirements-${STAGE}.lock
RUN --mount=type=secret,id=ca_bundle --mount=type=bind,source=docker/wheelhouse,target=/wheels \
    --mount=type=cache,target=/root/.cache/pip \
    sh /opt/dilforge/pip-install.sh -r /opt/dilforge/requirements-${STAGE}.lock
RUN --mount=type=bind,from=stage-source,target=/src/stage,rw \
    python3 -m pip install --no-deps --no-build-isolation --no-cache-dir /src/stage \
    && python3 -c "import dilforge_${STAGE}, dilforge_shared.contract"

ARG GIT_SHA=
ARG IMAGE_VERSION=dev
ENV DILFORGE_STAGE=${STAGE} DILFORGE_GIT_SHA=${GIT_SHA} DILFORGE_IMAGE_VERSION=${IMAGE_VERSION}
LABEL org.opencontainers.image.title="dilforge-${STAGE}" org.opencontainers.image.revision="${GIT_SHA}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" org.opencontainers.image.source="dilforge"
# Exec form: the entrypoint is PID 1, forwards SIGTERM to the stage and exits with its code.
ENTRYPOINT ["python3", "/usr/local/bin/dilforge-entrypoint"]

# The serving image (STAGE=serve): SageMaker hosting runs `IMAGE serve` and talks to port 8080.
FROM stage AS serve
EXPOSE 8080
CMD ["serve"]

# The default target, last: a training stage, `IMAGE train`.
FROM stage AS train
CMD ["train"]
