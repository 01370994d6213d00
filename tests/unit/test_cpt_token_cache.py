"""CPT token cache: sharded on worker processes, byte-identical whatever their number, resumable after a
crash from its finished shards, reused by a rerun, built once per cache folder in a multi-process job."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import factories
import numpy as np
import pytest
from dilforge_shared.configs import DataSource
from dilforge_shared.corpus import iter_texts


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from dilforge_cpt.data import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def ids(tok):
    from dilforge_cpt.data import special_ids

    return special_ids(tok, "t")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, data_root) -> Path:
    """3,000 lines of Azerbaijani Wikipedia sentences: ~25 shards of 12,000 characters."""
    lines = (data_root / "az/train/azwiki_sentences_cv_extractor.txt").read_text(encoding="utf-8").splitlines()
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text("\n".join(lines[:3000]) + "\n", encoding="utf-8")
    return path


SHARD = 12_000


def build(source, tok, ids, cache: Path, workers: int, key: str = "k"):
    from dilforge_cpt import data

    return data.tokenize_to_file(source, tok, ids, cache, key, None, 64, None, workers=workers, shard_chars=SHARD)


def expected_tokens(path: Path, tok, ids) -> list[int]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out += [ids.bos, *tok.encode(line, add_special_tokens=False).ids, ids.doc_end]
    return out


def test_cache_bytes_do_not_depend_on_the_number_of_workers(tmp_path, tok, ids, corpus):
    source = DataSource(uri=str(corpus))
    one = build(source, tok, ids, tmp_path / "one", workers=1)
    two = build(source, tok, ids, tmp_path / "two", workers=2)
    assert one.path.read_bytes() == two.path.read_bytes()
    assert (one.num_tokens, one.num_docs) == (two.num_tokens, two.num_docs)
    assert one.open().tolist() == expected_tokens(corpus, tok, ids)  # the documents, in order, each framed
    meta = json.loads((tmp_path / "two" / "k.json").read_text())
    assert meta["num_docs"] == 3000 and meta["num_tokens"] == two.num_tokens
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["k.json", "k.u32"]  # shards gone once whole


def crash_at(monkeypatch, shard: int, exc: BaseException):
    """Make the in-process build die when it reaches `shard`, leaving what a kill leaves: a half-written file."""
    from dilforge_cpt import data

    real = data.tokenize_shard

    def dies(texts, tok, ids, batch_size, shard_dir, index, first_doc, *rest):
        if index == shard:
            (shard_dir / f"shard-{index:06d}.u32.tmp999").write_bytes(b"half")
            raise exc
        return real(texts, tok, ids, batch_size, shard_dir, index, first_doc, *rest)

    monkeypatch.setattr(data, "tokenize_shard", dies)
    return real


def test_a_crashed_build_resumes_from_its_finished_shards(tmp_path, tok, ids, corpus, monkeypatch, caplog):
    """A build that dies at its 6th shard leaves 5 verified shards and no cache entry; the rerun, on 2 workers,
    tokenises only the shard whose sidecar was never written and those after it, and equals a clean build."""
    from dilforge_cpt import data

    source = DataSource(uri=str(corpus))
    clean = build(source, tok, ids, tmp_path / "clean", workers=1)
    real = crash_at(monkeypatch, 5, KeyboardInterrupt("killed"))
    with pytest.raises(KeyboardInterrupt):
        build(source, tok, ids, tmp_path / "cache", workers=1)
    shards = tmp_path / "cache" / "k.shards"
    assert sorted(p.name for p in shards.glob("*.u32")) == [f"shard-{i:06d}.u32" for i in range(5)]
    assert not (tmp_path / "cache" / "k.u32").exists() and not (tmp_path / "cache" / "k.json").exists()
    (shards / "shard-000004.u32.json").unlink()  # killed between a shard's rename and its sidecar

    monkeypatch.setattr(data, "tokenize_shard", real)
    with caplog.at_level("INFO", logger="dilforge.cpt"):
        done = build(source, tok, ids, tmp_path / "cache", workers=2)
    num_shards = sum(1 for _ in data._cut(iter_texts(str(corpus)), SHARD))
    assert num_shards > 10 and f"4 of {num_shards} shards reused" in caplog.text
    assert done.path.read_bytes() == clean.path.read_bytes()
    assert (done.num_tokens, done.num_docs) == (clean.num_tokens, clean.num_docs)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k.json", "k.u32"]


def test_a_damaged_shard_is_tokenised_again_on_resume(tmp_path, tok, ids, corpus, monkeypatch):
    """The shards sit under /opt/ml/checkpoints (restored from S3): one whose bytes differ from its sidecar's
    sha256 (same size) is tokenised again; the verified ones before it are not."""
    from dilforge_cpt import data

    source = DataSource(uri=str(corpus))
    clean = build(source, tok, ids, tmp_path / "clean", workers=1).path.read_bytes()
    real = crash_at(monkeypatch, 3, RuntimeError("spot instance reclaimed"))
    with pytest.raises(RuntimeError):
        build(source, tok, ids, tmp_path / "cache", workers=1)
    shard = tmp_path / "cache" / "k.shards" / "shard-000001.u32"
    raw = bytearray(shard.read_bytes())
    raw[8] ^= 0xFF
    shard.write_bytes(bytes(raw))
    calls = []
    monkeypatch.setattr(data, "tokenize_shard", lambda *a: calls.append(a[5]) or real(*a))
    assert build(source, tok, ids, tmp_path / "cache", workers=1).path.read_bytes() == clean
    assert calls[:2] == [1, 3] and 0 not in calls and 2 not in calls


def test_a_finished_cache_is_reused_by_a_rerun_whatever_its_workers(tmp_path, tok, ids, corpus, monkeypatch):
    from dilforge_cpt import data

    source = DataSource(uri=str(corpus))
    first = build(source, tok, ids, tmp_path, workers=2)
    monkeypatch.setattr(data, "tokenize_shard", lambda *a: pytest.fail("re-tokenised"))
    monkeypatch.setattr(data, "_pool", lambda *a: pytest.fail("workers started"))
    again = build(source, tok, ids, tmp_path, workers=1)
    assert (again.path, again.num_tokens, again.num_docs) == (first.path, first.num_tokens, first.num_docs)


def cpt_config(corpus: Path, **update):
    from dilforge_cpt.config import CptConfig

    fields = {
        "scratch_model": {},
        "corpora": [{"uri": str(corpus)}],
        "validation": [{"uri": str(corpus)}],
        "seq_len": 16,
        "global_batch_size": 4,
        "phase1": {"num_steps": 1},
        "tokenize_workers": 1,
        "precision": "fp32",
    }
    return CptConfig(**{**fields, **update})


RANK_SCRIPT = """
import json, os, sys
from pathlib import Path
from types import SimpleNamespace
from dilforge_cpt import stage
from dilforge_cpt.data import load_tokenizer, special_ids
from dilforge_cpt.runtime import init_runtime, shutdown
from dilforge_cpt.config import CptConfig

