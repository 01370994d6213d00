"""The container contract, as SageMaker runs a bring-your-own container. `stage_main`: /opt/ml → hyperparameters →
`StageContext` → the stage → metrics validated, inputs proved to give the planned id, files and manifest published.
Any error leaves the failure file, a non-zero exit and nothing published."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from . import identity
from .configs import ARTIFACT_PREFIX, StageConfig, validate_model
from .errors import ConfigError, DilforgeError, InputError, UnsafePathError, field_errors
from .identity import artifact_id, config_refs
from .manifest import MANIFEST_NAME, InputRef, Manifest, check_name, current_producer, parse_manifest, sha256_bytes
from .settings import install_log_masking, redact, settings
from .store import Artifact, fetch, publish, read_uri_bytes, verify_files

log = logging.getLogger("dilforge")

OPT_ML_ENV = "DILFORGE_OPT_ML"  # the /opt/ml root of a local run
FAILURE_LIMIT = 1024 * 1024 - 1  # SageMaker reads at most 1 MiB of the failure file
FAILURE_RESERVE = 64 * 1024  # bytes held on the /opt/ml disk from the start, freed to write the failure reason
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OptMl:
    """SageMaker's /opt/ml layout, rooted anywhere."""

    def __init__(self, root: Path):
        self.root = root
        self.config_dir = root / "input" / "config"
        self.data_dir = root / "input" / "data"
        self.model_dir = root / "model"
        self.output_dir = root / "output"
        self.checkpoint_dir = root / "checkpoints"
        self.tensorboard_dir = self.output_dir / "tensorboard"
        self.failure_file = self.output_dir / "failure"
        self.failure_reserve = self.output_dir / ".failure-reserve"

    @classmethod
    def from_env(cls) -> OptMl:
        return cls(Path(os.environ.get(OPT_ML_ENV, "/opt/ml")))

    def read_json(self, name: str, default: Any) -> Any:
        path = self.config_dir / name
        return parse_json(path.read_text(), str(path)) if path.exists() else default


def parse_json(text: str, where: str) -> Any:
    """`text` as JSON, or a ConfigError naming `where`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from None


@dataclass(frozen=True)
class ResourceConfig:
    current_host: str
    hosts: list[str]
    network_interface_name: str | None = None
    instance_type: str | None = None

    @classmethod
    def load(cls, opt: OptMl) -> ResourceConfig:
        raw = opt.read_json("resourceconfig.json", {"current_host": "algo-1", "hosts": ["algo-1"]})
        try:
            interface, instance_type = raw.get("network_interface_name"), raw.get("current_instance_type")
            return cls(raw["current_host"], sorted(raw["hosts"]), interface, instance_type)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{opt.config_dir / 'resourceconfig.json'}: missing field {exc}") from None

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)


def write_failure(opt: OptMl, message: str) -> None:
    """SageMaker's failure file, secrets redacted, written in the space `stage_main` held; never left empty."""
    with contextlib.suppress(OSError):
        opt.failure_reserve.unlink(missing_ok=True)
    try:
        opt.output_dir.mkdir(parents=True, exist_ok=True)
        opt.failure_file.write_text(redact(message)[:FAILURE_LIMIT])
    except OSError:
        with contextlib.suppress(OSError):
            if opt.failure_file.stat().st_size == 0:
                opt.failure_file.unlink()


HYPERPARAMETER_KEYS = {"stage_config", "stage_config_uri", "artifact_uri", "run_id", "inputs", "s3_endpoint_url"}


@dataclass
class StageRequest:
    """A validated request to run one stage: what the hyperparameters said, parsed once."""

    config: StageConfig
    artifact_uri: str
    run_id: str
    inputs: dict[str, str]
    s3_endpoint_url: str | None = None


