"""The curate stage through `coordinator run-all`, on a dirty corpus with known answers built from held-out dev
text (bench/dirty_corpus.py): what it keeps, removes, repairs and redacts; the tokenizer reading its artifact;
output independent of the number of workers; bad input; a SIGTERM and a resumed rerun."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from dirty_corpus import build, score  # noqa: E402

COORDINATOR = str(Path(sys.executable).parent / "coordinator")
FLORES = "az/dev/flores200.dev.partial_from_sib200.tsv"


def run_all(root: Path, config: dict, name: str = "p.yaml", timeout: int = 600) -> subprocess.CompletedProcess:
    (root / name).write_text(yaml.safe_dump(config, allow_unicode=True))
    env = {**os.environ, "DILFORGE_WORKDIR": str(root / "work")}
    return subprocess.run(
        [COORDINATOR, "run-all", "--config", str(root / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def artifact_dir(store: Path, stage: str, output: str) -> Path:
    line = next(x for x in output.splitlines() if x.startswith(f"[{stage}] ") and "artifact: " in x)
    folder = Path(line.split("artifact: ")[1].removeprefix("file://"))
    manifest = json.loads((folder / "manifest.json").read_text())
    return folder / manifest["data_dir"]


def records(data_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(data_dir.glob("shard-*.jsonl")) for line in f.open(encoding="utf-8")]


def curate(uri: str, **extra) -> dict:
    return {"corpora": [{"uri": uri, "name": "web", "licence": "CC BY-SA 4.0"}], "output": {"num_shards": 4}, **extra}


@pytest.fixture(scope="module")
def curated(tmp_path_factory, data_root):
    root = tmp_path_factory.mktemp("curate")
    labels = build(data_root, root / "dirty")
    config = {
        "run_id": "web",
        "store": {"uri": str(root / "store")},
        "curate": curate(str(root / "dirty" / "web.jsonl")),
        "tokenizer": {
            "strategy": "replace",
            "corpora": [{"uri": "artifact:curate"}],
            "validation": [{"uri": str(data_root / FLORES), "text_field": "azj_Latn", "name": "flores_dev"}],
            "vocab_sizes": [1024],
            "num_validation_lines": 50,
        },
    }
    proc = run_all(root, config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, labels, config, proc.stdout


def test_dirty_corpus_meets_the_bars(curated):
    root, labels, _, out = curated
    data = artifact_dir(root / "store", "curate", out)
    got = score(records(data), labels)
    assert got["clean_kept"] >= 0.95, got
    assert got["exact_groups_single"] == 1.0, got
    assert got["near_groups_single"] >= 0.85, got
    assert got["english_removed"] >= 0.95, got
    assert got["junk_removed"] >= 0.90, got
    assert got["mis_decoded_left"] == 0 and got["mojibake_repaired"] >= 0.95, got
    assert got["contact_leaks"] == [], got


def test_report_card_and_metrics_say_what_was_removed(curated):
    root, labels, _, out = curated
    data = artifact_dir(root / "store", "curate", out)
    metrics = json.loads((data.parent / "manifest.json").read_text())["metrics"]
    assert metrics["documents_read"] == len(labels)
    assert metrics["documents_kept"] == len(records(data))
    steps = {s["step"]: s for s in metrics["steps"]}
    assert steps["language"]["reasons"]["language_en"] >= 57 and steps["duplicates"]["removed"] >= 50
    assert steps["quality"]["examples"] and all(len(e) <= 241 for e in steps["quality"]["examples"])
    assert metrics["repairs"]["encoding_repaired"] >= 15
    assert metrics["redacted"]["phone"]["replaced"] >= 20 and metrics["redacted"]["email"]["documents"] >= 10
    report, card = (re.sub(r" *\| *", " | ", (data / f).read_text()) for f in ("report.md", "README.md"))
    assert "| language |" in report and "## Removed by duplicates" in report
    assert "| web | CC BY-SA 4.0 |" in card
    contacts = [c for lab in labels.values() for c in lab.get("contacts", [])]
    assert not [c for s in metrics["steps"] for e in s["examples"] for c in contacts if c in e]  # redacted first


def test_tokenizer_reads_the_curated_artifact_and_a_rerun_reuses_both(curated):
    root, _, config, out = curated
    tok = artifact_dir(root / "store", "tokenizer", out)
    cur = artifact_dir(root / "store", "curate", out)
    inputs = json.loads((tok.parent / "manifest.json").read_text())["inputs"]
    ref = next(i for i in inputs if i["name"] == "curate")
    assert ref["sha256"] == f"artifact:{cur.parent.name}"
    assert not any(i["uri"] == "artifact:curate" for i in inputs)  # never hashed as a file path
    again = run_all(root, config)
    assert again.returncode == 0 and "running on" not in again.stdout, again.stdout[-2000:]


def test_output_does_not_depend_on_the_number_of_workers(curated, tmp_path):
    root, _, config, out = curated
    one = {**config, "store": {"uri": str(tmp_path / "store")}, "curate": {**config["curate"], "num_workers": 1}}
    one.pop("tokenizer")
    proc = run_all(tmp_path, one)
    assert proc.returncode == 0, proc.stdout[-2000:]
    a = json.loads((artifact_dir(root / "store", "curate", out).parent / "manifest.json").read_text())
    b = json.loads((artifact_dir(tmp_path / "store", "curate", proc.stdout).parent / "manifest.json").read_text())
    assert a["artifact_id"] == b["artifact_id"]
    assert [(f["path"], f["sha256"]) for f in a["files"]] == [(f["path"], f["sha256"]) for f in b["files"]]


def test_bad_input_is_one_line_and_publishes_nothing(tmp_path, data_root):
    english = tmp_path / "en.jsonl"
    english.write_text(
        "".join(json.dumps({"text": line}) + "\n" for line in (data_root / "az/dev/xwmt_test.az-en.en.txt").open())
    )
    proc = run_all(tmp_path, {"run_id": "en", "store": {"uri": str(tmp_path / "s1")}, "curate": curate(str(english))})
    assert proc.returncode != 0
    assert "none of the 600 documents survived" in proc.stdout + proc.stderr and "language" in proc.stdout + proc.stderr
    assert not list((tmp_path / "s1").glob("artifacts/curate/*/manifest.json"))

    broken = tmp_path / "broken.txt"
    broken.write_bytes("Bakı şəhəri\n".encode() * 3 + b"\xff\xfe bad\n")
    proc = run_all(tmp_path, {"run_id": "b", "store": {"uri": str(tmp_path / "s2")}, "curate": curate(str(broken))})
    assert proc.returncode != 0 and f"{broken}:4" in proc.stdout + proc.stderr and "UTF-8" in proc.stdout + proc.stderr

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = run_all(tmp_path, {"run_id": "e", "store": {"uri": str(tmp_path / "s3")}, "curate": curate(str(empty))})
    assert proc.returncode != 0 and "no document in any source" in proc.stdout + proc.stderr


def test_sigterm_stops_the_workers_and_a_rerun_resumes(tmp_path, data_root):
    build(data_root, tmp_path / "dirty")
    big = tmp_path / "big.jsonl"
    with open(big, "w", encoding="utf-8") as f:
        for k in range(12):  # distinct copies, so the run takes long enough to be stopped mid-way
            for line in (tmp_path / "dirty" / "web.jsonl").open(encoding="utf-8"):
                f.write(json.dumps({"text": json.loads(line)["text"] + f"\nNömrə {k}."}, ensure_ascii=False) + "\n")
    config = {"run_id": "big", "store": {"uri": str(tmp_path / "store")}, "curate": curate(str(big))}
    config["curate"]["output"]["num_shards"] = 16
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(config, allow_unicode=True))
    env = {**os.environ, "DILFORGE_WORKDIR": str(tmp_path / "work")}
    proc = subprocess.Popen(
        [COORDINATOR, "run-all", "--config", str(tmp_path / "p.yaml")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not list((tmp_path / "work").glob("curate-*/checkpoints/curate/logs/filter/completions/*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the filter phase never finished a task"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and "cancelled" in out, out[-2000:]
    time.sleep(1)
    stray = subprocess.run(["pgrep", "-f", "dilforge_curate"], capture_output=True, text=True).stdout.split()
    assert not stray, "datatrove workers outlived the stage"
    again = run_all(tmp_path, config)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "already done" in again.stdout


@pytest.fixture
def two_hosts(curated, tmp_path):
    """`process(host, *args)`: start `python -m dilforge_curate process ARGS` as host algo-1 or algo-2 of a job of
    two, as a SageMaker Processing container would (the run's config as hyperparameters, resourceconfig.json);
    also the local run's manifest and the artifact folder the hosts publish to."""
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_curate.config import CurateConfig
    from dilforge_shared.configs import validate_model
    from dilforge_shared.contract import OPT_ML_ENV, OptMl

    root, _, config, out = curated
    local = json.loads((artifact_dir(root / "store", "curate", out).parent / "manifest.json").read_text())
    section = validate_model(CurateConfig, {**config["curate"], "num_workers": 1}, "curate")
    artifact_uri = tmp_path / "store" / "artifacts" / "curate" / local["artifact_id"]
    hp = build_hyperparameters(section, str(artifact_uri), "web", {})

    def process(host: str, *args: str) -> subprocess.Popen:
        opt_root = tmp_path / f"opt-{host}-{args[0]}"
        write_inputs(OptMl(opt_root), hp, {"current_host": host, "hosts": ["algo-1", "algo-2"]})
        cmd = [sys.executable, "-m", "dilforge_curate", "process", *args]
        env = {**os.environ, OPT_ML_ENV: str(opt_root)}
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    return process, local, artifact_uri


def finished(proc: subprocess.Popen) -> str:
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    return out


def test_two_hosts_running_the_phases_publish_the_local_output(two_hosts, tmp_path):
    """What a job of several hosts does (each host one slice of every phase's datatrove tasks, the next phase
    reading the union of their outputs, one host publishing): the same artifact, byte for byte, as one machine."""
    process, local, artifact_uri = two_hosts
    merged = tmp_path / "merged"
    merged.mkdir()
    for phase in ("filter", "buckets", "cluster", "write"):
        for host in ("algo-1", "algo-2"):
            write = tmp_path / f"{phase}-{host}"
            finished(process(host, phase, "--read", str(merged), "--write", str(write)))
            if write.is_dir():  # what the next job's input holds: every host's outputs under one prefix
                shutil.copytree(write, merged, dirs_exist_ok=True)
    finished(process("algo-1", "publish", "--read", str(merged)))
    published = json.loads((artifact_uri / "manifest.json").read_text())
    assert published["artifact_id"] == local["artifact_id"]
    assert [(f["path"], f["sha256"]) for f in published["files"]] == [(f["path"], f["sha256"]) for f in local["files"]]


def test_a_host_that_stopped_early_fails_the_next_phase_in_one_line(two_hosts, tmp_path):
    """One host's buckets tasks missing from the union (an instance lost, a container killed): the cluster phase
    fails naming the phase, and nothing is published from part of the data."""
    process, _, artifact_uri = two_hosts
    merged = tmp_path / "merged"
    for phase in ("filter", "buckets"):
        for host in ("algo-1", "algo-2"):
            write = tmp_path / f"{phase}-{host}"
            finished(process(host, phase, "--read", str(merged), "--write", str(write)))
            if phase == "filter" or host == "algo-1":
                shutil.copytree(write, merged, dirs_exist_ok=True)
    for args in (
        ("cluster", "--read", str(merged), "--write", str(tmp_path / "cluster")),
        ("publish", "--read", str(merged)),
    ):
        proc = process("algo-1", *args)
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode != 0
        assert "task(s) of phase buckets did not finish (first: " in out and "Traceback" not in out, out[-3000:]
    assert not artifact_uri.exists()


def test_hosts_sharing_one_output_folder_wait_for_each_other(two_hosts, tmp_path):
    """SageMaker local mode mounts one output folder into every host and stops all of them when the first
    exits: with --shared-write, a host that finished its slice waits until the other host's tasks are done."""
    process, _, _ = two_hosts
    shared = tmp_path / "shared"
    args = ("filter", "--read", str(tmp_path / "nothing"), "--write", str(shared), "--shared-write")
    first = process("algo-1", *args)
    waited = []
    for line in first.stdout:
        waited.append(line)
        if "waiting for 2 task(s) of the other hosts" in line:  # 4 shards: algo-2 has tasks 2 and 3
            break
    assert first.poll() is None, "".join(waited)[-3000:]
    time.sleep(2)
    assert first.poll() is None  # still waiting: the other host has not run
    finished(process("algo-2", *args))
    finished(first)
    assert sorted(p.name for p in (shared / "logs" / "filter" / "completions").iterdir()) == [
        "00000", "00001", "00002", "00003",
    ]  # fmt: skip


def test_tokens_are_counted_under_the_given_tokenizer(tmp_path, data_root, tiny_tokenizer_dir):
    from tokenizers import Tokenizer

    build(data_root, tmp_path / "dirty")
    section = {**curate(str(tmp_path / "dirty" / "web.jsonl")), "tokenizer": str(tiny_tokenizer_dir)}
    proc = run_all(tmp_path, {"run_id": "tok", "store": {"uri": str(tmp_path / "store")}, "curate": section})
    assert proc.returncode == 0, proc.stdout[-2000:]
    data = artifact_dir(tmp_path / "store", "curate", proc.stdout)
    kept = records(data)
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    assert all(r["token_count"] == len(tok.encode(r["text"]).ids) for r in kept[:20])
    metrics = json.loads((data.parent / "manifest.json").read_text())["metrics"]
    assert metrics["tokens_kept"] == sum(r["token_count"] for r in kept) > 0
    assert "tokens" in (data / "report.md").read_text()


def _copies(tmp_path: Path, data_root: Path, n: int) -> Path:
    """The dirty corpus `n` times, each copy's documents made distinct (a run long enough to be stopped)."""
    build(data_root, tmp_path / "dirty")
    big = tmp_path / "big.jsonl"
    with open(big, "w", encoding="utf-8") as f:
        for k in range(n):
            for line in (tmp_path / "dirty" / "web.jsonl").open(encoding="utf-8"):
                f.write(json.dumps({"text": json.loads(line)["text"] + f"\nNömrə {k}."}, ensure_ascii=False) + "\n")
    return big


def _start(tmp_path: Path, config: dict) -> subprocess.Popen:
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(config, allow_unicode=True))
    env = {**os.environ, "DILFORGE_WORKDIR": str(tmp_path / "work")}
    cmd = [COORDINATOR, "run-all", "--config", str(tmp_path / "p.yaml")]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(tmp_path: Path, proc: subprocess.Popen, phase: str) -> None:
    deadline = time.monotonic() + 300
    while not list((tmp_path / "work").glob(f"curate-*/checkpoints/curate/logs/{phase}/completions/*")):
        assert proc.poll() is None and time.monotonic() < deadline, f"the {phase} phase never finished a task"
        time.sleep(0.05)


