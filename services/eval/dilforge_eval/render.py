"""Render the HTML report in a real headless browser (Debian `chromium`) to check it displays.

`python -m dilforge_eval.render report.html shot.png` writes a full-page screenshot; used by
scripts/render_report.sh and the report test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium not found (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="dilforge-chromium-") as profile:
        return subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                              timeout=timeout, check=True)


def screenshot(html: Path, png: Path, width: int = 1300, height: int = 4000, timeout: int = 120) -> Path:
    _run([f"--window-size={width},{height}", f"--screenshot={png}", html.resolve().as_uri()], timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


def dump_dom(html: Path, timeout: int = 120) -> str:
    """The DOM after the browser parsed the page (what it would display)."""
    return _run(["--dump-dom", html.resolve().as_uri()], timeout).stdout


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m dilforge_eval.render REPORT.html SCREENSHOT.png")
    print(screenshot(Path(sys.argv[1]), Path(sys.argv[2])))
