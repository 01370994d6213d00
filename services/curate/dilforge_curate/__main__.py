"""`python -m dilforge_curate train`: the container entrypoint (SageMaker BYOC contract)."""

import sys

from dilforge_shared.configs.curate import CurateConfig
from dilforge_shared.contract import stage_main

from .stage import run

if __name__ == "__main__":  # datatrove's worker processes re-import this module: run only as the main program
    sys.exit(stage_main(CurateConfig, run, "dilforge-curate"))
