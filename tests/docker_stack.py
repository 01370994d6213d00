"""What the container tests (tests/docker) share: the docker binary, the image tag under test and the compose
stack's S3 as the host reaches it (its local-only keys are the compose backend's own)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dilforge_coordinator.backends.compose import S3_ACCESS_KEY, S3_SECRET_KEY

DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
TAG = os.environ.get("DILFORGE_IMAGE_TAG", "dev")
S3 = {
    "endpoint_url": "http://127.0.0.1:8333",
    "aws_access_key_id": S3_ACCESS_KEY,
    "aws_secret_access_key": S3_SECRET_KEY,
    "region_name": "us-east-1",
}
