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
ALLOWED_READS = {"shared/dilforge_shared/opt_ml.py"}
# Libraries that take a switch from the environment only, and nothing else: each write is named with why.
ALLOWED_WRITES = {
    # the dry run: the SDK reads its IAM role check switch from SAGEMAKER_VALIDATE_ROLE only; set and restored
    # around the offline train() (a dry run has no credentials to check a role with)
    "coordinator/dilforge_coordinator/backends/sagemaker_sdk.py",
    # the eval stage's own process, before lm-eval is imported: datasets/huggingface_hub take their offline
    # switches (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE) from the environment only; never a hub
    "services/eval/dilforge_eval/harness.py",
}


def sources():
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_no_module_writes_os_environ():
    writers = {name for name, text in sources() if WRITES.search(text)}
    assert writers <= ALLOWED_WRITES, writers - ALLOWED_WRITES


def test_dilforge_variables_are_read_through_settings():
    readers = {name for name, text in sources() if DILFORGE_READ.search(text)} - {"shared/dilforge_shared/settings.py"}
    assert readers <= ALLOWED_READS, readers
