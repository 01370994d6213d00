"""Artifact store over a local directory (path or file://) and S3 (s3://, via boto3).

Publishing is atomic for readers: files go to a fresh `data-<uuid>/`, then the manifest is written last,
create-only, so a crash leaves no manifest and of two concurrent publishers exactly one wins. Reading verifies
every file's size and sha256. Submodules, each imported on its own: backends (with the S3 keys), artifacts."""
