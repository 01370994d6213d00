"""Golden outputs per stage: what each stage publishes on its tiny test run, so an output change is a decision.

Each stage's integration test summarises what its tiny run published (file names, content digests of files that
are byte-deterministic, headline numbers) and calls `check`, which compares it with
`tests/golden/stage_outputs.json`. A change fails until the golden is regenerated (`DILFORGE_UPDATE_GOLDEN=1`, then
review and commit the diff of the JSON). Reuse needs no such step: the code version in every artifact id is
derived from the code (dilforge_shared.identity.code_version), so changed code never reuses old artifacts.

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
    summary = json.loads(json.dumps(summary))  # JSON types, as stored
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get(UPDATE_ENV):
        golden[stage] = {"output": summary}
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    entry = golden.get(stage)
    assert entry is not None, f"no golden output for stage {stage}: run this test with {UPDATE_ENV}=1 and commit it"
    diff = differences(entry["output"], summary, stage)
    assert not diff, (
        f"the {stage} stage's output on its tiny run changed. If that is intended (the code version, derived from "
        f"the code, changed with it, so reruns build new artifacts), rerun with {UPDATE_ENV}=1 and commit "
        f"{GOLDEN.name}. Changed: " + "; ".join(diff[:12])
    )
