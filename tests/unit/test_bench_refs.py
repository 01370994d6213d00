"""Every name a bench script reads from a project package (dilforge_*) exists: `from module import name`, and
`alias.attr` on an imported project module. The benches are run by hand, so a refactor that moves a name would
otherwise break them silently; they are parsed, never executed."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCHES = sorted((Path(__file__).resolve().parents[2] / "bench").glob("*.py"))


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def missing_refs(tree: ast.Module) -> list[str]:
    """`module.name` for each project name the script reads that its module lacks, with the line."""
    aliases, missing = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dilforge_"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dilforge_"):
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif not hasattr(importlib.import_module(node.module), a.name):
                    missing.append(f"{node.module}.{a.name} (line {node.lineno})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = importlib.import_module(aliases[node.value.id])
            if not hasattr(module, node.attr) and not is_module(f"{module.__name__}.{node.attr}"):
                missing.append(f"{module.__name__}.{node.attr} (line {node.lineno})")
    return missing


@pytest.mark.parametrize("path", BENCHES, ids=[p.stem for p in BENCHES])
def test_bench_reads_only_existing_project_names(path):
    assert missing_refs(ast.parse(path.read_text(encoding="utf-8"), str(path))) == []
