"""Reliability round 3 (issue 23 items 4 and 5): `--input` names and kinds are checked; parsing and planning are
bounded (YAML aliases, corpora that are not regular files) and interruptible, the record ending `cancelled`."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.records import ArtifactStore
from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.identity import data_digest
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import publish
from test_reliability import write_config
from typer.testing import CliRunner


def _artifact(store: Path, stage: str, kind: str, artifact_id: str) -> str:
    out = store.parent / f"out-{artifact_id}"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    uri = ArtifactStore(str(store)).artifact_uri(stage, artifact_id)
    publish(
        uri,
        out,
        Manifest(
            code_version="test",
            kind=kind,
            artifact_id=artifact_id,
            run_id="r",
            stage=stage,
            producer=current_producer("test"),
            config={},
            data_dir="x",
            files=[],
        ),
    )
    return uri


def _cpt_config(tmp_path: Path) -> Path:
    (tmp_path / "corpus.txt").write_text("bir iki üç\n")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    path = tmp_path / "cpt.yaml"
    path.write_text(
        textwrap.dedent(f"""
        run_id: r
        store: {{uri: {tmp_path / "store"}}}
        cpt:
          base_model: {base}
          corpora: [{{uri: "{tmp_path / "corpus.txt"}"}}]
          validation: [{{uri: "{tmp_path / "corpus.txt"}"}}]
          phase1: {{num_steps: 1}}
    """)
    )
    return path


# ---- --input ----------------------------------------------------------------------------------------------


def test_an_sft_adapter_given_as_the_tokenizer_is_refused_naming_both(tmp_path):
    config = _cpt_config(tmp_path)
    adapter = _artifact(tmp_path / "store", "sft", "adapter", "sft0000000000001")
    result = CliRunner().invoke(app, ["run", "cpt", "-c", str(config), "--input", f"tokenizer={adapter}"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "input tokenizer=" in result.output and "'adapter' artifact" in result.output
    assert "needs a 'tokenizer' artifact" in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "store" / "artifacts" / "cpt").exists(), "nothing planned or published"


def test_a_tokenizer_artifact_given_as_the_tokenizer_passes_the_kind_check(tmp_path):
    tok = _artifact(tmp_path / "store", "tokenizer", "tokenizer", "tok0000000000001")
    pl.check_input_kinds("cpt", {"tokenizer": tok}, None)
    model = _artifact(tmp_path / "store", "cpt", "model", "cpt0000000000001")
    with pytest.raises(Exception, match="input tokenizer=.*'model' artifact .*stage cpt.*needs a 'tokenizer'"):
        pl.check_input_kinds("cpt", {"tokenizer": model}, None)


@pytest.mark.parametrize(
    "item, expected",
    [
        ("tokenizr=/x", ("stage cpt has no input named 'tokenizr'; its inputs: model, tokenizer")),
        ("tokenizer", "expected NAME=URI"),
        ("=/x", "expected NAME=URI"),
    ],
)
def test_a_misspelled_or_malformed_input_is_refused(tmp_path, item, expected):
    result = CliRunner().invoke(app, ["run", "cpt", "-c", str(_cpt_config(tmp_path)), "--input", item])
    assert result.exit_code == 1 and expected in result.output and "Traceback" not in result.output, result.output


def test_run_of_something_that_is_not_a_stage_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["run", "store", "-c", str(_cpt_config(tmp_path))])
    assert result.exit_code == 1 and "not a stage" in result.output and "Traceback" not in result.output, result.output


# ---- bounded YAML -------------------------------------------------------------------------------------------

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)


def test_a_billion_laughs_config_is_refused_in_one_line_fast(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS + "run_id: r\nstore: {uri: /tmp/s}\n")
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["validate", "-c", str(path)])
    assert time.perf_counter() - t0 < 5
    assert result.exit_code == 1 and "aliases expand to more than 100,000 nodes" in result.output, result.output
    assert result.output.count("\n") == 1 and str(path) in result.output


def test_a_recursive_alias_is_refused_and_ordinary_aliases_still_work(tmp_path):
    path = tmp_path / "rec.yaml"
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="recursive"):
        load_pipeline(path)
    ok = write_config(tmp_path)
    text = ok.read_text().replace("vocab_sizes: [1000]", "vocab_sizes: &v [1000]") + "x-copy: *v\n"
    ok.write_text(text.replace("x-copy: *v\n", ""))
    assert load_pipeline(ok).tokenizer.vocab_sizes == [1000]


# ---- corpora that are not regular files ---------------------------------------------------------------------


def test_a_fifo_or_a_device_as_corpus_is_refused_at_planning_without_hanging(tmp_path):
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    for uri in (str(fifo), "/dev/zero", str(tmp_path / "*.fifo")):
        with pytest.raises(InputError, match="not a regular file"):
            data_digest(uri)
        with pytest.raises(InputError, match="not a regular file"):
            next(iter_texts(uri))
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace(str(tmp_path / "corpus.txt"), "/dev/zero"))
    result = CliRunner().invoke(app, ["run-all", "-c", str(config)])
    assert result.exit_code == 1 and "/dev/zero: is a device, not a regular file" in result.output, result.output
    assert json.loads((tmp_path / "store" / "runs" / "demo.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    "name, data, what",
    [
        ("c.txt", gzip.compress(b"bir iki\n", mtime=0), "gzip-compressed, not text: name it .gz"),
        ("c.txt", b"BZh91AY&SY" + bytes(20), "bzip2-compressed"),
        ("c.txt.zst", b"\x28\xb5\x2f\xfd" + bytes(20), "zstd-compressed"),
        ("c.xz", b"\xfd7zXZ\x00" + bytes(20), "xz-compressed"),
        ("c.zip", b"PK\x03\x04" + bytes(20), "a zip archive"),
    ],
)
def test_a_compressed_corpus_is_named_as_such_not_as_invalid_utf8(tmp_path, name, data, what):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(InputError, match=what):
        list(iter_texts(str(path)))
    plain = tmp_path / "plain.txt"
    plain.write_text("BZh is fine as text\n")
    assert list(iter_texts(str(plain))) == ["BZh is fine as text"]


def test_a_corrupt_parquet_file_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "corpus.parquet"
    path.write_bytes(b"PAR1" + os.urandom(64) + b"PAR1")
    with pytest.raises(InputError, match=r"corpus.parquet: not a readable parquet file"):
        list(iter_texts(str(path)))


# ---- interruptible planning ----------------------------------------------------------------------------------


def _coordinator(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "dilforge_coordinator.cli", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "where, sig",
    [
        ("waiting_for_the_artifact_lock", signal.SIGTERM),
        ("hashing_the_corpus", signal.SIGTERM),
        ("hashing_the_corpus", signal.SIGINT),
    ],
)
def test_a_stop_signal_while_planning_says_so_and_the_record_ends_cancelled(tmp_path, where, sig):
    config = write_config(tmp_path)
    record = tmp_path / "store" / "runs" / "demo.json"
    lock = None
    if where == "hashing_the_corpus":  # a sparse 4 GiB corpus: minutes of sha256, instant to create
        with open(tmp_path / "corpus.txt", "r+b") as fh:
            fh.truncate(4 << 30)
    else:
        cfg = load_pipeline(config)
        job = pl.plan_stage(cfg, "tokenizer", {})
        lock = pl.artifact_lock(ArtifactStore(cfg.store.uri), "tokenizer", job.artifact_id)
        lock.acquire()
    try:
        proc = _coordinator(["run-all", "-c", str(config)])
        _wait_for(lambda: record.is_file() and json.loads(record.read_text())["status"] == "running")
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if lock is not None:
            lock.release()
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 130, (out, err)
    assert f"cancelled by {sig.name}" in err and "Traceback" not in err, err
    final = json.loads(record.read_text())
    assert final["status"] == "cancelled" and sig.name in final["error"]
