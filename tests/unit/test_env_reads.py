"""Environment reads go through dilforge_shared.settings, and nothing writes os.environ at run time
(issue 11 item 5). A source scan over the syntax tree: a new `os.environ.get("DILFORGE_...")`, a read through a
constant (`KEY = "DILFORGE_X"; os.getenv(KEY)`, imported or `module.KEY` too) or `os.environ[...] = ...` in a
production package fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    ROOT / "shared" / "dilforge_shared",
    ROOT / "coordinator" / "dilforge_coordinator",
    *sorted((ROOT / "services").glob("*/dilforge_*")),
]
WRITES = re.compile(r"os\.environ\s*\[[^\]]*\]\s*=|os\.environ\.(setdefault|update|pop)\(|os\.putenv\(|del os\.environ")
PREFIX = "DILFORGE_"
# Process start-up: where the SageMaker contract root is (read once when the stage starts).
ALLOWED_READS = {"shared/dilforge_shared/contract.py"}
# Libraries that take a switch from the environment only, and nothing else: each write is named with why.
ALLOWED_WRITES = {
    # the dry run: the SDK reads its IAM role check switch from SAGEMAKER_VALIDATE_ROLE only; set and restored
    # around the offline train() (a dry run has no credentials to check a role with)
    "coordinator/dilforge_coordinator/backends/sagemaker.py",
    # the eval stage's own process, before lm-eval is imported: datasets/huggingface_hub take their offline
    # switches (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE) from the environment only; never a hub
    "services/eval/dilforge_eval/downstream.py",
    # a CPT token-cache worker process (spawned, its own environment): tokenizers takes its thread switches
    # (TOKENIZERS_PARALLELISM, RAYON_NUM_THREADS) from the environment only; one thread a worker, the workers are
    # the parallelism
    "services/cpt/dilforge_cpt/data.py",
    # a SageMaker Processing container of the curate stage: the stage's /opt/ml root is a private copy (inputs are
    # shared by every host in local mode), and the contract finds the root through DILFORGE_OPT_ML only
    "services/curate/dilforge_curate/__main__.py",
}


def sources():
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def string_constants(tree: ast.AST) -> dict[str, str]:
    """NAME -> value of every `NAME = "..."` (module, class or function level) in one module."""
    out = {}
    for node in ast.walk(tree):
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return out


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def read_keys(tree: ast.AST):
    """The key expression of every environment read: os.environ.get(K), os.getenv(K), os.environ[K], K in os.environ."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            env_get = isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value)
            getenv = (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            )
            if env_get or getenv:
                yield node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            yield node.slice
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            and any(_is_environ(c) for c in node.comparators)
        ):
            yield node.left


def key_value(key: ast.AST, local: dict[str, str], everywhere: dict[str, set[str]]) -> set[str]:
    """What a key expression can be: a literal, a constant of this module, a constant imported from another project
    module (`KEY` or `module.KEY`, resolved by name over every module), an f-string's or a sum's literal start."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return {key.value}
    if isinstance(key, ast.Name):
        return {local[key.id]} if key.id in local else everywhere.get(key.id, set())
    if isinstance(key, ast.Attribute):
        return everywhere.get(key.attr, set())
    if isinstance(key, ast.JoinedStr) and key.values:
        return key_value(key.values[0], local, everywhere)
    if isinstance(key, ast.BinOp) and isinstance(key.op, ast.Add):
        return key_value(key.left, local, everywhere)
    return set()


def dilforge_readers(modules: dict[str, str]) -> set[str]:
    """Modules (name -> source) that read a DILFORGE_ variable from the environment themselves."""
    trees = {name: ast.parse(text) for name, text in modules.items()}
    local = {name: string_constants(tree) for name, tree in trees.items()}
    everywhere: dict[str, set[str]] = {}
    for consts in local.values():
        for const, value in consts.items():
            everywhere.setdefault(const, set()).add(value)
    return {
        name
        for name, tree in trees.items()
        if any(v.startswith(PREFIX) for key in read_keys(tree) for v in key_value(key, local[name], everywhere))
    }


def test_no_module_writes_os_environ():
    writers = {name for name, text in sources() if WRITES.search(text)}
    assert writers <= ALLOWED_WRITES, writers - ALLOWED_WRITES


def test_dilforge_variables_are_read_through_settings():
    readers = dilforge_readers(dict(sources())) - {"shared/dilforge_shared/settings.py"}
    assert readers <= ALLOWED_READS, readers - ALLOWED_READS


def test_the_scan_sees_reads_through_constants_imports_and_fstrings():
    flagged = {
        "literal.py": 'import os\nos.environ.get("DILFORGE_X")',
        "constant.py": 'import os\nKEY = "DILFORGE_X"\ndef f():\n    return os.environ.get(KEY, "")',
        "imported.py": "import os\nfrom .names import NAMED\nos.getenv(NAMED)",
        "attribute.py": "import os\nfrom . import names\nvalue = os.environ[names.NAMED]",
        "membership.py": 'import os\nTABLE: str = "DILFORGE_TABLE"\nfound = TABLE in os.environ',
        "fstring.py": 'from os import environ\nname = "S3"\nenviron.get(f"DILFORGE_{name}")',
        "concatenated.py": 'import os\nos.environ.get("DILFORGE_" + "X")',
    }
    quiet = {
        "names.py": 'NAMED = "DILFORGE_Y"',  # a constant that is never read here
        "other.py": 'import os\nREGION = "AWS_REGION"\nos.environ.get(REGION)\nos.environ.get("HOME")',
        "settings_user.py": "from .settings import settings\nsettings().data",
    }
    assert dilforge_readers({**flagged, **quiet}) == set(flagged)
