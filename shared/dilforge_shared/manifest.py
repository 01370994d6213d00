"""The versioned artifact manifest, the only thing stages say to each other: kind, lineage, resolved config, every
file with size and sha256, metrics. A reader accepts its own major version (a newer minor's fields ignored)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import re
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ManifestError, UnsafePathError, field_errors
from .settings import redact_values, settings

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1.3.0"
MANIFEST_NAME = "manifest.json"

StageName = Literal["model", "curate", "tokenizer", "cpt", "sft", "eval"]
STAGES: tuple[StageName, ...] = get_args(StageName)  # the pipeline's stages, in order

ArtifactKind = Literal["corpus", "tokenizer", "model", "adapter", "eval_report"]

KEY_LIBRARIES = "torch transformers tokenizers trl peft accelerate datasets liger-kernel safetensors pydantic boto3"


# Artifact ids, run ids, stage and input names: one path component, no leading dot, nothing a shell or a URI
# would read specially. Fingerprints (16 hex digits) and every run id the pipeline config accepts match.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# A local input uploaded for `--backend sagemaker-local`: s3://<bucket>/data/<16 hex of its content>/<its absolute
# path>, its sha256 as metadata. Identity reads it as that local path (`declared_uri`), so the copy gets the local id.
UPLOADED_COPY = re.compile(r"^s3://[a-z0-9][a-z0-9.-]*/data/[0-9a-f]{16}(/.+)$")


def declared_uri(uri: str) -> str:
    """The URI a config declared: the local path for an uploaded copy (UPLOADED_COPY), else `uri` itself."""
    match = UPLOADED_COPY.match(uri)
    return match.group(1) if match else uri


def check_relative_path(path: str) -> str:
    """Reject absolute paths, `..`, backslashes and empty parts: a file name may not escape its artifact."""
    if not path or "\\" in path or any(part in ("..", "", ".") for part in path.split("/")):  # "" for "/x", "a//b"
        raise UnsafePathError(f"unsafe file path {path!r}: must be relative, without '..' or empty parts")
    return path


def check_name(value: str, what: str) -> str:
    """`value` as one safe path component (an id or a name), else UnsafePathError naming `what`."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise UnsafePathError(
            f"{what} {value!r} is not a valid name: use letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit, no '..')"
        )
    return value


class Metrics(BaseModel):
    """Base of a stage's typed metrics: unknown keys are an error, so a renamed metric fails producer and readers."""

    model_config = ConfigDict(extra="forbid")


class Producer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    package: str = Field(description="Python distribution that ran the stage, e.g. dilforge-cpt.")
    version: str = Field(description="Version of that distribution.")
    git_sha: str | None = Field(default=None, description="Commit of the dilforge source, when known.")
    image: str | None = Field(default=None, description="Container image (by digest when known) the stage ran in.")
    python: str = Field(default_factory=platform.python_version, description="Python version.")
    libraries: dict[str, str] = Field(default_factory=dict, description="Versions of key libraries installed.")


class InputRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Role of the input, e.g. 'tokenizer', 'model', or 'data:<uri>'.")
    kind: Literal["manifest", "data"] = Field(description="An upstream artifact manifest, or a raw data file.")
    uri: str = Field(description="Where the input was read from.")
    sha256: str = Field(
        description="An upstream artifact: 'artifact:<artifact id>'; data: sha256 of the content (S3 data may use "
        "'etag:<etag>')."
    )


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Path relative to the artifact's data directory, '/'-separated.")
    size: int = Field(ge=0, description="Size in bytes.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Hex sha256 of the content.")

    _check_path = field_validator("path")(lambda cls, v: check_relative_path(v))


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: str = Field(default=SCHEMA_VERSION, description="Semver of this schema.")
    kind: ArtifactKind = Field(description="What the artifact is.")
    artifact_id: str = Field(description="Fingerprint of stage, config and inputs; the artifact's folder name.")
    run_id: str = Field(description="Pipeline run that produced the artifact.")
    stage: StageName = Field(description="Stage that produced the artifact.")
    code_version: str = Field(
        description="The stage's code version, part of the artifact id: a digest of the code the stage runs "
        "(dilforge_shared.identity.code_version)."
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    producer: Producer
    config: dict[str, Any] = Field(description="The full resolved stage config.")
    inputs: list[InputRef] = Field(default_factory=list)
    data_dir: str = Field(description="Folder, relative to the manifest, that holds the files.")
    files: list[FileEntry]
    metrics: dict[str, Any] = Field(default_factory=dict)

    _check_data_dir = field_validator("data_dir")(lambda cls, v: check_relative_path(v))
    # The id names the artifact's folder and its download cache entry; a `../` in a manifest from S3 must not
    # steer where fetch writes. The run id names a run record.
    _check_ids = field_validator("artifact_id", "run_id")(lambda cls, v, info: check_name(v, info.field_name))

    def to_json(self) -> bytes:
        """The manifest as written: every string passed through `settings.redact`, so no secret reaches a store."""
        data = self.model_dump(mode="json")
        redacted = redact_values(data)
        shown = self if redacted == data else Manifest.model_validate(redacted)
        return shown.model_dump_json(indent=2).encode() + b"\n"


def parse_manifest(data: bytes | str, source: str) -> Manifest:
    """Parse manifest JSON with the version rule; errors name `source`."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError (not UTF-8), nested too deep
        raise ManifestError(f"{source}: not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise ManifestError(f"{source}: not a dilforge manifest (no schema_version)")
    version = str(raw["schema_version"])
    try:
        major, minor, _ = (int(x) for x in version.split("."))
    except ValueError:
        raise ManifestError(f"{source}: schema_version {version!r} is not semver MAJOR.MINOR.PATCH") from None
    our_major, our_minor, _ = (int(x) for x in SCHEMA_VERSION.split("."))
    if major != our_major:
        newer = "newer" if major > our_major else "older"
        raise ManifestError(
            f"{source}: manifest schema {version} is from a {newer} major version; this dilforge reads "
            f"schema {our_major}.x only (installed schema {SCHEMA_VERSION}); use a dilforge release with "
            f"schema {major}.x to read it"
        )
    if minor > our_minor:
        if unknown := sorted(set(raw) - set(Manifest.model_fields)):
            log.warning("%s: schema %s is newer than %s; ignoring fields %s", source, version, SCHEMA_VERSION, unknown)
        raw = {k: v for k, v in raw.items() if k in Manifest.model_fields}
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"{source}: invalid manifest: {field_errors(exc)}") from None


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def scan_files(root: Path) -> list[FileEntry]:
    """Every regular file under root, sorted, with size and sha256."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [FileEntry(path=p.relative_to(root).as_posix(), size=p.stat().st_size, sha256=sha256_file(p)) for p in files]


def git_sha(cwd: Path | None = None) -> str | None:
    """The dilforge source commit: DILFORGE_GIT_SHA, else `git rev-parse HEAD` in `cwd`'s checkout."""
    if sha := settings().git_sha:
        return sha
    cwd = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=cwd)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def current_producer(package: str) -> Producer:
    versions = {}
    for name in (package, *KEY_LIBRARIES.split()):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    version = versions.pop(package, "unknown")
    return Producer(package=package, version=version, git_sha=git_sha(), image=settings().image, libraries=versions)


def artifact_ref(name: str, uri: str, manifest: Manifest) -> InputRef:
    """An upstream artifact as lineage records it: by its artifact id, never by its manifest's or files' bytes."""
    return InputRef(name=name, kind="manifest", uri=uri, sha256=f"artifact:{manifest.artifact_id}")


def by_content(value: Any, content: dict[str, str]) -> Any:
    """`value` (a config's identity) with every string that is an input's URI replaced by that input's digest."""
    if isinstance(value, dict):
        return {k: by_content(v, content) for k, v in value.items()}
    if isinstance(value, list):
        return [by_content(v, content) for v in value]
    return f"sha256:{content[value]}" if isinstance(value, str) and value in content else value


def fingerprint(stage: str, identity: dict[str, Any], inputs: list[InputRef], code_version: str) -> str:
    """Artifact id: the stage, its code version, its config's identity fields and its inputs' digests (same values,
    same id: reruns reuse). An input counts by its role and content, never by where it lives nor its name."""
    named = ("data:", "model:")  # inputs the config names (a data source, a model folder)
    payload = {
        "stage": stage,
        "code_version": code_version,
        "config": by_content(identity, {declared_uri(r.uri): r.sha256 for r in inputs if r.name.startswith(named)}),
        "inputs": sorted([r.name.split(":", 1)[0] if r.name.startswith(named) else r.name, r.sha256] for r in inputs),
        "schema_major": SCHEMA_VERSION.split(".")[0],
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return sha256_bytes(canonical.encode())[:16]
