"""A 200 MB single-line input per stage, through the real CLI: a clear message and peak RSS under 2 GB.

Peak RSS is the largest resident size of any process below a fresh wrapper (RUSAGE_CHILDREN), i.e. of the
coordinator or the stage. The files are generated in tmp, never committed. Also: a model folder whose
config carries `auto_map` → evil.py, given to CPT as base_model with "y" on the coordinator's stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import factories
import pytest
import yaml

pytestmark = pytest.mark.slow

SIZE = 200 << 20
RSS_LIMIT_KB = 2 << 20  # 2 GiB
WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:])\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)
TINY_CPT = factories.TINY_CPT_SECTION


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    """200 MB without a newline: as plain text and as the start of one JSONL record."""
    root = tmp_path_factory.mktemp("big")
    block = ("söz " * 16384).encode()
    paths = {"txt": root / "one-line.txt", "jsonl": root / "one-line.jsonl"}
    for kind, path in paths.items():
        with open(path, "wb") as f:
            if kind == "jsonl":
                f.write(b'{"messages": [{"role": "user", "content": "')
            written = 0
            while written < SIZE:
                f.write(block)
                written += len(block)
    return paths


def run_cli(tmp: Path, args: list[str], stdin: bytes = b"") -> tuple[subprocess.CompletedProcess, int]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp / "work"),
        "DILFORGE_CACHE": str(tmp / "cache"),
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, sys.executable, "-m", "dilforge_coordinator.cli", *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=600,
        check=False,
    )
    err = proc.stderr.decode(errors="replace")
    peak = int(err.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(errors="replace"), err), peak


def publish_folder(store: Path, stage: str, kind: str, folder: Path) -> str:
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    uri = f"{store}/artifacts/{stage}/fixture"
    publish(
        uri,
        folder,
        Manifest(
            code_version="test",
            kind=kind,
            artifact_id="fixture",
            run_id="fixture",
            stage=stage,
            producer=current_producer("test"),
            config={},
            data_dir="x",
            files=[],
        ),
    )
    return uri


def pipeline(tmp: Path, stage: str, section: dict) -> Path:
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"run_id": "big", "store": {"uri": str(tmp / "store")}, stage: section}))
    return path


def stage_case(stage: str, big: dict, tmp: Path, tiny_tokenizer_dir: Path, tiny_llama_dir: Path):
    extra: list[str] = []
    if stage == "tokenizer":
        section = {"strategy": "replace", "corpora": [{"uri": str(big["txt"])}], "vocab_sizes": [600]}
    elif stage == "cpt":
        tok = publish_folder(tmp / "store", "tokenizer", "tokenizer", tiny_tokenizer_dir)
        section = {**TINY_CPT, "corpora": [{"uri": str(big["txt"]), "max_docs": 100}]}
        extra = ["--input", f"tokenizer={tok}"]
    elif stage == "sft":
        section = {
            "base_model": str(tiny_llama_dir),
            "train": [{"uri": str(big["jsonl"]), "layout": "messages"}],
            "num_steps": 1,
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
            "max_length": 64,
        }
    else:
        section = {
            "models": [{"label": "base", "uri": str(tiny_llama_dir)}],
            "text_sets": [{"uri": str(big["txt"]), "name": "big"}],
            "max_bytes_per_set": 20000,
            "generation": {"max_new_tokens": 2, "num_prompts": 1},
            "bpb": {"window": 64, "stride": 32},
        }
    return ["run", stage, "-c", str(pipeline(tmp, stage, section)), *extra]


@pytest.mark.parametrize("stage", ["tokenizer", "cpt", "sft", "eval"])
def test_a_200_mb_single_line_is_bounded_per_stage(stage, big, tmp_path, tiny_tokenizer_dir, tiny_llama_dir):
    args = stage_case(stage, big, tmp_path, tiny_tokenizer_dir, tiny_llama_dir)
    proc, peak_kb = run_cli(tmp_path, args)
    print(f"{stage}: exit {proc.returncode}, peak RSS {peak_kb / 1024:.0f} MiB")
    assert peak_kb < RSS_LIMIT_KB, f"{stage}: peak RSS {peak_kb / 1024:.0f} MiB"
    if stage == "eval":
        # eval honours max_bytes_per_set before materialising text: the one document is cut to the cap
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    name = big["jsonl" if stage == "sft" else "txt"].name
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"{name}:1: line longer than {32 << 20} bytes (max_document_bytes)" in proc.stderr, proc.stderr[-3000:]


def test_cpt_refuses_a_base_model_whose_code_would_run(tmp_path, tiny_tokenizer_dir, tiny_llama_dir):
    """auto_map → evil.py with an unknown model_type, and "y" answered on stdin: refused, nothing executed."""
    import shutil

    evil = tmp_path / "evil-model"
    shutil.copytree(tiny_llama_dir, evil)
    marker = tmp_path / "EXECUTED"
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    cfg = json.loads((evil / "config.json").read_text())
    cfg.update(
        model_type="evil_llama", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    )
    (evil / "config.json").write_text(json.dumps(cfg))
    tok = publish_folder(tmp_path / "store", "tokenizer", "tokenizer", tiny_tokenizer_dir)
    data = Path(os.environ["DILFORGE_DATA"]) / "az/train/azwiki_sentences_cv_extractor.txt"
    section = {**TINY_CPT, "base_model": str(evil), "corpora": [{"uri": str(data), "max_docs": 100}]}
    section.pop("scratch_model")
    proc, _ = run_cli(
        tmp_path,
        ["run", "cpt", "-c", str(pipeline(tmp_path, "cpt", section)), "--input", f"tokenizer={tok}"],
        stdin=b"y\ny\ny\n",
    )
    assert proc.returncode == 1
    assert "trust_remote_code" in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists(), "code from the model folder ran"
