"""Render the HTML report in a real headless browser (Debian `chromium`) to check it displays.

`python -m dilforge_eval.render report.html shot.png` writes a full-page screenshot; used by
scripts/render_report.sh and the report test.
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
        prog="python -m dilforge_eval.render", description="Screenshot an HTML report in headless Chromium (full page)."
    )
    parser.add_argument("report", type=Path, help="report.html")
    parser.add_argument("screenshot", type=Path, help="PNG to write")
    args = parser.parse_args(argv)
    print(screenshot(args.report, args.screenshot))


if __name__ == "__main__":
    main()
