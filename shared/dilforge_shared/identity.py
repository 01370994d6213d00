"""What identifies a stage's artifact: its code version, lineage refs of its inputs, and artifact ids.

A stage's code version hashes the code it runs: the module its container enters (STAGE_MODULES) and every dilforge
module that imports, transitively (`module_closure`).

Planning and the container contract compute the same refs, so `recompute_artifact_id(manifest) ==
manifest.artifact_id`. A model or tokenizer named by URI is identified without downloading any weights: a dilforge
artifact by its artifact ref, a local file by its sha256, a local folder by every file's, an s3:// prefix by the
ETags of its objects (`source_ref`)."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from urllib.parse import urlparse

from .configs.base import StageConfig
from .corpus_files import data_digest
from .errors import ConfigError, ManifestNotFound
from .manifest import InputRef, StageName, artifact_ref, fingerprint, sha256_file
from .paths import check_links, content_keys, declared_uri, holds_dilforge_data, local_path
from .store import S3Storage, read_manifest

# the module each stage's container runs (`python -m <module> train`); the model stage runs in the cpt image
STAGE_MODULES: dict[StageName, str] = {
    "model": "dilforge_cpt.import_model",
    "curate": "dilforge_curate",
    "tokenizer": "dilforge_tokenizer",
    "cpt": "dilforge_cpt",
    "sft": "dilforge_sft",
    "eval": "dilforge_eval",
}


def config_refs(config: StageConfig, endpoint_url: str | None = None) -> list[InputRef]:
    """Everything a stage reads besides upstream artifacts: data sources, models/tokenizers by URI, a model source."""
    refs = [
        InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=data_digest(s.uri, endpoint_url))
        for s in config.file_sources()
    ]
    refs += [source_ref(uri, model_ref_name(uri), endpoint_url) for uri in config.model_uris()]
    return refs + config.source_refs(endpoint_url)


def upstream_refs(inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """Upstream artifacts by their artifact ids (`manifest.artifact_ref`)."""
    return [artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0]) for name, uri in sorted(inputs.items())]


def stage_refs(config: StageConfig, inputs: dict[str, str], endpoint_url: str | None = None) -> list[InputRef]:
    """What a stage's artifact id covers, in the form its manifest records them."""
    return [*upstream_refs(inputs, endpoint_url), *config_refs(config, endpoint_url)]


def artifact_id(config: StageConfig, refs: list[InputRef], version: str | None = None) -> str:
    """The id of the artifact `config` produces from inputs `refs` with this code (or the given code version)."""
    version = code_version(config.stage) if version is None else version
    return fingerprint(config.stage, config.identity(), refs, version)


def model_ref_name(uri: str) -> str:
    """The lineage name of a model or tokenizer read from a URI in a stage's config."""
    return f"model:{uri}"


def source_ref(uri: str, name: str, endpoint_url: str | None = None) -> InputRef:
    """Lineage of whatever a model/tokenizer URI holds, computed without downloading any weights."""
    if urlparse(uri).scheme != "s3" and local_path(uri).is_file():
        return InputRef(name=name, kind="data", uri=uri, sha256=sha256_file(local_path(uri)))
    try:
        return artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0])
    except ManifestNotFound:
        pass
    return InputRef(name=name, kind="data", uri=uri, sha256=model_digest(uri, endpoint_url))


def folder_files(root: Path) -> list[Path]:
    """The files a model folder is made of, sorted: every regular file below it but hidden entries (a clone's
    `.git/` with its LFS copies of the weights, `hf download`'s `.cache/`, `.gitattributes`) and what is inside a
    dilforge store, artifact or stage work folder kept in it (`paths.holds_dilforge_data`), which changes
    as runs write to it: the corpus folders' rule. What its digest hashes and `models import` copies."""
    files = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not holds_dilforge_data(here / d)]
        files += [here / n for n in names if not n.startswith(".") and (here / n).is_file()]
    return sorted(files)


def dir_digest(root: Path) -> str:
    """sha256 over every file's path and sha256 (`folder_files`): lineage for a model that is not an artifact."""
    check_links(root, str(root))  # a link out of the folder would fingerprint (and publish) a file never pointed at
    h = hashlib.sha256()
    for path in folder_files(root):
        h.update(f"{path.relative_to(root).as_posix()}:{sha256_file(path)}\n".encode())
    return h.hexdigest()


def model_digest(uri: str, endpoint_url: str | None = None) -> str:
    """Content digest of a model folder without downloading it: file sha256s locally, ETags on S3."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        path = local_path(uri)
        if not path.is_dir():
            raise ConfigError(f"{uri}: no such model folder")
        return dir_digest(path)
    backend = S3Storage(parsed.netloc, parsed.path, endpoint_url)
    h = hashlib.sha256()
    stats = sorted(backend.list_stats(""))  # (key, size, ETag): one listing, no request per object
    content = set(content_keys((key for key, _, _ in stats), ""))  # what folder_files takes of a local folder
    stats = [s for s in stats if s[0] in content]
    if not stats:
        raise ConfigError(f"{uri}: no objects under this prefix")
    copy = declared_uri(uri) != uri  # an uploaded copy: each object's sha256, as dir_digest hashes the folder
    for key, _, etag in stats:
        sha256 = backend.metadata(key).get("sha256") if copy else None
        h.update(f"{key}:{sha256 or etag}\n".encode())
    return h.hexdigest()


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
