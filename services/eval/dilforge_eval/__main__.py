import sys

from dilforge_shared.configs.eval import EvalConfig
from dilforge_shared.contract import stage_main

from .stage import run

if __name__ == "__main__":
    sys.exit(stage_main(EvalConfig, run, "dilforge-eval"))