def test_kill_9_of_the_stage_or_the_coordinator_then_reruns_publish_the_whole_corpus(tmp_path, data_root):
    """`kill -9` of the stage process leaves no child holding the work-folder lock (the rerun would wait forever
    on a dead process); `kill -9` of the coordinator once a write task finished, then a rerun, publishes every
    shard (the kept documents the metrics count, no shard missing), never a partial corpus."""
    import psutil

    config = {
        "run_id": "k",
        "store": {"uri": str(tmp_path / "store")},
        "curate": curate(str(_copies(tmp_path, data_root, 1))),
    }
    config["curate"].update(num_workers=2, output={"num_shards": 8})
    proc = _start(tmp_path, config)
    _wait_for(tmp_path, proc, "filter")
    stage = next(p for p in psutil.Process(proc.pid).children() if "dilforge_curate" in " ".join(p.cmdline()))
    family = [stage, *stage.children(recursive=True)]
    assert len(family) >= 3  # the stage, datatrove's manager and pool workers
    stage.kill()
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, out[-2000:]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"orphans of the killed stage: {[p.cmdline() for p in alive]}"

    config["curate"]["num_workers"] = 1  # write tasks one at a time: the kill lands between two of them
    proc = _start(tmp_path, config)
    _wait_for(tmp_path, proc, "write")
    family = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.communicate(timeout=60)
    gone, alive = psutil.wait_procs(family, timeout=60)  # the stage, stopped by its parent-death signal
    assert not alive, f"orphans of the killed coordinator: {[p.cmdline() for p in alive]}"
    written = list((tmp_path / "work").glob("curate-*/checkpoints/curate/logs/write/completions/*"))
    assert len(written) < 8, "every write task finished before the kill: the corpus is too short to test a resume"

    again = run_all(tmp_path, config, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "waiting for process" not in again.stdout
    data = artifact_dir(tmp_path / "store", "curate", again.stdout)
    metrics = json.loads((data.parent / "manifest.json").read_text())["metrics"]
    assert metrics["documents_kept"] == len(records(data)) > 0
    assert (data / "shard-00000.jsonl").is_file()  # the first write task's shard, finished before the kill


def _stage_run(tmp_path: Path, source: Path, num_shards: int = 4):
    """The stage's phases in this process, as `stage.run` does, into `tmp_path/work` (no coordinator)."""
    from dilforge_curate import stage
    from dilforge_curate.config import CurateConfig

    config = CurateConfig(
        corpora=[{"uri": str(source), "name": "web"}], output={"num_shards": num_shards}, num_workers=1
    )
    work = tmp_path / "work"

    def run(model: Path) -> dict:
        model.mkdir(parents=True, exist_ok=True)
        stage.resume(work, config)
        stage.execute(stage.build(config, stage.Folders(work, work)), work)
        for shard in (work / "out").glob("shard-*"):
            shutil.move(shard, model / shard.name)
        return stage.finish(config, model, work, {}, time.perf_counter()).metrics

    return stage, config, work, run


def test_a_rerun_after_the_shards_left_the_work_folder_rewrites_them(tmp_path, data_root, capsys):
    """Every write task finished and its shards moved into the artifact folder, then the publish failed and the
    folder was wiped (a full store disk, Ctrl-C at publish): the rerun verifies the completion marks against
    their outputs, rewrites the shards, and publishes them all (was: zero shards, exit 0)."""
    build(data_root, tmp_path / "dirty")
    stage, config, work, run = _stage_run(tmp_path, tmp_path / "dirty" / "web.jsonl")
    first = run(tmp_path / "model")
    shutil.rmtree(tmp_path / "model")  # what the local backend does before a rerun
    capsys.readouterr()
    again = run(tmp_path / "model")
    out = capsys.readouterr().out
    assert "write: 4 finished task(s) cannot be verified" in out and "filter: 0 task(s)" in out, out
    assert again["documents_kept"] == first["documents_kept"] > 0
    assert sum(stage.documents_in(p) for p in (tmp_path / "model").glob("shard-*")) == again["documents_kept"]


def test_unverifiable_tasks_rerun_with_every_later_phase_and_a_short_corpus_is_never_published(tmp_path, data_root):
    """A filter task whose kept-documents file was cut short reruns, and buckets, cluster and write rerun after it;
    shards that do not hold the documents the write phase counted are refused at publish in one line."""
    from dilforge_shared.errors import DilforgeError

    build(data_root, tmp_path / "dirty")
    stage, config, work, run = _stage_run(tmp_path, tmp_path / "dirty" / "web.jsonl")
    kept = run(tmp_path / "model")["documents_kept"]
    filtered = work / "filtered" / "00001.jsonl"
    filtered.write_bytes(filtered.read_bytes()[:100])
    stage.resume(work, config)
    assert not (work / "logs" / "filter" / "completions" / "00001").exists()
    assert (work / "logs" / "filter" / "completions" / "00000").exists()
    for phase in ("buckets", "cluster", "write"):
        assert not list((work / "logs" / phase / "completions").iterdir()), phase
    assert stage.task_problem(work, config, "filter", 0) is None

    shard = next((tmp_path / "model").glob("shard-*"))
    shard.write_text("".join(shard.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(DilforgeError, match=rf"hold {kept - 1:,} documents but the write phase kept {kept:,}"):
        stage.check_shards(tmp_path / "model", config, kept)
