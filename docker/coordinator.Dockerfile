# The coordinator CLI without torch: inspect manifests and runs in the compose S3
# (`docker compose run --rm coordinator status RUN --store s3://dilforge/store`).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /opt/dilforge
COPY docker/requirements-coordinator.lock docker/pip-install.sh /opt/dilforge/
RUN --mount=type=secret,id=ca_bundle --mount=type=cache,target=/root/.cache/pip \
    sh /opt/dilforge/pip-install.sh -r /opt/dilforge/requirements-coordinator.lock
# The stage packages without their dependencies: the coordinator validates every stage's config section
# (`dilforge_<stage>.config`, pydantic and dilforge_shared only) and never runs a stage here.
RUN --mount=type=bind,source=shared,target=/src/shared,rw --mount=type=bind,source=coordinator,target=/src/coordinator,rw \
    --mount=type=bind,source=services,target=/src/services,rw \
    python3 -m pip install --no-deps --no-build-isolation --no-cache-dir /src/shared /src/coordinator \
        /src/services/curate /src/services/tokenizer /src/services/cpt /src/services/sft /src/services/eval \
    && coordinator --help >/dev/null \
    && python3 -c "import dilforge_coordinator.config, sys; assert 'torch' not in sys.modules"
ENTRYPOINT ["coordinator"]
CMD ["--help"]