config_path, out, tok_dir, checkpoints = map(Path, sys.argv[1:])
config = CptConfig.model_validate_json(config_path.read_text())
rank = os.environ["RANK"]
real = stage.tokenize_to_file
def counted(*args, **kwargs):
    (out / f"called-by-rank{rank}").touch()
    return real(*args, **kwargs)
stage.tokenize_to_file = counted
rt = init_runtime(config)
tok = load_tokenizer(tok_dir)
ctx = SimpleNamespace(opt=SimpleNamespace(checkpoint_dir=checkpoints), endpoint_url=None)
try:
    files = stage.tokenize_corpora(config, ctx, rt, tok, special_ids(tok, "t"), tok_dir)
    (out / f"rank{rank}.json").write_text(json.dumps([[str(f.path), f.num_tokens] for f in files]))
except Exception as exc:
    (out / f"rank{rank}.error").write_text(str(exc))
shutdown(rt)
"""


def run_job(tmp: Path, config, tok_dir: Path, folders: list[Path]) -> Path:
    """Four ranks as two hosts of two (gloo on CPU); rank r's host k = r // 2 uses checkpoint folder folders[k]."""
    out = tmp / "out"
    out.mkdir(parents=True)
    (tmp / "config.json").write_text(config.model_dump_json())
    (tmp / "rank.py").write_text(RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(4):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(rank // 2),
        }
        args = [str(tmp / "config.json"), str(out), str(tok_dir), str(folders[rank // 2])]
        procs.append(subprocess.Popen([sys.executable, str(tmp / "rank.py"), *args], env=env))
    assert [p.wait(timeout=300) for p in procs] == [0] * 4
    return out


@pytest.mark.slow
def test_one_builder_per_cache_folder_and_every_rank_gets_its_files(tmp_path, corpus, tiny_tokenizer_dir):
    """A shared folder (one host, or FSx at the checkpoint path): global rank 0 alone tokenises. A folder per
    host (SageMaker): local rank 0 of each. Everyone else waits for the builder's marker and gets the same
    files; no marker is left behind. A failing builder's error reaches the ranks waiting on it."""
    shared = run_job(tmp_path / "shared", cpt_config(corpus), tiny_tokenizer_dir, [tmp_path / "ckpt"] * 2)
    assert sorted(p.name for p in shared.glob("called-by-*")) == ["called-by-rank0"]
    results = [json.loads((shared / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r == results[0] for r in results) and results[0][0][1] > 0
    assert not list((tmp_path / "ckpt" / "tokens").glob(".job-*"))

    hosts = [tmp_path / "host0", tmp_path / "host1"]
    per_host = run_job(tmp_path / "per-host", cpt_config(corpus), tiny_tokenizer_dir, hosts)
    assert sorted(p.name for p in per_host.glob("called-by-*")) == ["called-by-rank0", "called-by-rank2"]
    results = [json.loads((per_host / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r[0][0].startswith(str(hosts[i // 2])) for i, r in enumerate(results)] == [True] * 4
    assert len({r[0][1] for r in results}) == 1
    (one,), (two,) = [sorted((h / "tokens").glob("*.u32")) for h in hosts]
    assert one.name == two.name and one.read_bytes() == two.read_bytes()

    missing = cpt_config(corpus).model_copy(update={"corpora": [{"uri": str(tmp_path / "nowhere.txt")}]})
    failed = run_job(tmp_path / "failed", cpt_config(corpus, corpora=missing.corpora), tiny_tokenizer_dir, hosts)
    errors = {p.name: p.read_text() for p in failed.glob("*.error")}
    assert sorted(errors) == [f"rank{r}.error" for r in range(4)]
    assert "nowhere.txt" in errors["rank1.error"] and "token cache builder failed" in errors["rank1.error"]


def test_build_cache_command_fills_the_cache_a_training_run_reuses(
    tmp_path, corpus, tiny_tokenizer_dir, monkeypatch, tok, ids
):
    """`python -m dilforge_cpt build-cache` (a Processing job's command) reads the training job's hyperparameters
    and leaves the cache entry the stage's tokenize_corpora then reuses without tokenising."""
    from types import SimpleNamespace

    from dilforge_cpt import data, stage
    from dilforge_cpt.runtime import Runtime

    root = tmp_path / "opt-ml"
    config = _build_cache_job(tmp_path, root, corpus, tiny_tokenizer_dir, monkeypatch, workers=2)
    (entry_file,) = (root / "checkpoints" / "tokens").glob("*.u32")
    assert entry_file.read_bytes() == np.asarray(expected_tokens(corpus, tok, ids), dtype=np.uint32).tobytes()
    assert not (root / "model").exists() or not any((root / "model").iterdir())  # nothing published

    monkeypatch.setattr(data, "tokenize_shard", lambda *a: pytest.fail("re-tokenised"))
    ctx = SimpleNamespace(opt=SimpleNamespace(checkpoint_dir=root / "checkpoints"), endpoint_url=None)
    (tf,) = stage.tokenize_corpora(config, ctx, Runtime(), tok, ids, tiny_tokenizer_dir)
    assert tf.path == entry_file and tf.num_docs == 3000


def test_build_cache_restores_an_earlier_builds_output_and_tokenises_only_what_is_damaged(
    tmp_path, corpus, tiny_tokenizer_dir, monkeypatch, capfd
):
    """A rerun's Processing job (DILFORGE_TOKEN_CACHE_URI: where the earlier job's output went) restores that
    cache and reuses it without tokenising; a damaged copy there is built again, not trusted."""
    first, uploaded = tmp_path / "first", tmp_path / "s3" / "tokens"
    _build_cache_job(tmp_path, first, corpus, tiny_tokenizer_dir, monkeypatch)
    shutil.copytree(first / "checkpoints" / "tokens", uploaded)  # the job's output, as SageMaker uploads it
    (uploaded / ".job-x.ready-node0").write_text("{}")  # another job's marker: never restored
    built = (first / "checkpoints" / "tokens").glob("*.u32").__next__().read_bytes()

    capfd.readouterr()
    monkeypatch.setenv("DILFORGE_TOKEN_CACHE_URI", f"file://{uploaded}/")
    rerun = tmp_path / "rerun"
    _build_cache_job(tmp_path, rerun, corpus, tiny_tokenizer_dir, monkeypatch)
    log = "".join(capfd.readouterr())
    assert "restored 2 token cache files" in log and "reusing token cache" in log and "tokenised" not in log
    (entry_file,) = (rerun / "checkpoints" / "tokens").glob("*.u32")
    assert entry_file.read_bytes() == built
    assert not list((rerun / "checkpoints" / "tokens").glob(".job-*"))

    (uploaded / entry_file.name).write_bytes(b"\0" * len(built))  # same size, other bytes
    again = tmp_path / "again"
    _build_cache_job(tmp_path, again, corpus, tiny_tokenizer_dir, monkeypatch)
    log = "".join(capfd.readouterr())
    assert "is damaged; tokenising again" in log
    assert (again / "checkpoints" / "tokens" / entry_file.name).read_bytes() == built


def _build_cache_job(tmp_path, root, corpus, tiny_tokenizer_dir, monkeypatch, workers: int = 1):
    """`python -m dilforge_cpt build-cache` on a fresh /opt/ml root, with a published tokenizer."""
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_cpt import __main__ as entry
    from dilforge_shared.contract import OptMl

    tok_uri = f"{tmp_path}/store/artifacts/tokenizer/tok"
    if not (tmp_path / "store" / "artifacts" / "tokenizer" / "tok" / "manifest.json").exists():
        factories.publish_tokenizer(tmp_path / "store", tiny_tokenizer_dir)
    config = cpt_config(corpus, tokenize_workers=workers)
    write_inputs(
        OptMl(root), build_hyperparameters(config, str(tmp_path / "store" / "cpt"), "t", {"tokenizer": tok_uri})
    )
    monkeypatch.setenv("DILFORGE_OPT_ML", str(root))
    assert entry.main(["build-cache"]) == 0
    return config


def test_workers_default_to_the_cpus_of_the_affinity_mask_not_the_machine():
    """`tokenize_workers: None` = `available_cpus()`: a container limited to one CPU gets one worker."""
    import shutil

    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs taskset and two CPUs")
    code = "from dilforge_shared.workers import available_cpus; print(available_cpus())"
    one = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert one.stdout.strip() == "1"
    every = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(every.stdout) == len(os.sched_getaffinity(0)) >= 2


KILLED_BUILD = """
import sys
from pathlib import Path
from dilforge_cpt import data
from dilforge_shared.configs import DataSource

if __name__ == "__main__":  # the workers are spawned: they import this script
    corpus, tok_dir, cache = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    tok = data.load_tokenizer(tok_dir)
    ids = data.special_ids(tok, "t")
    data.tokenize_to_file(DataSource(uri=corpus), tok, ids, cache, "k", None, 64, None, workers=2, shard_chars=4_000)
"""


@pytest.mark.slow
def test_a_build_killed_with_sigkill_resumes_to_the_same_bytes(
    tmp_path, data_root, tiny_tokenizer_dir, tok, ids, caplog
):
    """The whole process group (the build and its two workers) SIGKILLed once a few shards are finished, as a
    reclaimed spot instance: the rerun reuses those shards and its file equals a clean build's."""
    import signal
    import time

    from dilforge_cpt import data

    corpus = data_root / "az/train/azwiki_sentences_cv_extractor.txt"
    script = tmp_path / "build.py"
    script.write_text(KILLED_BUILD)
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(corpus), str(tiny_tokenizer_dir), str(cache)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while len(list((cache / "k.shards").glob("*.u32.json"))) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline, "no shard finished in time"
        time.sleep(0.05)
    assert proc.poll() is None, f"the build ended on its own (exit {proc.returncode})"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cache / "k.json").exists(), "the build finished before it was killed"
    finished = len(list((cache / "k.shards").glob("*.u32.json")))

    source = DataSource(uri=str(corpus))
    with caplog.at_level("INFO", logger="dilforge.cpt"):
        resumed = data.tokenize_to_file(source, tok, ids, cache, "k", None, 64, None, workers=1, shard_chars=4_000)
    assert re.search(rf": {finished} of \d+ shards reused", caplog.text)  # every shard with a sidecar reused
    clean = data.tokenize_to_file(source, tok, ids, tmp_path / "clean", "k", None, 64, None, shard_chars=4_000)
    assert resumed.path.read_bytes() == clean.path.read_bytes()
    assert finished >= 3 and not (cache / "k.shards").exists()


def test_an_entry_of_another_encoding_is_not_reused(tiny_tokenizer_dir, monkeypatch):
    """The key hashes the cache format: an entry tokenised before special-token strings were encoded as text
    (the same key without the format) is never picked up again, and a format change renames every entry."""
    import hashlib

    from dilforge_cpt import data
    from dilforge_shared.configs import DataSource

    monkeypatch.setattr(data, "data_digest", lambda uri, endpoint_url: "d")
    source, tokenizer_json = DataSource(uri="x.txt"), tiny_tokenizer_dir / "tokenizer.json"
    earlier = hashlib.sha256()
    earlier.update(source.model_dump_json(exclude={"weight", "name"}).encode())
    earlier.update(b"d")
    earlier.update(hashlib.sha256(tokenizer_json.read_bytes()).hexdigest().encode())
    earlier.update(b"None")
    key = data.cache_key(source, tokenizer_json, None, None)
    assert key != earlier.hexdigest()[:24]
    monkeypatch.setattr(data, "CACHE_FORMAT", b"3")
    assert data.cache_key(source, tokenizer_json, None, None) != key
