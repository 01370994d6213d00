"""Run each stage as a one-off `docker compose run` of its image, against the compose S3 (SeaweedFS).

The SageMaker contract on this machine: a private /opt/ml root per job bind-mounted into the container, which
runs `IMAGE train` and publishes to the compose S3. Data under ${DILFORGE_DATA} is mounted read-only at the
same path, so artifact ids match a local run's. The coordinator reaches S3 on the host port, containers as s3."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from dilforge_shared.contract import OptMl
from dilforge_shared.errors import DilforgeError
from dilforge_shared.store import use_endpoint_keys

from ..config import PipelineConfig
from ..pipeline import StageFailed, StageJob, image_of, module_env
from ..settings import coordinator_settings
from .local import run_in_work_folder

log = logging.getLogger("dilforge.coordinator.compose")

ROOT = Path(__file__).resolve().parents[3]
S3_ACCESS_KEY = "dilforge"  # docker/seaweedfs-identities.json: local-only identity
S3_SECRET_KEY = "dilforge-local-only"
CONTAINER_ENDPOINT = "http://s3:8333"
DEFAULT_BUCKET = "dilforge"


def docker_binary() -> str:
    """Debian's client matches the engine here; /usr/local/bin/docker may refuse BuildKit (see container-env.sh)."""
    if configured := coordinator_settings().docker:
        return configured
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def ensure_bucket(client, bucket: str, timeout_s: int = 60) -> None:
    """Create `bucket` unless it exists, then wait (botocore's `bucket_exists` waiter) until S3 serves it."""
    from botocore.exceptions import ClientError, WaiterError

    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise DilforgeError(f"compose S3: cannot create bucket {bucket!r}: {exc}") from None
    try:
        client.get_waiter("bucket_exists").wait(Bucket=bucket, WaiterConfig={"Delay": 1, "MaxAttempts": timeout_s})
    except WaiterError as exc:
        raise DilforgeError(f"compose S3: bucket {bucket!r} not available after {timeout_s} s: {exc}") from None


