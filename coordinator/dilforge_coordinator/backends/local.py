"""Run a stage's container entrypoint in a subprocess, with a private /opt/ml root.

The /opt/ml root lives at `<workdir>/<stage>-<artifact_id>/` and is kept after a failure, so
rerunning the same stage resumes from its checkpoints; it is removed after success.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from dilforge_shared.contract import OPT_ML_ENV, OptMl, build_hyperparameters

from ..pipeline import STAGE_MODULES, StageFailed, StageJob


class LocalBackend:
    name = "local"

    def __init__(self, workdir: Path | None = None, python: str | None = None, keep: bool = False):
        self.workdir = Path(workdir or os.environ.get("DILFORGE_WORKDIR", ".dilforge/work")).resolve()
        self.python = python or sys.executable
        self.keep = keep

    def run(self, job: StageJob) -> None:
        opt = OptMl(self.workdir / f"{job.stage}-{job.artifact_id}")
        if opt.failure_file.exists():
            opt.failure_file.unlink()
        shutil.rmtree(opt.model_dir, ignore_errors=True)
        hp = build_hyperparameters(job.config, job.artifact_uri, job.run_id, job.inputs, job.s3_endpoint_url)
        opt.write_inputs(hp)
        env = {**os.environ, OPT_ML_ENV: str(opt.root)}
        proc = subprocess.run([self.python, "-m", STAGE_MODULES[job.stage], "train"], env=env)
        if proc.returncode != 0:
            reason = opt.failure_file.read_text() if opt.failure_file.exists() else f"exit code {proc.returncode}"
            raise StageFailed(job.stage, reason)
        if not self.keep:
            shutil.rmtree(opt.root, ignore_errors=True)
