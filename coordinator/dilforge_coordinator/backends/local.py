"""Run a stage in a subprocess with a private /opt/ml root, `<workdir>/<stage>-<artifact_id>/`: kept after a
failure (a rerun resumes from its checkpoints), flocked while in use, marked (`WORK_MARKER`) for `gc`. The process
reads /dev/null, runs in its own session (Ctrl-C reaches the coordinator, which forwards SIGTERM, then SIGKILL) and
dies with the coordinator (no orphan)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from dilforge_shared.contract import OPT_ML_ENV, OptMl
from dilforge_shared.locks import FileLock
from dilforge_shared.workers import die_with_parent

from ..pipeline import STAGE_MODULES, StageCancelled, StageFailed, StageJob, build_hyperparameters
from ..settings import coordinator_settings

WORK_MARKER = ".dilforge-work"


@contextlib.contextmanager
def work_folder(workdir: Path, stage: str, artifact_id: str) -> Iterator[tuple[Path, FileLock]]:
    """`<workdir>/<stage>-<artifact_id>/`, created with its marker and held (flocked) while the stage runs."""
    root = workdir / f"{stage}-{artifact_id}"
    lock = FileLock(workdir / f"{stage}-{artifact_id}.lock")
    lock.acquire(
        on_wait=lambda holder: print(
            f"[{stage}] waiting for process {holder.get('pid')} on {holder.get('host')}, which holds {root}",
            flush=True,
        )
    )
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / WORK_MARKER).write_text(f"{stage} {artifact_id}\n")
        yield root, lock
    finally:
        lock.release()


def write_inputs(opt: OptMl, hyperparameters: dict[str, str], resource: dict | None = None) -> None:
    """What SageMaker lays down in /opt/ml before the container starts (here, or a test standing in for it)."""
    opt.config_dir.mkdir(parents=True, exist_ok=True)
    (opt.config_dir / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    resource = resource or {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"}
    (opt.config_dir / "resourceconfig.json").write_text(json.dumps(resource))


class LocalBackend:
    name = "local"

    def __init__(self, workdir: Path | None = None, python: str | None = None):
        self.workdir = Path(workdir or coordinator_settings().workdir).resolve()
        self.python = python or sys.executable

    def run(self, job: StageJob) -> None:
        def command(opt: OptMl) -> tuple[list[str], dict[str, str]]:
            return [self.python, "-m", STAGE_MODULES[job.stage], "train"], {**os.environ, OPT_ML_ENV: str(opt.root)}

        run_in_work_folder(job, self.workdir, job.s3_endpoint_url, command)


def run_in_work_folder(
    job: StageJob,
    workdir: Path,
    endpoint_url: str | None,
    command: Callable[[OptMl], tuple[list[str], dict[str, str]]],
) -> None:
    """Write the stage's request into its work folder's /opt/ml and run `command(opt)` (argv, environment) there;
    the stage's failure file, or how the process ended, is the reason when it fails."""
    with work_folder(workdir, job.stage, job.artifact_id) as (root, lock):
        opt = OptMl(root)
        opt.failure_file.unlink(missing_ok=True)
        shutil.rmtree(opt.model_dir, ignore_errors=True)
        hp = build_hyperparameters(job.config, job.artifact_uri, job.run_id, job.inputs, endpoint_url)
        write_inputs(opt, hp)
        returncode, stopped_by = run_child(*command(opt), pass_fds=(lock.fd,))
    if stopped_by is not None:
        raise StageCancelled(
            job.stage,
            f"cancelled by {signal.Signals(stopped_by).name}; work folder {root} "
            "kept, a rerun resumes from its checkpoints",
        )
    if returncode != 0:
        reason = opt.failure_file.read_text() if opt.failure_file.exists() else _exit_reason(returncode)
        raise StageFailed(job.stage, reason)
    shutil.rmtree(root, ignore_errors=True)


def run_child(cmd: Sequence[str], env: dict[str, str], pass_fds: Sequence[int] = ()) -> tuple[int, int | None]:
    """Run to completion; returns (exit code, the first signal that asked us to stop, or None)."""
    proc = subprocess.Popen(
        list(cmd),
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),  # noqa: PLW1509 - prctl only
    )
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        while True:
            try:
                returncode = proc.wait()
                break
            except KeyboardInterrupt:  # a SIGINT that raced the handler install
                forward(signal.SIGINT, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return returncode, (received[0] if received else None)


def _exit_reason(returncode: int) -> str:
    """How a stage process ended: a signal as Python reports it (-n), or as a container's exit code (128 + n)."""
    signum = -returncode if returncode < 0 else returncode - 128
    if signum not in signal.valid_signals():
        return f"exit code {returncode}"
    name = signal.Signals(signum).name
    hint = " (the kernel's OOM killer sends this when memory runs out)" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}" if returncode < 0 else f"exit code {returncode}: killed by {name}{hint}"