def parse_hyperparameters(hp: dict[str, Any], config_cls: type[StageConfig], source: str) -> StageRequest:
    """SageMaker's string hyperparameters as a StageRequest: only HYPERPARAMETER_KEYS and `sagemaker_*`."""
    if bad := [k for k in hp if k not in HYPERPARAMETER_KEYS and not k.startswith("sagemaker_")]:
        raise ConfigError(f"{source}: unknown hyperparameters {sorted(bad)}; expected {sorted(HYPERPARAMETER_KEYS)}")
    if bad := [k for k, v in hp.items() if not isinstance(v, str)]:
        raise ConfigError(f"{source}: hyperparameter {bad[0]!r} must be a string (SageMaker passes strings)")
    if missing := [k for k in ("artifact_uri", "run_id") if not hp.get(k)]:
        raise ConfigError(f"{source}: hyperparameter {missing[0]!r} is required")
    endpoint = hp.get("s3_endpoint_url") or None
    if ("stage_config" in hp) == ("stage_config_uri" in hp):
        raise ConfigError(f"{source}: give one of the hyperparameters 'stage_config' and 'stage_config_uri'")
    if "stage_config" in hp:
        doc, doc_source = hp["stage_config"], f"{source}: stage_config"
    else:
        doc_source = hp["stage_config_uri"]
        doc = read_uri_bytes(doc_source, endpoint).decode()
    config = validate_model(config_cls, parse_json(doc, doc_source), doc_source)
    inputs = parse_json(hp.get("inputs", "{}"), f"{source}: hyperparameter 'inputs'")
    if not isinstance(inputs, dict) or not all(isinstance(v, str) for v in inputs.values()):
        raise ConfigError(f"{source}: hyperparameter 'inputs' must be a JSON object of name -> manifest URI")
    for name in inputs:  # input names become channel folders (/opt/ml/input/data/<name>)
        try:
            check_name(name, "input name")
        except UnsafePathError as exc:
            raise ConfigError(f"{source}: hyperparameter 'inputs': {exc}") from None
    if missing := [name for name in config.needed_inputs() if name not in inputs]:
        raise ConfigError(f"{source}: {config.missing_inputs_message(missing)}")
    return StageRequest(config, hp["artifact_uri"].rstrip("/"), hp["run_id"], inputs, endpoint)


@dataclass
class StageContext:
    """What a stage's run function gets besides its config: where to write, and its inputs."""

    request: StageRequest
    opt: OptMl
    resources: ResourceConfig
    _artifacts: dict[str, Artifact] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str | None:
        return self.request.s3_endpoint_url

    @property
    def cache_dir(self) -> Path:
        """Where the stage keeps downloads: $DILFORGE_CACHE, else <opt_ml>/cache (on SageMaker the ML volume)."""
        return settings().cache or self.opt.root / "cache"

    def input(self, name: str) -> Artifact:
        """An upstream artifact, verified: from its SageMaker channel when mounted, else from the store."""
        if name not in self._artifacts:
            if name not in self.request.inputs:
                given = sorted(self.request.inputs)
                raise ConfigError(f"stage {self.request.config.stage} has no input {name!r} (inputs given: {given})")
            uri, channel = self.request.inputs[name], self.opt.data_dir / name
            if (channel / MANIFEST_NAME).is_file():
                data = (channel / MANIFEST_NAME).read_bytes()
                manifest = parse_manifest(data, str(channel / MANIFEST_NAME))
                verify_files(manifest, channel / manifest.data_dir, str(channel))
                self._artifacts[name] = Artifact(uri, manifest, sha256_bytes(data), channel / manifest.data_dir)
            else:
                self._artifacts[name] = fetch(uri, cache_dir=self.cache_dir, endpoint_url=self.endpoint_url)
        return self._artifacts[name]

    def has_input(self, name: str) -> bool:
        return name in self.request.inputs


@dataclass
class StageResult:
    """What a run function returns: the metrics for the manifest (its files are what it left in model_dir)."""

    metrics: dict[str, Any]


