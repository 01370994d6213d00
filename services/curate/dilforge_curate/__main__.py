"""The container entrypoint (SageMaker BYOC contract).

`python -m dilforge_curate train`: the whole stage on this machine (every datatrove task, N processes).
`python -m dilforge_curate process PHASE --read DIR --write DIR`: one phase (filter, buckets, cluster, write) on
this host's slice of the tasks, for a job of several hosts; `process publish --read DIR` publishes the artifact
from the union of every host's outputs. The config comes from the /opt/ml hyperparameters as for `train`.
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dilforge_shared.contract import OPT_ML_ENV, OptMl, StageContext, StageResult, stage_main

from .config import CurateConfig
from .stage import PHASES, Folders, publish_phases, run, run_phase

PROCESSING_RESOURCES = "/opt/ml/config/resourceconfig.json"  # where SageMaker Processing lists the hosts


def process(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m dilforge_curate process")
    ap.add_argument("phase", choices=[*PHASES, "publish"])
    ap.add_argument("--read", type=Path, required=True, help="the union of every host's earlier outputs")
    ap.add_argument("--write", type=Path, help="this host's outputs (phases only)")
    ap.add_argument(
        "--shared-write",
        action="store_true",
        help="every host writes to the same --write folder (SageMaker local mode): wait for the others' tasks",
    )
    args = ap.parse_args(argv)
    hosts = Path(PROCESSING_RESOURCES)
    if hosts.is_file():
        # A SageMaker Processing container: the stage's /opt/ml root is a private copy holding the hyperparameters
        # (an input) and this host's resourceconfig.json (local mode mounts one input folder into every host).
        given = OptMl.from_env()
        private = OptMl(Path(tempfile.mkdtemp(prefix="dilforge-opt-ml-")))
        private.config_dir.mkdir(parents=True)
        shutil.copyfile(given.config_dir / "hyperparameters.json", private.config_dir / "hyperparameters.json")
        shutil.copyfile(hosts, private.config_dir / "resourceconfig.json")
        os.environ[OPT_ML_ENV] = str(private.root)
    publish = args.phase == "publish"
    if not publish and args.write is None:
        ap.error("--write is required for a phase")
    folders = Folders(args.read, args.write, args.shared_write)

    def work(config: CurateConfig, ctx: StageContext) -> StageResult | None:
        return publish_phases(config, ctx, args.read) if publish else run_phase(config, ctx, args.phase, folders)

    return stage_main(CurateConfig, work, "dilforge-curate", ["train"], publish_from_this_process=publish)


if __name__ == "__main__":  # datatrove's worker processes re-import this module: run only as the main program
    if sys.argv[1:2] == ["process"]:
        sys.exit(process(sys.argv[2:]))
    sys.exit(stage_main(CurateConfig, run, "dilforge-curate"))
