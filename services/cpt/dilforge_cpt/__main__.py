"""`python -m dilforge_cpt train` (container entry), `... worker` (one torchrun process) and `... build-cache`
(only the token cache, e.g. in a SageMaker Processing job before the training job)."""

import os
import sys

from dilforge_shared.contract import OptMl, ResourceConfig, stage_main
from dilforge_shared.errors import DilforgeError
from dilforge_shared.workers import die_with_parent

from .config import CptConfig
from .stage import build_cache, run, worker


def _node_zero() -> bool:
    """Only the first sorted host publishes on a multi-host run."""
    try:
        return ResourceConfig.load(OptMl.from_env()).node_rank == 0
    except (DilforgeError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        die_with_parent(os.getppid())  # torchrun's worker: a killed torchrun (or stage) leaves none training
        return stage_main(CptConfig, worker, "dilforge-cpt", ["train", *argv[1:]], publish_from_this_process=False)
    if argv[:1] == ["build-cache"]:
        return stage_main(CptConfig, build_cache, "dilforge-cpt", ["train", *argv[1:]], publish_from_this_process=False)
    return stage_main(CptConfig, run, "dilforge-cpt", argv, publish_from_this_process=_node_zero())


if __name__ == "__main__":
    sys.exit(main())
