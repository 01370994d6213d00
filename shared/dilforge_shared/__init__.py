"""dilforge's own library: the contract every stage and the coordinator share.

Nothing here imports torch, so the coordinator can validate a whole pipeline on a laptop.
"""

__version__ = "0.1.0"
