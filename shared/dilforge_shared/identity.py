"""What identifies a stage's artifact: its code version (the code its entry imports, `module_closure`), its inputs'
lineage refs (models without downloading weights, a corpus source by the files it names and their digest), and the
artifact id. Planning and the contract compute the same refs, so an id can be recomputed."""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import hashlib
import importlib.util
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from .configs import StageConfig
from .errors import ConfigError, InputError, ManifestNotFound, UnsafePathError
from .manifest import (
    MANIFEST_NAME,
    STAGES,
    InputRef,
    StageName,
    artifact_ref,
    declared_uri,
    fingerprint,
    parse_manifest,
    sha256_file,
)
from .settings import cache_root
from .store import S3Storage, local_path, read_manifest

# the module each stage's container runs (`python -m <module> train`); the model stage runs in the cpt image
STAGE_MODULES: dict[StageName, str] = {s: f"dilforge_{s}" for s in STAGES} | {"model": "dilforge_cpt.import_model"}


STORE_FILES = (".dilforge-store", ".dilforge-work", "manifest.json")


def holds_dilforge_data(folder: Path) -> bool:
    """A dilforge store, artifact or work folder: never content of a corpus or model folder it sits in."""
    return any((folder / f).exists() for f in STORE_FILES)


def content_keys(keys: Iterable[str], prefix: str) -> list[str]:
    """The keys under an S3 `prefix` that are its content, by the folders' rule: none hidden, none in a store."""
    keys = list(keys)
    start = len(prefix) + 1 if prefix else 0
    stores = {k.rsplit("/", 1)[0] + "/" for k in keys if "/" in k[start:] and k.rsplit("/", 1)[-1] in STORE_FILES}
    return [
        k
        for k in keys
        if not any(part.startswith(".") for part in k[start:].split("/")) and not any(k.startswith(s) for s in stores)
    ]


def check_links(folder: Path, source: str) -> None:
    """Refuse an input folder holding a link to outside it (it would publish, or fingerprint, files never named)."""
    real = folder.resolve()
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(real):
                    raise UnsafePathError(
                        f"{source}: {path.relative_to(folder)} is a link to {target}, outside the "
                        "folder; copy the file in instead of linking it"
                    )


def config_refs(config: StageConfig, endpoint_url: str | None = None) -> list[InputRef]:
    """Everything a stage reads besides upstream artifacts: data sources, models/tokenizers by URI, a model source."""
    refs = [
        InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=data_digest(s.uri, endpoint_url))
        for s in config.file_sources()
    ]
    refs += [source_ref(uri, f"model:{uri}", endpoint_url) for uri in config.model_uris()]
    return refs + config.source_refs(endpoint_url)


def artifact_id(config: StageConfig, refs: list[InputRef], version: str | None = None) -> str:
    """The id of the artifact `config` produces from inputs `refs` with this code (or the given code version)."""
    version = code_version(config.stage) if version is None else version
    return fingerprint(config.stage, config.identity(), refs, version)


def source_ref(uri: str, name: str, endpoint_url: str | None = None) -> InputRef:
    """Lineage of whatever a model/tokenizer URI holds, computed without downloading any weights."""
    if urlparse(uri).scheme != "s3" and local_path(uri).is_file():
        return InputRef(name=name, kind="data", uri=uri, sha256=sha256_file(local_path(uri)))
    with contextlib.suppress(ManifestNotFound):
        return artifact_ref(name, uri, read_manifest(uri, endpoint_url)[0])
    return InputRef(name=name, kind="data", uri=uri, sha256=model_digest(uri, endpoint_url))


def folder_files(root: Path) -> list[Path]:
    """A model folder's files, sorted (what its digest hashes and `models import` copies): not hidden, not stores."""
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
    if not (stats := [s for s in stats if s[0] in content]):
        raise ConfigError(f"{uri}: no objects under this prefix")
    copy = declared_uri(uri) != uri  # an uploaded copy: each object's sha256, as dir_digest hashes the folder
    for key, _, etag in stats:
        sha256 = backend.head(key).get("Metadata", {}).get("sha256") if copy else None
        h.update(f"{key}:{sha256 or etag}\n".encode())
    return h.hexdigest()


SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".tsv", ".tsv.gz", ".parquet")