class ComposeBackend:
    name = "compose"

    def __init__(
        self,
        workdir: Path | None = None,
        tag: str | None = None,
        s3_port: int | None = None,
        docker: str | None = None,
        up: bool = True,
        data_root: Path | None = None,
    ):
        env = coordinator_settings()
        self.project_dir = Path(env.compose_dir or ROOT).resolve()
        self.workdir = Path(workdir or env.workdir).resolve() / "compose"
        self.tag = tag or env.image_tag
        self.s3_port = int(s3_port or env.s3_port)
        self.data_root = data_root or coordinator_settings().data
        self.docker = docker or docker_binary()
        self.up = up
        self._s3_ready = False

    @property
    def host_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def compose_cmd(self, *args: str) -> list[str]:
        project = self.project_dir
        return [self.docker, "compose", "--project-directory", str(project), "-f", str(project / "compose.yaml"), *args]

    def compose_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            **({"DILFORGE_DATA": str(self.data_root)} if self.data_root else {}),
            "DILFORGE_IMAGE_TAG": self.tag,
            "DILFORGE_S3_PORT": str(self.s3_port),
            "DILFORGE_UID": str(os.getuid()),
            "DILFORGE_GID": str(os.getgid()),
        }
        return {**env, **(extra or {})}

    def prepare(self, pipeline: PipelineConfig) -> PipelineConfig:
        """Point the pipeline at the compose S3 unless it already names an S3 store with an endpoint."""
        # The compose S3's local-only identity, for this process's own S3 clients of that endpoint only
        # (unless the user set DILFORGE_S3_* keys); the user's AWS credentials (AWS_*) are neither read nor
        # sent to it. The stage containers get the same identity from compose.yaml. os.environ is not written.
        use_endpoint_keys(self.host_endpoint, S3_ACCESS_KEY, S3_SECRET_KEY)
        store = pipeline.store
        if not (store.uri.startswith("s3://") and store.s3_endpoint_url):
            store = store.model_copy(
                update={"uri": f"s3://{DEFAULT_BUCKET}/store", "s3_endpoint_url": self.host_endpoint}
            )
            print(f"[compose] artifact store: {store.uri} at {store.s3_endpoint_url} (the compose S3)")
            pipeline = pipeline.model_copy(update={"store": store})
        if store.s3_endpoint_url.rstrip("/") == self.host_endpoint:
            # up and healthy before the coordinator reads the run record or any manifest from it
            self.ensure_s3(store.uri.removeprefix("s3://").split("/", 1)[0])
        return pipeline

    def ensure_s3(self, bucket: str | None = None) -> None:
        """Start the S3 service (healthy) and create the bucket the store names."""
        if self._s3_ready:
            return
        if self.up:
            proc = subprocess.run(
                self.compose_cmd("up", "-d", "--wait", "s3"), env=self.compose_env(), capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise DilforgeError(f"docker compose up s3 failed: {proc.stderr.strip()[-2000:]}")
        if bucket:
            import boto3
            from botocore.config import Config

            # botocore retries (standard mode: connection errors, 5xx, throttling, with backoff) cover an S3 that
            # is healthy but still warming up; ensure_bucket's waiter covers the bucket becoming visible.
            client = boto3.client(
                "s3",
                endpoint_url=self.host_endpoint,
                region_name="us-east-1",
                aws_access_key_id=S3_ACCESS_KEY,
                aws_secret_access_key=S3_SECRET_KEY,
                config=Config(retries={"mode": "standard", "max_attempts": 10}),
            )
            ensure_bucket(client, bucket)
        self._s3_ready = True

    def image_ref(self, stage: str) -> str:
        """What the manifest cites: the image tag and its content id (a registry digest once pushed)."""
        from ..images import inspect

        ref = f"dilforge-{stage}:{self.tag}"
        try:
            info = inspect(ref, self.docker)
        except DilforgeError:
            tag = f" --tag {self.tag}" if self.tag != "dev" else ""
            raise StageFailed(
                stage, f"image {ref} is not built: coordinator images build --stage {stage}{tag}"
            ) from None
        digests = info.get("RepoDigests") or []
        return digests[0] if digests else f"{ref}@{info['Id']}"

    def mounts(self, job: StageJob) -> list[str]:
        """Read-only mounts for local data outside ${DILFORGE_DATA} (same path inside as outside)."""
        data_root = self.data_root
        extra: set[str] = set()
        for source in job.config.file_sources():
            uri = source.uri.removeprefix("file://")
            if "://" in uri or not uri.startswith("/"):
                continue
            if data_root and Path(uri).resolve().is_relative_to(Path(data_root).resolve()):
                continue
            path = Path(uri.split("*", 1)[0])
            extra.add(str(path if path.is_dir() else path.parent))
        return [arg for p in sorted(extra) for arg in ("-v", f"{p}:{p}:ro")]

    def run(self, job: StageJob) -> None:
        if not job.store_uri.startswith("s3://"):
            raise StageFailed(
                job.stage,
                f"the compose backend needs an s3:// store (got {job.store_uri}); "
                f"run through `coordinator ... --backend compose`, which uses the compose S3",
            )
        self.ensure_s3(job.store_uri.removeprefix("s3://").split("/", 1)[0])

        def command(opt: OptMl) -> tuple[list[str], dict[str, str]]:
            for d in (opt.model_dir, opt.output_dir, opt.checkpoint_dir):  # mounted: made as this user
                d.mkdir(parents=True, exist_ok=True)
            service = image_of(job.stage)
            env = self.compose_env({"DILFORGE_JOB_DIR": str(opt.root), "DILFORGE_IMAGE": self.image_ref(service)})
            module = [arg for k, v in module_env(job.stage).items() for arg in ("-e", f"{k}={v}")]
            cmd = self.compose_cmd("run", "--rm", "--no-deps", *module, *self.mounts(job), service, "train")
            log.info("compose: %s", " ".join(cmd))
            return cmd, env

        endpoint = CONTAINER_ENDPOINT if job.s3_endpoint_url == self.host_endpoint else job.s3_endpoint_url
        run_in_work_folder(job, self.workdir, endpoint, command)
