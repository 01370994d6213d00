"""Image sizes and build times of the four stage images (CPU variant), cold and warm.

    python bench/images.py                 # cold: prunes the BuildKit cache first; then a warm rebuild
    python bench/images.py --no-prune      # only what the cache allows (quick)

Prints hardware, date and a Markdown table (for docs/benchmarks.md; --out also writes it to a file). Baseline, in the same run: the sum of
the four images' sizes as if they shared nothing, against what they really take on disk together
(`docker system df -v`: shared layers counted once), and the first image's cold build time against
the other three (which reuse the shared layers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "coordinator"))
sys.path.insert(0, str(ROOT / "shared"))

import hardware  # bench/hardware.py
from dilforge_coordinator import images
from dilforge_coordinator.backends.compose import docker_binary
from dilforge_coordinator.stage_images import IMAGES

STAGES = IMAGES


def disk_usage(docker: str) -> dict[str, dict]:
    out = subprocess.run(
        [docker, "system", "df", "-v", "--format", "{{json .Images}}"], capture_output=True, text=True, check=True
    ).stdout
    rows = json.loads(out)
    return {f"{r['Repository']}:{r['Tag']}": r for r in rows}


def to_bytes(text: str) -> float:
    units = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    return float(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-prune", action="store_true", help="keep the build cache (warm numbers only)")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown section to this file")
    args = ap.parse_args()
    docker = docker_binary()
    engine = subprocess.run(
        [docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True
    ).stdout.strip()
    header = (
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {hardware.cpu_model()}, {os.cpu_count()} cores, "
        f"Docker engine {engine}, base python:3.11-slim"
    )
    print(header)
    images.prepare_wheelhouse()
    if not args.no_prune:
        for stage in STAGES:
            subprocess.run([docker, "image", "rm", "-f", f"dilforge-{stage}:bench"], capture_output=True)
        subprocess.run([docker, "builder", "prune", "-af"], capture_output=True, check=True)
    cold = {}
    for stage in STAGES:
        t0 = time.monotonic()
        res = images.build(stage, tag="bench")
        cold[stage] = (time.monotonic() - t0, res.size_bytes)
        print(f"cold  {stage:<10} {cold[stage][0]:6.1f} s  {res.size_bytes / 1e9:.2f} GB")
    warm = {}
    for stage in STAGES:
        t0 = time.monotonic()
        images.build(stage, tag="bench")
        warm[stage] = time.monotonic() - t0
        print(f"warm  {stage:<10} {warm[stage]:6.1f} s")
    df = disk_usage(docker)
    shared = max(to_bytes(df[f"dilforge-{s}:bench"]["SharedSize"]) for s in STAGES)
    unique = {s: to_bytes(df[f"dilforge-{s}:bench"]["UniqueSize"]) for s in STAGES}
    naive = sum(size for _, size in cold.values())
    together = shared + sum(unique.values())
    first = cold[STAGES[0]][0]
    rest = sum(cold[s][0] for s in STAGES[1:])
    lines = [
        "## Container images (CPU variant)",
        "",
        f"Measured {header}.",
        "",
        (
            f"Command: `python bench/images.py`{' --no-prune' if args.no_prune else ''} "
            "(cold = BuildKit cache pruned first; the base image and PyPI downloads are not cached)."
        ),
        "",
        "| image | size | cold build | warm rebuild |",
        "|---|---|---|---|",
        *[f"| dilforge-{s} | {cold[s][1] / 1e9:.2f} GB | {cold[s][0]:.0f} s | {warm[s]:.1f} s |" for s in STAGES],
        "",
        (
            f"- Four images on disk together: **{together / 1e9:.2f} GB** (shared layers {shared / 1e9:.2f} GB once, "
            f"stage layers {sum(unique.values()) / 1e6:.0f} MB), against {naive / 1e9:.2f} GB if nothing were shared "
            f"({together / naive:.2f}×)."
        ),
        (
            f"- Cold build: the first image {first:.0f} s (builds the shared layers), the other three {rest:.0f} s "
            f"together ({rest / first:.2f}× the first)."
        ),
        "",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
