"""The coordinator's DILFORGE_* settings (pydantic-settings, as `dilforge_shared.settings` for what the stages
read): its work folders, locks and reuse check, the compose backend's docker and images, and the roots a pipeline
config may name as `${...}`. Read with `coordinator_settings()` on each use, so tests can `monkeypatch.setenv`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CoordinatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DILFORGE_", extra="ignore")

    data: Path | None = Field(default=None, description="Root of the data configs name as ${DILFORGE_DATA}.")
    store: str | None = Field(default=None, description="Default artifact store root.")
    workdir: Path = Field(default=Path(".dilforge/work"), description="Local backend work folders and locks.")
    verify_on_reuse: Literal["sha256", "stamp"] = Field(
        default="sha256",
        description="Reuse check of local artifacts: sha256 of every file, or skip the hashing "
        "while size, mtime and inode match the last full check.",
    )
    lock_lease_seconds: float = Field(default=120.0, gt=0, description="Lease of an S3 run lock.")
    docker: str | None = Field(default=None, description="docker client binary; unset = /usr/bin/docker or docker.")
    compose_dir: Path | None = Field(default=None, description="Folder with compose.yaml; unset = the repository.")
    image_tag: str = Field(default="dev", description="Tag of the stage images the compose backend runs.")
    s3_port: int = Field(default=8333, ge=1, le=65535, description="Host port of the compose S3.")
    images_record: Path = Field(
        default=Path(".dilforge/images.json"), description="Where `coordinator images push` records image digests."
    )


def coordinator_settings() -> CoordinatorSettings:
    return CoordinatorSettings()
