import sys

from dilforge_shared.contract import stage_main

from .config import EvalConfig
from .stage import run

if __name__ == "__main__":
    sys.exit(stage_main(EvalConfig, run, "dilforge-eval"))
