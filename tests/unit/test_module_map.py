"""docs/architecture.md's module map names every production module, and only modules that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("shared", "coordinator", "services", "docker")  # what the issue-29 line count covers


def defines_something(path: Path) -> bool:
    """A package `__init__` that holds code (a function or class), not only a docstring or re-exports."""
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.parse(path.read_text(encoding="utf-8")).body)


def production_modules() -> list[str]:
    return sorted(
        p.relative_to(ROOT).as_posix()
        for folder in PRODUCTION
        for p in (ROOT / folder).rglob("*.py")
        if (p.name != "__init__.py" or defines_something(p))
        and not any(part in ("build", "dist") or part.endswith(".egg-info") for part in p.parts)
    )


def mapped_modules() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+\.py)` \| \S", section, flags=re.M)


def test_the_module_map_matches_the_tree():
    mapped, tree = mapped_modules(), production_modules()
    assert len(mapped) == len(set(mapped)), "a module is listed twice in docs/architecture.md's module map"
    assert not set(tree) - set(mapped), f"modules missing from the module map: {sorted(set(tree) - set(mapped))}"
    assert not set(mapped) - set(tree), (
        f"the module map names modules that do not exist: {sorted(set(mapped) - set(tree))}"
    )
    assert len(tree) > 100  # the scan found the packages
