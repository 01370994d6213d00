"""`python -m dilforge_tokenizer train`: the container entrypoint (SageMaker BYOC contract)."""

import sys

from dilforge_shared.contract import stage_main

from .config import TokenizerConfig
from .stage import run

if __name__ == "__main__":
    sys.exit(stage_main(TokenizerConfig, run, "dilforge-tokenizer"))
