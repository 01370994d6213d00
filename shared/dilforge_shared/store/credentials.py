"""Credentials registry for S3-compatible stores: the DILFORGE_S3_* keys, else keys this process registered for an
endpoint it provides itself (the compose backend's local SeaweedFS). Never written into os.environ."""

from __future__ import annotations

from ..settings import settings

S3_ENDPOINT_ENV = "DILFORGE_S3_ENDPOINT_URL"
# Credentials for an S3-compatible store only (SeaweedFS, MinIO). Unset = boto3's usual chain (AWS).
S3_KEY_ENV, S3_SECRET_ENV = "DILFORGE_S3_ACCESS_KEY_ID", "DILFORGE_S3_SECRET_ACCESS_KEY"

# Keys for an S3-compatible endpoint this process itself provides (the compose backend's local-only
# SeaweedFS identity), by endpoint URL: used only by clients of that endpoint, and only while the
# DILFORGE_S3_* keys are unset. This replaces writing them into os.environ at run time.
_ENDPOINT_KEYS: dict[str, tuple[str, str, str]] = {}


def use_endpoint_keys(endpoint_url: str, access_key_id: str, secret_access_key: str, region: str = "us-east-1") -> None:
    """Give this process's S3 clients of `endpoint_url` these keys (unless DILFORGE_S3_* keys are set)."""
    _ENDPOINT_KEYS[endpoint_url.rstrip("/")] = (access_key_id, secret_access_key, region)


def endpoint_keys(endpoint_url: str | None) -> dict[str, str]:
    """boto3 client keyword arguments for `endpoint_url`: the DILFORGE_S3_* keys, else registered ones."""
    cfg = settings()
    if cfg.s3_access_key_id and cfg.s3_secret_access_key:
        return {
            "aws_access_key_id": cfg.s3_access_key_id.get_secret_value(),
            "aws_secret_access_key": cfg.s3_secret_access_key.get_secret_value(),
        }
    if endpoint_url and (registered := _ENDPOINT_KEYS.get(endpoint_url.rstrip("/"))):
        key, secret, region = registered
        return {"aws_access_key_id": key, "aws_secret_access_key": secret, "region_name": region}
    return {}
