"""Environment reads go through dilforge_shared.settings, and nothing writes os.environ at run time
(issue 11 item 5). A source scan: a new `os.environ.get("DILFORGE_...")` or `os.environ[...] = ...`
in a production package fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ROOT / "shared" / "dilforge_shared",
    ROOT / "coordinator" / "dilforge_coordinator",
    *sorted((ROOT / "services").glob("*/dilforge_*")),
]
WRITES = re.compile(r"os\.environ\s*\[[^\]]*\]\s*=|os\.environ\.(setdefault|update|pop)\(|os\.putenv\(|del os\.environ")
DILFORGE_READ = re.compile(r"os\.(environ\.get|getenv)\(\s*[\"']DILFORGE_|os\.environ\[\s*[\"']DILFORGE_")
# Process start-up: where the SageMaker contract root is (read once when the stage starts).
ALLOWED_READS = {"shared/dilforge_shared/contract.py"}


def sources():
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_module_writes_os_environ():
    assert [name for name, text in sources() if WRITES.search(text)] == []


def test_dilforge_variables_are_read_through_settings():
    readers = {name for name, text in sources() if DILFORGE_READ.search(text)} - {"shared/dilforge_shared/settings.py"}
    assert readers <= ALLOWED_READS, readers
