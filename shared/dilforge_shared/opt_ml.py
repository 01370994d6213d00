"""SageMaker's /opt/ml layout, rooted anywhere (`DILFORGE_OPT_ML` for local runs).

The stage reads input/config/{hyperparameters,inputdataconfig,resourceconfig}.json and input/data/<channel>/
(upstream artifacts); it writes model/ (the artifact), output/ (failure file) and checkpoints/."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .settings import redact

OPT_ML_ENV = "DILFORGE_OPT_ML"


FAILURE_LIMIT = 1024 * 1024 - 1  # SageMaker reads at most 1 MiB of the failure file


@dataclass(frozen=True)
class OptMl:
    """The /opt/ml layout, rooted anywhere."""

    root: Path

    @classmethod
    def from_env(cls) -> OptMl:
        return cls(Path(os.environ.get(OPT_ML_ENV, "/opt/ml")))

    @property
    def config_dir(self) -> Path:
        return self.root / "input" / "config"

    @property
    def data_dir(self) -> Path:
        return self.root / "input" / "data"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard_dir(self) -> Path:
        return self.output_dir / "tensorboard"

    @property
    def failure_file(self) -> Path:
        return self.output_dir / "failure"

    def read_json(self, name: str, default: Any) -> Any:
        path = self.config_dir / name
        if not path.exists():
            return default
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None

    def write_inputs(
        self, hyperparameters: dict[str, str], resource: dict | None = None, input_data: dict | None = None
    ) -> None:
        """What SageMaker (or the local/compose backends) lays down before the container starts."""
        self.config_dir.mkdir(parents=True, exist_ok=True)
        (self.config_dir / "hyperparameters.json").write_text(json.dumps(hyperparameters))
        (self.config_dir / "inputdataconfig.json").write_text(json.dumps(input_data or {}))
        resource = resource or {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"}
        (self.config_dir / "resourceconfig.json").write_text(json.dumps(resource))


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
            return cls(
                current_host=raw["current_host"],
                hosts=sorted(raw["hosts"]),
                network_interface_name=raw.get("network_interface_name"),
                instance_type=raw.get("current_instance_type"),
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{opt.config_dir / 'resourceconfig.json'}: missing field {exc}") from None

    @property
    def node_rank(self) -> int:
        return self.hosts.index(self.current_host)

    @property
    def master_addr(self) -> str:
        return self.hosts[0]


FAILURE_RESERVE = 64 * 1024  # bytes held on the /opt/ml disk for the failure reason (reserve_failure_space)


def _reserve_file(opt: OptMl) -> Path:
    return opt.output_dir / ".failure-reserve"


def reserve_failure_space(opt: OptMl) -> None:
    """Hold FAILURE_RESERVE bytes on the /opt/ml disk from the start of a stage: when that disk fills (the work
    folder's checkpoints, datatrove's files), write_failure frees them first, so the failure still says why."""
    try:
        opt.output_dir.mkdir(parents=True, exist_ok=True)
        with open(_reserve_file(opt), "wb") as f:
            f.write(b"\0" * FAILURE_RESERVE)  # written, not sparse: the blocks are really taken
    except OSError:
        pass


def release_failure_space(opt: OptMl) -> None:
    with contextlib.suppress(OSError):
        _reserve_file(opt).unlink(missing_ok=True)


def write_failure(opt: OptMl, message: str) -> None:
    """SageMaker's failure file (its job status shows it; the coordinator records it), secrets redacted. The space
    reserved at the start is freed first; if the file still cannot be written, an empty one is not left behind
    (it would read as a failure without a reason)."""
    release_failure_space(opt)
    try:
        opt.output_dir.mkdir(parents=True, exist_ok=True)
        opt.failure_file.write_text(redact(message)[:FAILURE_LIMIT])
    except OSError:
        with contextlib.suppress(OSError):
            if opt.failure_file.stat().st_size == 0:
                opt.failure_file.unlink()