def expand(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The corpus files behind `uri`: a file, a folder (sorted, not hidden, not stores; no link to a folder), a glob
    (only when no such file exists), an S3 object or prefix."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        backend, key = S3Storage(parsed.netloc, "", endpoint_url), parsed.path.lstrip("/")
        if key and not key.endswith("/") and backend.exists(key):
            return [uri]
        prefix = key.rstrip("/")
        if not (keys := [k for k in content_keys(backend.list(prefix), prefix) if k.lower().endswith(SUFFIXES)]):
            raise InputError("no such S3 object, and no corpus files under that prefix", path=uri)
        return [f"s3://{parsed.netloc}/{k}" for k in sorted(keys)]
    path = uri[len("file://") :] if parsed.scheme == "file" else uri
    if any(ch in path for ch in "*?[") and not os.path.lexists(path):
        if not (matches := sorted(glob.glob(path))):
            raise InputError(
                "glob matches no file (a file whose name holds *, ? or [ is read when it exists)", path=uri
            )
        return [regular_file(m, m) for m in matches]
    p = Path(path)
    if p.is_dir():
        if not (files := _walk(p, uri)):
            raise InputError("folder holds no corpus file (.txt, .txt.gz, .jsonl, .tsv, .parquet)", path=uri)
        return files
    if not p.exists():
        raise InputError("no such file", path=uri)
    return [regular_file(str(p), uri)]


def _walk(root: Path, uri: str) -> list[str]:
    """Corpus files below `root`, sorted, skipping what `expand` says it skips."""

    def fail(exc: OSError):
        raise InputError(f"cannot list folder: {exc.strerror} ({exc.filename})", path=uri)

    files = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if links := [d for d in dirnames if (here / d).is_symlink()]:
            raise InputError(
                f"{(here / links[0]).relative_to(root)} is a link to a folder; links are not followed in a corpus "
                "folder (they may loop or lead out of it): name its target as a source of its own",
                path=uri,
            )
        dirnames[:] = [d for d in dirnames if not holds_dilforge_data(here / d)]
        files += [
            str(here / f)
            for f in filenames
            if not f.startswith(".") and f.lower().endswith(SUFFIXES) and (here / f).is_file()
        ]
    return sorted(files)


def regular_file(path: str, uri: str) -> str:
    """Corpora are regular files: a FIFO, a device (/dev/zero) or a socket would hang hashing and reading."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InputError(f"cannot open: {exc.strerror}", path=uri) from None
    if not stat.S_ISREG(mode):
        kinds = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}
        kind = kinds.get(stat.S_IFMT(mode), "not a regular file")
        raise InputError(
            f"is {kind}, not a regular file; corpora must be regular files (hashing and reading "
            "a stream would never end)",
            path=uri,
        )
    return path


def source_files(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The files a source names: an artifact's data folder by its manifest's list, else by `expand`."""
    folder = Path(uri)
    beside = folder.parent / MANIFEST_NAME
    if "://" in uri or not folder.is_dir() or not beside.is_file():
        return expand(uri, endpoint_url)
    manifest = parse_manifest(beside.read_bytes(), str(beside))
    if manifest.data_dir != folder.name:
        return expand(uri, endpoint_url)
    if files := sorted(str(folder / e.path) for e in manifest.files if e.path.lower().endswith(SUFFIXES)):
        return files
    raise InputError("the artifact's manifest lists no corpus file (.txt, .jsonl, .tsv, .parquet)", path=uri)


def data_digest(uri: str, endpoint_url: str | None = None) -> str:
    """A content digest for lineage: sha256 of local files, ETags on S3. One named file is its sha256, whatever its
    path (a copy is the same input); a folder or glob also hashes its files' names."""
    files = source_files(uri, endpoint_url)
    named = files == [uri.removeprefix("file://")]
    h = hashlib.sha256()
    for file_uri in files:
        parsed = urlparse(file_uri)
        if parsed.scheme != "s3":
            sha256 = stamped_sha256(Path(file_uri))
        else:
            head = S3Storage(parsed.netloc, "", endpoint_url).head(parsed.path.lstrip("/"))
            sha256 = head.get("Metadata", {}).get("sha256")
            if not sha256 or declared_uri(file_uri) == file_uri:  # an uploaded copy is hashed as the local file
                h.update(f"{file_uri}:{head['ETag']}\n".encode())
                continue
        if named:
            return sha256
        h.update(f"{os.path.basename(file_uri)}:{sha256}\n".encode())
    return h.hexdigest()


def stamped_sha256(path: Path) -> str:
    """sha256 of a local file, cached by its stat stamp (as git's index does): the checks after planning stat it."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    root = cache_root() / "digests"
    entry = root / hashlib.sha256(stamp.encode()).hexdigest()
    with contextlib.suppress(OSError):
        if len(cached := entry.read_text().strip()) == 64:
            return cached
    digest = sha256_file(path)
    with contextlib.suppress(OSError):  # best effort: an unwritable cache only costs the next read
        root.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, entry)
    return digest


# the package data the images install (services/*/pyproject.toml package-data): prompts, templates, task yamls
DATA_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".j2")


def code_version(stage: str) -> str:
    """The stage's code version: sha256 of the syntax trees of every dilforge module the stage imports and of its
    package's data files; docstrings are not hashed, so editing one keeps the ids."""
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
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds) and ast.get_docstring(node, clean=False) is not None:
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
    """The source file of a dilforge module, found without importing it."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:  # every dilforge top-level module is a package
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    return next((p for p in (base / "__init__.py", base.with_suffix(".py")) if p.is_file()), None)


def module_closure(entry: str) -> dict[str, Path]:
    """{module: file} of `entry` (and, for a package, its __main__) and every dilforge module it imports."""
    todo, found = [entry, f"{entry}.__main__"], {}
    while todo:
        name = todo.pop()
        if name in found or not name.startswith("dilforge_"):
            continue
        if (path := module_path(name)) is None:
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
