"""Every production module imports (the fast tier's floor: a module no fast test reaches still loads, with
its imports resolved), found by walking the packages, not listed by hand."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"dilforge_shared": ROOT / "shared", "dilforge_coordinator": ROOT / "coordinator"}
PACKAGES |= {p.name: p.parent for p in sorted(ROOT.glob("services/*/dilforge_*")) if (p / "__init__.py").is_file()}


def production_modules() -> list[str]:
    names = []
    for package, root in PACKAGES.items():
        names.append(package)
        for info in pkgutil.walk_packages([str(root / package)], prefix=f"{package}."):
            if not info.name.endswith("__main__"):
                names.append(info.name)
    return names


def test_the_walk_finds_every_package_and_stage():
    names = production_modules()
    assert {"dilforge_cpt.stage", "dilforge_eval.stage", "dilforge_serve.app", "dilforge_shared.compat"} <= set(names)
    assert len(names) > 100


@pytest.mark.parametrize("name", production_modules())
def test_module_imports(name):
    importlib.import_module(name)
