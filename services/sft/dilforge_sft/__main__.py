"""`python -m dilforge_sft train`: the SageMaker-style container entrypoint."""

import sys

from dilforge_shared.contract import stage_main

from .config import SftConfig
from .stage import run

if __name__ == "__main__":
    sys.exit(stage_main(SftConfig, run, "dilforge-sft"))