def lineage(ctx: StageContext) -> list[InputRef]:
    """Exactly the refs the coordinator fingerprinted (its `pipeline.stage_refs`), so the id can be recomputed."""
    refs = [ctx.input(name).ref(name) for name in sorted(ctx.request.inputs)]
    return [*refs, *config_refs(ctx.request.config, ctx.endpoint_url)]


def resolve_sources(config: StageConfig, ctx: StageContext) -> StageConfig:
    """The config the stage runs with: each `artifact:<stage>` source at that artifact's local folder (identity
    hashes such sources as the artifact's id, never by path)."""
    if not config.source_inputs():
        return config

    def walk(value):
        if isinstance(value, dict):
            uri = value.get("uri")
            if isinstance(uri, str) and uri.startswith(ARTIFACT_PREFIX):
                return {**value, "uri": str(ctx.input(uri[len(ARTIFACT_PREFIX) :]).path)}
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return type(config).model_validate(walk(config.model_dump(mode="json")))


def planned_id(ctx: StageContext) -> str | None:
    """The artifact id the coordinator planned (the folder name), or None for a folder not named by an id."""
    name = ctx.request.artifact_uri.rsplit("/", 1)[-1]
    return name if re.fullmatch(r"[0-9a-f]{16}", name) else None


def check_identity(ctx: StageContext, refs: list[InputRef], since: list[InputRef] | None = None) -> None:
    """The inputs as read now (`refs`) must give the planned id, and equal `since` (the refs seen at the start):
    checked before the stage runs and again before publishing."""
    if (expected := planned_id(ctx)) is None:
        return
    stage = ctx.request.config.stage
    if changed := [
        f"{ref.name} ({ref.uri}): sha256 {old.sha256[:12]}… at start, {ref.sha256[:12]}… now"
        for ref in refs
        for old in (since or [])
        if old.name == ref.name and old.sha256 != ref.sha256
    ]:
        raise DilforgeError(
            f"stage {stage}: inputs changed while the stage ran: {'; '.join(changed)}; nothing "
            "published; rerun once the data is stable"
        )
    if (got := artifact_id(ctx.request.config, refs)) != expected:
        names = ", ".join(ref.name for ref in refs if ref.kind == "data") or "none"
        raise DilforgeError(
            f"stage {stage}: the inputs and code as read now give artifact id {got}, not the planned {expected}: data, "
            f"an upstream artifact or the stage's code changed after the run was planned (data inputs: {names}); "
            "nothing published; rerun to plan again"
        )


def publish_result(
    ctx: StageContext, result: StageResult, package: str, start_refs: list[InputRef] | None = None
) -> Manifest:
    """Check the metrics and the planned id, then publish files + manifest."""
    config = ctx.request.config
    validate_metrics(config.stage, type(config).metrics_model, result.metrics)
    inputs = lineage(ctx)
    check_identity(ctx, inputs, start_refs)
    manifest = Manifest(
        kind=config.artifact_kind,
        artifact_id=ctx.request.artifact_uri.rsplit("/", 1)[-1],
        run_id=ctx.request.run_id,
        stage=config.stage,
        code_version=identity.code_version(config.stage),
        producer=current_producer(package),
        config=config.model_dump(mode="json"),
        inputs=inputs,
        data_dir="pending",
        files=[],
        metrics=result.metrics,
    )
    return publish(ctx.request.artifact_uri, ctx.opt.model_dir, manifest, ctx.endpoint_url)


M = TypeVar("M", bound=BaseModel)


def validate_metrics(stage: str, model: type[M], metrics: dict[str, Any]) -> M:
    """The metrics a run of `stage` is about to publish, as its metrics model; DilforgeError naming the field."""
    try:
        return model.model_validate(metrics)
    except ValidationError as exc:
        raise DilforgeError(
            f"stage {stage} publishes metrics that do not match {model.__module__}.{model.__name__}: "
            + field_errors(exc, within=("metrics",))
        ) from None


