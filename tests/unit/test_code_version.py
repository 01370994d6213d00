"""A stage's code version is derived from the code it runs (dilforge_shared.identity.code_version): a new
function or a changed constant in any module the stage imports gives a new version (and so new artifact
ids); a comment, a docstring or a module the stage never imports does not; the serialisation is the same
on every Python the images run."""

from __future__ import annotations

import functools
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dilforge_coordinator.config import STAGE_CONFIGS
from dilforge_shared import identity
from dilforge_shared.manifest import STAGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """dilforge_probe_stage (entry) importing dilforge_probe_lib.helpers, on sys.path; returns an editor."""
    stage, lib = tmp_path / "dilforge_probe_stage", tmp_path / "dilforge_probe_lib"
    for d in (stage, lib):
        d.mkdir()
        (d / "__init__.py").write_text("")
    (stage / "__main__.py").write_text("from .train import run\n\nrun()\n")
    (stage / "train.py").write_text(
        '"""Training."""\n\nfrom dilforge_probe_lib import helpers\n\nRATE = 0.1  # why\n\n\n'
        'def run():\n    """Run it."""\n    return helpers.scale(RATE)\n'
    )
    (stage / "unused.py").write_text("X = 1\n")
    (stage / "prompts").mkdir()
    (stage / "prompts" / "az.jsonl").write_text("Salam\n")
    (lib / "helpers.py").write_text("def scale(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    def version() -> str:
        identity._code_version.cache_clear()
        return identity._code_version("dilforge_probe_stage")

    def edit(path: str, old: str, new: str) -> str:
        p = tmp_path / path
        p.write_text(p.read_text().replace(old, new))
        return version()

    yield version, edit
    identity._code_version.cache_clear()


def test_code_edits_change_the_version_comments_and_docstrings_do_not(package):
    version, edit = package
    base = version()
    assert edit("dilforge_probe_stage/train.py", "# why", "# why: measured") == base
    assert edit("dilforge_probe_stage/train.py", '"""Run it."""', '"""Run it, once."""') == base
    assert edit("dilforge_probe_stage/train.py", '"""Training."""', '"""The training story."""') == base
    assert edit("dilforge_probe_stage/unused.py", "X = 1", "X = 2") == base  # never imported by the stage
    changed_constant = edit("dilforge_probe_stage/train.py", "RATE = 0.1", "RATE = 0.2")
    assert changed_constant != base
    new_function = edit("dilforge_probe_stage/train.py", "def run():", "def extra():\n    pass\n\n\ndef run():")
    assert new_function not in (base, changed_constant)
    imported = edit("dilforge_probe_lib/helpers.py", "2 * x", "3 * x")  # a module of another dilforge package
    assert imported != new_function
    assert edit("dilforge_probe_stage/prompts/az.jsonl", "Salam", "Salam!") != imported  # the stage's data files


def test_every_stage_has_a_version_and_its_closure_holds_its_own_code():
    for stage, entry in identity.STAGE_MODULES.items():
        assert len(identity.code_version(stage)) == 16
        modules = identity.module_closure(entry)
        assert entry in modules and "dilforge_shared.contract" in modules
    assert "dilforge_cpt.stage" in identity.module_closure("dilforge_cpt")
    assert "dilforge_cpt.stage" not in identity.module_closure("dilforge_cpt.import_model")  # the model stage


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A copy of the production packages that `identity.code_version` reads instead of the real files; returns an
    editor that adds a function to one module of the copy."""
    copy = tmp_path / "tree"
    for top in ("shared", "coordinator", "services"):
        shutil.copytree(ROOT / top, copy / top, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    real = identity.module_path
    monkeypatch.setattr(identity, "module_path", lambda name: (p := real(name)) and copy / p.relative_to(ROOT))
    monkeypatch.setattr(identity, "canonical_source", functools.cache(identity.canonical_source))  # pure: once a text
    identity._code_version.cache_clear()

    def edit(module: str) -> dict[str, str]:
        path = copy / real(module).relative_to(ROOT)
        path.write_text(path.read_text() + "\n\ndef added_by_the_test():\n    return 1\n")
        identity._code_version.cache_clear()
        return {stage: identity.code_version(stage) for stage in STAGES}

    yield edit
    identity._code_version.cache_clear()


def test_an_edit_changes_exactly_the_versions_of_the_stages_that_import_it(tree):
    """Eval's config section edited: only eval's version moves (every stage used to load every section). Then,
    for modules on some stages' paths and not others', a stage's version moves iff the module is in its closure."""
    before = {stage: identity.code_version(stage) for stage in STAGES}
    after = tree("dilforge_eval.config")
    assert [s for s in STAGES if after[s] != before[s]] == ["eval"]
    closures = {stage: identity.module_closure(entry) for stage, entry in identity.STAGE_MODULES.items()}
    for module in (
        "dilforge_cpt.config",
        "dilforge_shared.configs.language",
        "dilforge_shared.fertility",
        "dilforge_shared.compat",
        "dilforge_shared.compat.dcp",
        "dilforge_shared.corpus",
        "dilforge_shared.models",
        "dilforge_shared.runtime_policy",
        "dilforge_shared.locks",
        "dilforge_coordinator.config",
    ):
        before, after = after, tree(module)
        moved = [s for s in STAGES if after[s] != before[s]]
        assert moved == [s for s in STAGES if module in closures[s]], module


def test_an_artifact_id_is_kept_by_an_edit_off_its_stages_path_and_changed_by_one_on_it(tree):
    """The id a run plans, not only the code version: the same CPT config and inputs keep their id through edits to
    eval's code, serve's and the coordinator's, and get a new one from an edit to a module CPT runs."""
    from factories import tiny_cpt_config

    config = tiny_cpt_config()
    base = identity.artifact_id(config, [])
    for module in ("dilforge_eval.config", "dilforge_serve.app", "dilforge_shared.locks", "dilforge_coordinator.gc"):
        tree(module)
        assert identity.artifact_id(config, []) == base, module
    tree("dilforge_shared.bpb")
    assert identity.artifact_id(config, []) != base


def test_a_stage_loads_its_own_config_section_and_no_coordinator_code():
    sections = {config.__module__ for config in STAGE_CONFIGS.values()}
    for stage, entry in identity.STAGE_MODULES.items():
        modules = set(identity.module_closure(entry))
        assert modules & sections == {STAGE_CONFIGS[stage].__module__}, stage
        assert not [m for m in modules if m.startswith("dilforge_coordinator")], stage
    for stage in ("curate", "tokenizer", "eval"):  # no library internals used: the door is not on the path
        assert "dilforge_shared.compat" not in identity.module_closure(identity.STAGE_MODULES[stage])


def test_the_serialisation_is_the_same_on_other_pythons():
    """The GPU image runs Python 3.12, the CPU images and the host 3.11: one version for both."""
    others = [p for p in Path.home().glob(".pyenv/versions/3.1[0-3]*/bin/python3") if p.exists()]
    if not others:
        pytest.skip("no other CPython installed here")
    src = (ROOT / "services" / "cpt" / "dilforge_cpt" / "stage.py").read_text()
    here = identity.canonical_source(src)
    # the two serialising functions alone, out of identity.py: a bare interpreter has none of its other imports
    code = "import ast, sys; tree = ast.parse(open(sys.argv[1]).read()); ns = {'ast': ast}; "
    code += "keep = [n for n in tree.body if getattr(n, 'name', '') in ('canonical_source', '_canon')]; "
    code += "exec(compile(ast.Module(keep, []), sys.argv[1], 'exec'), ns); "
    code += "print(ns['canonical_source'](open(sys.argv[2]).read()))"
    identity_py = ROOT / "shared" / "dilforge_shared" / "identity.py"
    for python in others:
        out = subprocess.run(
            [str(python), "-c", code, str(identity_py), str(ROOT / "services/cpt/dilforge_cpt/stage.py")],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        assert out == here, python
    assert sys.version_info[:2] >= (3, 10)
