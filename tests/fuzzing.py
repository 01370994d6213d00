"""Shared settings of the fuzz and fault suites (tests/unit/test_fuzz.py, tests/unit/test_faults.py).

CI runs a fixed, small budget with fixed seeds, so a run is reproducible and takes seconds. A nightly-style run
turns the budget up with environment variables (see docs/reliability.md, "Fuzz and fault suite"):

    DILFORGE_FUZZ_EXAMPLES=2000 DILFORGE_FAULT_SEEDS=200 .venv/bin/python -m pytest tests/unit/test_fuzz.py \
        tests/unit/test_faults.py -q

`DILFORGE_FAULT_SEED0` moves the window of fault seeds (seeds SEED0 .. SEED0+SEEDS-1), so nightly runs can cover
new offsets each night while any failure names its seed for an exact rerun.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZ_EXAMPLES = int(os.environ.get("DILFORGE_FUZZ_EXAMPLES", "40"))
FAULT_SEEDS = int(os.environ.get("DILFORGE_FAULT_SEEDS", "3"))
FAULT_SEED0 = int(os.environ.get("DILFORGE_FAULT_SEED0", "0"))

# derandomize: the examples are a function of the test alone (a fixed seed), so CI is reproducible; the nightly
# budget explores more of the same deterministic stream. No example database is written into the repo.
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def fault_seeds() -> list[int]:
    return list(range(FAULT_SEED0, FAULT_SEED0 + FAULT_SEEDS))