def read_metrics(model: type[M], metrics: dict[str, Any], uri: str) -> M:
    """An upstream manifest's metrics, typed; InputError naming the artifact and field when they do not parse."""
    try:
        return model.model_validate(metrics)
    except ValidationError as exc:
        raise InputError(
            f"metrics do not match {model.__name__} (an artifact of another dilforge version?): "
            + field_errors(exc, within=("metrics",)),
            path=uri,
        ) from None


def log_config(config: BaseModel, derived: dict[str, Any] | None = None) -> None:
    """Log the resolved config and derived numbers once, at start."""
    log.info("resolved config: %s", config.model_dump_json())
    if derived:
        log.info("derived: %s", json.dumps(derived, sort_keys=True, default=str))


class Terminated(DilforgeError):
    """SIGTERM arrived (SageMaker stop or spot interruption)."""


def install_sigterm_handler() -> dict[str, bool]:
    """Turn SIGTERM into a flag the training loop polls, so it can checkpoint before SageMaker kills it."""
    flag = {"stop": False}

    def handler(signum, frame):
        flag["stop"] = True
        log.warning("SIGTERM received: will checkpoint and stop at the next step")

    signal.signal(signal.SIGTERM, handler)
    return flag


def stage_main(
    config_cls: type[StageConfig],
    run_fn: Callable[[StageConfig, StageContext], StageResult],
    package: str,
    argv: list[str] | None = None,
    publish_from_this_process: bool = True,
) -> int:
    """Entrypoint of every stage image (`IMAGE train`): any exception becomes a failure file and a non-zero exit."""
    argv = sys.argv[1:] if argv is None else argv
    # stdout, credentials masked on every line (botocore logs keys at DEBUG)
    logging.basicConfig(level=settings().log_level, format=LOG_FORMAT, stream=sys.stdout, force=True)
    install_log_masking()
    opt = OptMl.from_env()
    if argv[:1] != ["train"]:
        print(f"usage: {package} train   (SageMaker contract; /opt/ml root from ${OPT_ML_ENV})", file=sys.stderr)
        return 2
    try:
        with contextlib.suppress(OSError):  # held for write_failure: a full disk still ends with its reason
            opt.output_dir.mkdir(parents=True, exist_ok=True)
            opt.failure_reserve.write_bytes(b"\0" * FAILURE_RESERVE)  # written, not sparse
        hp_path = opt.config_dir / "hyperparameters.json"
        if (hp := opt.read_json(hp_path.name, None)) is None:
            raise ConfigError(f"{hp_path}: missing; the stage needs its hyperparameters")
        request = parse_hyperparameters(hp, config_cls, str(hp_path))
        ctx = StageContext(request=request, opt=opt, resources=ResourceConfig.load(opt))
        for d in (opt.model_dir, opt.output_dir):
            d.mkdir(parents=True, exist_ok=True)
        log.info("stage %s run %s → %s", config_cls.stage, request.run_id, request.artifact_uri)
        start_refs = None
        if publish_from_this_process and planned_id(ctx) is not None:  # proved before the work and after it
            start_refs = lineage(ctx)
            check_identity(ctx, start_refs)
        result = run_fn(resolve_sources(request.config, ctx), ctx)
        if publish_from_this_process:
            manifest = publish_result(ctx, result, package, start_refs)
            log.info("published %s/%s (%d files)", request.artifact_uri, MANIFEST_NAME, len(manifest.files))
        with contextlib.suppress(OSError):
            opt.failure_reserve.unlink(missing_ok=True)
        return 0
    except DilforgeError as exc:
        message = str(exc)
    except OSError as exc:  # a full disk, a file-size limit, a read-only mount: the operator's to fix, one line
        where = f"{exc.filename}: " if exc.filename else ""
        message = f"{where}{exc.strerror or exc}" + (
            " (disk full or a file-size limit)" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else ""
        )
        log.debug("%s", traceback.format_exc())
    except Exception as exc:  # noqa: BLE001 - an unexpected bug still leaves a reason for SageMaker to show
        message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    log.error("%s", message)
    write_failure(opt, message)
    return 1
