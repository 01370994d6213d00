"""The pipeline's stages, named once: their order, the image each runs in and its Python module.

Everything else (manifest schema, pipeline config, SageMaker sections, image builds, backends)
derives its stage list from here. The `model` stage (base model import) has no image of its own: it
needs torch, transformers and gguf, so it runs in the cpt image with its module selected by
`DILFORGE_STAGE_MODULE` (see docker/entrypoint.py).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path
from typing import Literal, get_args

StageName = Literal["model", "curate", "tokenizer", "cpt", "sft", "eval"]
STAGES: tuple[StageName, ...] = get_args(StageName)  # pipeline order

ImageName = Literal["curate", "tokenizer", "cpt", "sft", "eval"]
IMAGES: tuple[ImageName, ...] = get_args(ImageName)  # one container image each

STAGE_IMAGES: dict[StageName, ImageName] = {
    "model": "cpt",
    "curate": "curate",
    "tokenizer": "tokenizer",
    "cpt": "cpt",
    "sft": "sft",
    "eval": "eval",
}
STAGE_MODULES: dict[StageName, str] = {
    "model": "dilforge_cpt.import_model",
    "curate": "dilforge_curate",
    "tokenizer": "dilforge_tokenizer",
    "cpt": "dilforge_cpt",
    "sft": "dilforge_sft",
    "eval": "dilforge_eval",
}


def image_of(stage: str) -> ImageName:
    """The image a stage runs in (its own, except the model stage: the cpt image)."""
    return STAGE_IMAGES[stage]


# the package data the images install (services/*/pyproject.toml package-data): prompts, templates, task yamls
DATA_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".j2")


def code_version(stage: str) -> str:
    """The stage's code version (part of its artifact id): 16 hex of sha256 over the syntax trees of every
    dilforge module the stage imports, transitively, and its package's data files. Docstrings and comments are not
    hashed, so editing them keeps the id; any other change gives new ids, with nothing to bump."""
    return _code_version(STAGE_MODULES[stage])


@functools.cache
def _code_version(entry: str) -> str:
    h = hashlib.sha256()
    files = module_closure(entry)
    for name, path in sorted(files.items()):
        h.update(f"{name}\n{canonical_source(path.read_text(encoding='utf-8'))}\n".encode())
    package = module_path(entry.split(".")[0])
    if package is not None and package.name == "__init__.py":  # a package's own data, never a folder around a module
        for path in sorted(p for p in package.parent.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES):
            h.update(f"{path.relative_to(package.parent).as_posix()}\n".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def canonical_source(text: str) -> str:
    """A module's syntax tree without docstrings, serialised without line numbers or empty fields."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:]
    return _canon(tree)


def _canon(node) -> str:
    if isinstance(node, ast.AST):
        fields = ((f, _canon(getattr(node, f, None))) for f in node._fields)
        return f"{type(node).__name__}({','.join(f'{f}={v}' for f, v in fields if v not in ('[]', 'None'))})"
    if isinstance(node, list):
        return "[" + ",".join(_canon(x) for x in node) + "]"
    return repr(node)


def module_path(name: str) -> Path | None:
    """The source file of a dilforge module, found without importing it (only the top-level package is
    located by the import system)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return None
    if not spec.submodule_search_locations:  # a top-level module, not a package
        return Path(spec.origin) if not rest and spec.origin and spec.origin.endswith(".py") else None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def module_closure(entry: str) -> dict[str, Path]:
    """{module: file} of `entry` (and, for a package, its __main__) and every dilforge module it imports."""
    todo, found = [entry, f"{entry}.__main__"], {}
    while todo:
        name = todo.pop()
        if name in found or not name.startswith("dilforge_"):
            continue
        path = module_path(name)
        if path is None:
            continue
        found[name] = path
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                todo.append(base)
                todo += [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import module`
        todo += [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]  # parent packages run first
    return found
