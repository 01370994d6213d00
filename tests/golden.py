"""Golden outputs per stage: a stage whose output on its tiny test run changes must bump its code version.

Each stage's integration test summarises what its tiny run published (file names, content digests of files that
are byte-deterministic, headline numbers) and calls `check`. The summary is compared with
`tests/golden/stage_outputs.json`, recorded together with the stage's `STAGE_VERSIONS` number:

- same version, same output: pass;
- same version, other output: fail "bump STAGE_VERSIONS['<stage>']" (dilforge_shared/stages.py), because reruns
  would otherwise reuse artifacts the old code produced under the same id;
- another version than recorded: fail until the golden is regenerated for it (`DILFORGE_UPDATE_GOLDEN=1`, then
  review and commit the diff of the JSON).

Floats are compared to a relative 1e-3: tight enough for any change of what a stage computes on these runs
(a transplant, a schedule, a mask), loose enough for float summation order across CPUs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "stage_outputs.json"
UPDATE_ENV = "DILFORGE_UPDATE_GOLDEN"
REL_TOL = 1e-3


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def differences(expected, got, where: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(got, dict):
        out = [f"{where}.{k}: missing" for k in expected if k not in got]
        out += [f"{where}.{k}: new" for k in got if k not in expected]
        for k in expected.keys() & got.keys():
            out += differences(expected[k], got[k], f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        return [
            d for i, (a, b) in enumerate(zip(expected, got, strict=False)) for d in differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return [] if math.isclose(expected, got, rel_tol=REL_TOL, abs_tol=1e-9) else [f"{where}: {expected} -> {got}"]
    return [] if expected == got else [f"{where}: {expected!r} -> {got!r}"]


def check(stage: str, summary: dict) -> None:
    from dilforge_shared.stages import STAGE_VERSIONS

    summary = json.loads(json.dumps(summary))  # JSON types, as stored
    version = STAGE_VERSIONS[stage]
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get(UPDATE_ENV):
        golden[stage] = {"code_version": version, "output": summary}
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    entry = golden.get(stage)
    assert entry is not None, f"no golden output for stage {stage}: run this test with {UPDATE_ENV}=1 and commit it"
    if entry["code_version"] != version:
        raise AssertionError(
            f"STAGE_VERSIONS[{stage!r}] is {version} but the golden output of {stage} was recorded "
            f"at {entry['code_version']}: rerun this test with {UPDATE_ENV}=1 and commit "
            f"{GOLDEN.name}"
        )
    diff = differences(entry["output"], summary, stage)
    assert not diff, (
        f"the {stage} stage's output on its tiny run changed but its code version did not: bump "
        f"STAGE_VERSIONS[{stage!r}] (now {version}) in shared/dilforge_shared/stages.py so reruns "
        f"build new artifacts, then rerun with {UPDATE_ENV}=1. Changed: " + "; ".join(diff[:12])
    )
