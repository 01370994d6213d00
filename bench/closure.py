"""What each stage's container entry loads of the project: modules and lines, in its own package and outside it.

    python bench/closure.py             # a Markdown table for docs/architecture.md (What each stage loads)
    python bench/closure.py --list cpt  # and the modules of one stage, with their lines

The closure is `identity.module_closure`, the very set a stage's code version hashes (module-level and
function-level imports alike), so the table is also what each stage's artifact ids follow.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shared"), str(ROOT / "coordinator"), *map(str, sorted((ROOT / "services").glob("*")))]

from dilforge_shared.identity import STAGE_MODULES, module_closure  # noqa: E402

ENTRIES = {**STAGE_MODULES, "serve": "dilforge_serve"}  # the serving image's entry is no pipeline stage


def lines(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for _ in f)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", metavar="STAGE", choices=sorted(ENTRIES), help="also list one stage's modules")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"{dt.date.today().isoformat()}, commit {commit.stdout.strip() or '?'}: python bench/closure.py\n")
    print("| stage | entry | own modules | own lines | other modules | other lines |")
    print("|---|---|---:|---:|---:|---:|")
    for stage, entry in ENTRIES.items():
        modules = module_closure(entry)
        own = {m: p for m, p in modules.items() if m.split(".")[0] == entry.split(".")[0]}
        other = {m: p for m, p in modules.items() if m not in own}
        count = lambda d: sum(map(lines, d.values()))  # noqa: E731
        print(f"| {stage} | `{entry}` | {len(own)} | {count(own):,} | {len(other)} | {count(other):,} |")
    if args.list:
        print()
        for name, path in sorted(module_closure(ENTRIES[args.list]).items()):
            print(f"{lines(path):>6}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
