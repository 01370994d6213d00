#!/usr/bin/env python3
"""Container entrypoint of every dilforge stage image: `IMAGE train`, as SageMaker runs it.

`train` runs the image's stage (`DILFORGE_STAGE`) as a child and stays PID 1 to forward SIGTERM (stop, spot
interruption), exiting with the stage's code; other commands are exec'd unchanged. Multi-process stages start
torchrun themselves; single-host stages exit 0 on other hosts unless DILFORGE_MULTI_HOST=1.
DILFORGE_CHECKPOINT_SYNC_URI syncs checkpoints where the platform does not (the SDK's local mode)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

MULTI_HOST_STAGES = {"cpt"}  # stages that use every host of a multi-host job themselves
CHECKPOINT_SYNC_ENV = "DILFORGE_CHECKPOINT_SYNC_URI"  # set by `--backend sagemaker-local` only
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

log = logging.getLogger("dilforge.entrypoint")


def plan(stage: str, env: Mapping[str, str] = os.environ) -> tuple[list[str] | None, str]:
    """(command, or None when this host has nothing to do; description) for `train`."""
    from dilforge_shared.contract import OptMl, ResourceConfig

    module = env.get("DILFORGE_STAGE_MODULE") or f"dilforge_{stage}"
    resources = ResourceConfig.load(OptMl(Path(env.get("DILFORGE_OPT_ML", "/opt/ml"))))
    if resources.node_rank > 0 and stage not in MULTI_HOST_STAGES and env.get("DILFORGE_MULTI_HOST") != "1":
        return None, f"{stage} runs on the first host only; {resources.current_host} has nothing to do"
    return (
        [sys.executable, "-m", module, "train"],
        f"python -m {module} train (host {resources.node_rank + 1} of {len(resources.hosts)})",
    )


def supervise(cmd: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run cmd as our child, forward signals to it, reap every child (we may be PID 1), return its status.
    The handlers are in place before the child starts: a signal that arrives first is held and sent to it."""
    child: subprocess.Popen | None = None
    held: list[int] = []

    def forward(signum, frame):
        if child is None:
            held.append(signum)
            return
        log.warning("entrypoint: forwarding %s to the stage (pid %d)", signal.Signals(signum).name, child.pid)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    child = subprocess.Popen(cmd, env=env)
    for signum in held:
        forward(signum, None)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return child.returncode if child.returncode is not None else 1
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            code = child.returncode
            return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=os.environ.get("DILFORGE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    if not argv or argv[0] != "train":
        if not argv:
            print("usage: IMAGE train   (or any command to run it instead)", file=sys.stderr)
            return 2
        os.execvp(argv[0], argv)
    stage = os.environ.get("DILFORGE_STAGE")
    if not stage:
        print("entrypoint: DILFORGE_STAGE is not set (the stage Dockerfile sets it)", file=sys.stderr)
        return 2
    try:
        cmd, desc = plan(stage)
    except Exception as exc:  # the stage never started: leave SageMaker a reason
        from dilforge_shared.contract import OptMl, write_failure

        write_failure(OptMl.from_env(), f"entrypoint: {exc}")
        log.error("entrypoint: %s", exc)
        return 1
    log.info("entrypoint: %s", desc)
    if cmd is None:
        return 0
    sync = os.environ.get(CHECKPOINT_SYNC_ENV)
    if sync:
        sync_checkpoints(sync, "restore")
    code = supervise(cmd + argv[1:])
    if sync:
        sync_checkpoints(sync, "save")
    return code


def sync_checkpoints(uri: str, direction: str) -> None:
    """SageMaker's CheckpointConfig where nothing else does it (the SDK's local mode): `restore` fills
    /opt/ml/checkpoints from the S3 prefix before the stage, `save` uploads what changed after it (also after a
    SIGTERM); every host uses the same prefix and nothing is deleted, as on SageMaker."""
    from dilforge_shared.contract import OptMl
    from dilforge_shared.store import open_backend

    opt = OptMl.from_env()
    endpoint = (opt.read_json("hyperparameters.json", {}) or {}).get("s3_endpoint_url") or None
    backend = open_backend(uri, endpoint)
    local = opt.checkpoint_dir
    try:
        if direction == "restore":
            keys = [k for k in backend.list("") if not k.endswith("/")]
            for key in keys:
                if not (local / key).is_file() or (local / key).stat().st_size != backend.size(key):
                    backend.download_file(key, local / key)
            log.info("entrypoint: restored %d checkpoint files from %s", len(keys), uri)
        else:
            files = [p for p in local.rglob("*") if p.is_file()] if local.is_dir() else []
            sent = 0
            for path in files:
                key = str(path.relative_to(local))
                if not backend.exists(key) or backend.size(key) != path.stat().st_size:
                    backend.upload_file(key, path)
                    sent += 1
            log.info("entrypoint: saved %d of %d checkpoint files to %s", sent, len(files), uri)
    except Exception as exc:  # a failed sync must not hide the stage's own exit status
        log.error("entrypoint: checkpoint %s with %s failed: %s", direction, uri, exc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
