"""The tokenizer stage, run by `coordinator run` on a curate artifact holding a file its manifest does not list:
the stage reads nothing, fails in one line naming the file, and publishes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import publish

COORDINATOR = str(Path(sys.executable).parent / "coordinator")


def test_the_tokenizer_never_reads_a_file_injected_into_its_curate_input(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.jsonl").write_text("".join(json.dumps({"text": f"bir iki üç {i}"}) + "\n" for i in range(64)))
    curate = tmp_path / "store" / "artifacts" / "curate" / "0123456789abcdef"
    manifest = Manifest(
        code_version="test",
        kind="corpus",
        artifact_id=curate.name,
        run_id="web",
        stage="curate",
        producer=current_producer("test"),
        config={},
        data_dir="x",
        files=[],
    )
    published = publish(str(curate), out, manifest)
    data = curate / published.data_dir
    (data / "sub").mkdir()
    (data / "zz-injected.jsonl").write_text(json.dumps({"text": "POISON " * 50}) + "\n")
    (data / "sub" / "more.txt").write_text("POISON\n" * 500)
    config = {
        "run_id": "web",
        "store": {"uri": str(tmp_path / "store")},
        "tokenizer": {"strategy": "replace", "corpora": [{"uri": "artifact:curate"}], "vocab_sizes": [1000]},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(config))
    proc = _run_tokenizer(tmp_path, curate)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "not listed in the manifest" in errors[0] and ("more.txt" in errors[0] or "zz-injected" in errors[0])
    assert not list((tmp_path / "store" / "artifacts").glob("tokenizer/*/manifest.json")), "nothing published"
    (data / "zz-injected.jsonl").unlink()
    (data / "sub" / "more.txt").unlink()
    (data / "sub").rmdir()
    proc = _run_tokenizer(tmp_path, curate)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (tok,) = (tmp_path / "store" / "artifacts").glob("tokenizer/*/manifest.json")
    vocab = json.loads(next(tok.parent.glob("data-*/**/tokenizer.json")).read_text())["model"]["vocab"]
    assert not any("POISON" in token for token in vocab)


def _run_tokenizer(tmp_path: Path, curate: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [COORDINATOR, "run", "tokenizer", "-c", str(tmp_path / "p.yaml"), "--input", f"curate={curate}"],
        env={**os.environ, "DILFORGE_WORKDIR": str(tmp_path / "work"), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
