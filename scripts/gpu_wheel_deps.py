#!/usr/bin/env python
"""Is the carried wheel set complete? Every requirement of every carried wheel (Requires-Dist, extras
left out, markers evaluated for the device's Python) must be met by another carried wheel or by a
package the GPU machine already has (scripts/gpu_device_packages.txt; where scripts/gpu_device_env.txt
gives its version, the version must satisfy the specifier). One version per package, and the whole
set within the 64 MiB that one device call carries (with the working tree).

  python scripts/gpu_wheel_deps.py .whl [--python 3.12] [--limit-mib 64]

Exit 1 with one line per problem. `pip install --no-deps --target` (how the device installs them) never
checks any of this, which is how pydantic-settings and python-dotenv went missing unnoticed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def device_packages() -> tuple[set[str], dict[str, Version]]:
    names = {
        canonicalize_name(line.strip())
        for line in (ROOT / "scripts" / "gpu_device_packages.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    versions = {}
    for raw in (ROOT / "scripts" / "gpu_device_env.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "==" in line and not line.endswith("# lock"):
            name, version = line.split("==")
            versions[canonicalize_name(name)] = Version(version.strip())
    return names, versions


def wheel_requirements(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]


def tree_bytes() -> int:
    """Bytes of what a device call sends besides the carried folders: tracked + untracked-not-ignored files."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((ROOT / name).stat().st_size for name in out.decode().split("\0") if name and (ROOT / name).is_file())


def check(wheel_dir: Path, python: str, limit_mib: float) -> list[str]:
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        return [f"{wheel_dir}: no wheels"]
    problems = []
    carried: dict[str, Version] = {}
    for w in wheels:
        name, version, _, _ = parse_wheel_filename(w.name)
        if name in carried:
            problems.append(f"{w.name}: two versions of {name} ({carried[name]} and {version}); pip --target stops")
        carried[name] = version
    on_device, device_versions = device_packages()
    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    for w in wheels:
        for req in wheel_requirements(w):
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # an extra's requirement, or another platform's
            name = canonicalize_name(req.name)
            version = carried.get(name) or device_versions.get(name)
            where = "carried" if name in carried else "on the device"
            if name not in carried and name not in on_device:
                problems.append(
                    f"{w.name}: needs {req} - neither carried nor on the device (add it to scripts/fetch_gpu_wheels.sh)"
                )
            elif version is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{w.name}: needs {req}, {where} is {version}")
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    total = wheel_bytes + tree_bytes()
    print(
        f"gpu_wheel_deps: {len(wheels)} wheels, {wheel_bytes / 2**20:.1f} MiB; with the working tree "
        f"{total / 2**20:.1f} MiB of the {limit_mib:.0f} MiB one call carries"
    )
    if total > limit_mib * 2**20:
        problems.append(f"carried set + working tree = {total / 2**20:.1f} MiB > {limit_mib:.0f} MiB")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheels", type=Path)
    ap.add_argument("--python", default="3.12", help="the device's Python (markers are evaluated for it)")
    ap.add_argument("--limit-mib", type=float, default=64.0)
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        ap.error("--python is MAJOR.MINOR")
    problems = check(args.wheels, args.python, args.limit_mib)
    for p in problems:
        print(f"gpu_wheel_deps: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
