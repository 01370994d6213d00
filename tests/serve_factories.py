"""The az-tiny SFT artifact the serve tests run on: az-tiny's own `sft:` section (system prompt, data, LoRA)
for 2 steps on the tiny random Llama 3 model (published as a cpt artifact), merged/ published."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def az_tiny_sft(key: str):
    return yaml.safe_load((ROOT / "configs/az-tiny.yaml").read_text())["sft"][key]


def build_sft_artifact(root: Path, tiny_llama_dir: Path, data_root: Path):
    from dilforge_coordinator.cli import app
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import fetch, publish
    from typer.testing import CliRunner

    cpt_uri = f"{root}/cptstore/artifacts/cpt/tiny0000"
    publish(
        cpt_uri,
        tiny_llama_dir,
        Manifest(
            code_version="test",
            kind="model",
            artifact_id="tiny0000",
            run_id="fixture",
            stage="cpt",
            producer=current_producer("dilforge-test"),
            config={},
            data_dir="pending",
            files=[],
        ),
    )
    sft = yaml.safe_load((ROOT / "configs/az-tiny.yaml").read_text())["sft"]
    sft.update(num_steps=2, checkpoint_every=2, log_every=1)
    sft["train"] = [{**sft["train"][0], "max_docs": 16}]
    cfg = {"run_id": "az-tiny", "store": {"uri": str(root / "store")}, "sft": sft}
    (root / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    os.environ["DILFORGE_WORKDIR"] = str(root / "w")
    res = CliRunner().invoke(
        app, ["run", "sft", "--config", str(root / "p.yaml"), "--input", f"cpt={cpt_uri}", "--data", str(data_root)]
    )
    assert res.exit_code == 0, res.output
    return fetch(res.output.strip().splitlines()[-1].split("artifact: ")[1])
