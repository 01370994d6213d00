"""Render an eval report in a real headless browser (Debian `chromium`: apt-get install -y chromium) to check it
displays.

`python scripts/render_report.py report.html [shot.png]` writes a full-page screenshot (default: beside the
report); the report test uses the same functions.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium not found (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="dilforge-chromium-") as profile:
        return subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )


def screenshot(html: Path, png: Path, width: int = 1300, height: int = 4000, timeout: int = 120) -> Path:
    _run([f"--window-size={width},{height}", f"--screenshot={png}", html.resolve().as_uri()], timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


def dump_dom(html: Path, timeout: int = 120) -> str:
    """The DOM after the browser parsed the page (what it would display)."""
    return _run(["--dump-dom", html.resolve().as_uri()], timeout).stdout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="scripts/render_report.py", description="Screenshot an HTML report in headless Chromium (full page)."
    )
    parser.add_argument("report", type=Path, help="report.html")
    parser.add_argument("screenshot", type=Path, nargs="?", help="PNG to write (default: the report's name, .png)")
    args = parser.parse_args(argv)
    print(screenshot(args.report, args.screenshot or args.report.with_suffix(".png")))


if __name__ == "__main__":
    main()
