"""Reliability and security (issue 12): remote code, damaged artifacts, gc, records, interpolation, secrets, locks."""

from __future__ import annotations

import ast
import json
import logging
import os
import socket
import textwrap
import threading
import time
from pathlib import Path

import factories
import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.backends.local import WORK_MARKER
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_coordinator.records import ArtifactStore
from dilforge_shared.errors import ConfigError, IntegrityError
from dilforge_shared.manifest import MANIFEST_NAME, Manifest, current_producer
from dilforge_shared.models import mirror_prefix
from dilforge_shared.store import fetch, publish
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
LOADERS = ("from_pretrained", "AutoConfig", "pipeline")
# PEFT loads adapter_config.json and safetensors only; it has no remote-code path to switch off.
NO_REMOTE_CODE_PATH = ("PeftModel", "PeftConfig", "LoraConfig")


def _calls_missing_flag(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if name not in LOADERS or owner in NO_REMOTE_CODE_PATH:
            continue
        if name == "pipeline" and owner not in ("", "transformers"):
            continue
        flag = next((k for k in node.keywords if k.arg == "trust_remote_code"), None)
        if flag is None or not (isinstance(flag.value, ast.Constant) and flag.value.value is False):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return bad


def test_every_model_load_in_the_code_passes_trust_remote_code_false():
    files = [
        p
        for top in ("services", "shared", "coordinator", "bench", "scripts")
        for p in (ROOT / top).rglob("*.py")
        if ".egg-info" not in str(p)
    ]
    assert len(files) > 30
    bad = [line for path in files for line in _calls_missing_flag(path)]
    assert not bad, "loads without trust_remote_code=False:\n" + "\n".join(bad)


def test_the_scanner_catches_a_missing_or_true_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    code = tmp_path / "m.py"
    code.write_text(
        "AutoModel.from_pretrained(p)\nAutoTokenizer.from_pretrained(p, trust_remote_code=True)\n"
        "AutoConfig.from_pretrained(p, trust_remote_code=False)\nPeftModel.from_pretrained(m, p)\n"
    )
    assert [line.split(":")[1] for line in _calls_missing_flag(code)] == ["1", "2"]


def _evil_folder(src: Path, dest: Path, model_type: str) -> Path:
    import shutil

    shutil.copytree(src, dest)
    marker = dest / "EXECUTED"
    (dest / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil_llama'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(
        model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    )
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("model_type", ["llama", "evil_llama"])
def test_a_model_folder_with_auto_map_never_runs_its_code(tiny_llama_dir, tmp_path, model_type):
    """A known architecture loads natively, ignoring auto_map; an unknown one is refused; evil.py never runs."""
    from transformers import AutoModelForCausalLM

    folder = _evil_folder(tiny_llama_dir, tmp_path / "evil", model_type)
    if model_type == "llama":
        model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False)
        assert type(model).__name__ == "LlamaForCausalLM"
    else:
        with pytest.raises(ValueError, match="trust_remote_code"):
            AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False)
    assert not (folder / "EXECUTED").exists()


# ---- reuse verifies, damaged artifacts are moved aside and rebuilt -------------------------------------------


class PublishingBackend:
    """Publishes a small artifact for the job (what a stage does), counting runs; optional delay."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0):
        self.runs, self.delay_s = [], delay_s

    def run(self, job):
        self.runs.append(job.artifact_uri)
        time.sleep(self.delay_s)
        out = Path(job.artifact_uri.removeprefix("file://") + f".out-{len(self.runs)}-{threading.get_ident()}")
        out.mkdir(parents=True)
        (out / "tokenizer.json").write_text('{"model": "bpe"}')
        (out / "sub").mkdir()
        (out / "sub" / "extra.txt").write_text("x" * 100)
        publish(job.artifact_uri, out, factories.job_manifest(job, "tokenizer"))


def write_config(tmp_path: Path, run_id: str = "demo") -> Path:
    (tmp_path / "corpus.txt").write_text("bir iki üç\n")
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(
        textwrap.dedent(f"""
        run_id: {run_id}
        store: {{uri: {tmp_path / "store"}}}
        tokenizer:
          strategy: replace
          corpora: [{{uri: "{tmp_path / "corpus.txt"}"}}]
          vocab_sizes: [1000]
    """)
    )
    return path


def _data_dir(artifact_uri: str) -> Path:
    root = Path(artifact_uri.removeprefix("file://"))
    return root / json.loads((root / MANIFEST_NAME).read_text())["data_dir"]


@pytest.mark.parametrize("damage", ["flip_byte", "delete_file", "truncate", "symlink_out"])
def test_damaged_artifact_is_reported_moved_aside_and_rebuilt(tmp_path, damage, capsys):
    backend = PublishingBackend()
    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, backend)["tokenizer"]
    data = _data_dir(uri)
    target = data / "tokenizer.json"
    if damage == "flip_byte":
        factories.flip_byte(target, 3)
    elif damage == "delete_file":
        (data / "sub" / "extra.txt").unlink()
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        outside = tmp_path / "outside.json"
        outside.write_bytes(target.read_bytes())
        target.unlink()
        target.symlink_to(outside)
    problem = check_artifact(uri)
    assert problem is not None and ("extra.txt" if damage == "delete_file" else "tokenizer.json") in problem, problem
    again = pl.run_all(cfg, backend)["tokenizer"]
    out = capsys.readouterr().out
    assert again == uri and len(backend.runs) == 2, "the damaged artifact must be rebuilt under the same id"
    assert "damaged artifact" in out and "moved it to" in out
    aside = [p for p in Path(uri.removeprefix("file://")).parent.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and (aside[0] / MANIFEST_NAME).is_file()
    assert check_artifact(uri) is None
    assert "reusing" in (pl.run_all(cfg, backend) and capsys.readouterr().out) and len(backend.runs) == 2


def test_symlinked_file_is_refused_by_fetch(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "w.bin").write_bytes(b"abc")
    uri = str(tmp_path / "store" / "a")
    m = publish(
        uri,
        out,
        Manifest(
            code_version="test",
            kind="tokenizer",
            artifact_id="a",
            run_id="r",
            stage="tokenizer",
            producer=current_producer("test"),
            config={},
            data_dir="x",
            files=[],
        ),
    )
    secret = tmp_path / "secret"
    secret.write_bytes(b"abc")
    victim = Path(uri) / m.data_dir / "w.bin"
    victim.unlink()
    victim.symlink_to(secret)
    with pytest.raises(IntegrityError, match="w.bin is a symlink"):
        fetch(uri)


# ---- run records, status, gc --------------------------------------------------------------------------------


class Exploding:
    name = "fake"

    def __init__(self, exc: BaseException):
        self.exc = exc

    def run(self, job):
        raise self.exc


@pytest.mark.parametrize(
    "exc, status",
    [
        (KeyboardInterrupt(), "cancelled"),
        (pl.StageCancelled("tokenizer", "SIGTERM"), "cancelled"),
        (pl.StageFailed("tokenizer", "bad corpus"), "failed"),
        (RuntimeError("bug"), "failed"),
    ],
)
def test_record_always_ends_succeeded_failed_or_cancelled(tmp_path, exc, status):
    cfg = load_pipeline(write_config(tmp_path))
    with pytest.raises(type(exc)):
        pl.run_all(cfg, Exploding(exc))
    record = pl.RunRecord.load(ArtifactStore(cfg.store.uri), "demo")
    assert record.status == status and record.stages["tokenizer"]["status"] == status
    pl.run_all(cfg, PublishingBackend())
    assert pl.RunRecord.load(ArtifactStore(cfg.store.uri), "demo").status == "succeeded"


def test_status_flags_a_running_record_whose_process_is_gone(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    record = pl.RunRecord(
        run_id="r",
        status="running",
        stages={"cpt": {"artifact": "artifacts/cpt/x", "status": "running"}},
        owner={"pid": 2**22 + 12345, "host": socket.gethostname()},
    )
    store.write_run_record("r", record.to_json())
    result = CliRunner().invoke(app, ["status", "r", "--store", str(tmp_path / "store")])
    assert result.exit_code == 0 and "stale" in result.output and "is gone" in result.output, result.output
    record.owner["pid"] = os.getpid()
    store.write_run_record("r", record.to_json())
    result = CliRunner().invoke(app, ["status", "r", "--store", str(tmp_path / "store")])
    assert "running" in result.output and "gone" not in result.output


def test_gc_lists_by_default_and_removes_with_delete(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "cache"))
    partial = tmp_path / "cache" / "models" / f".{'ab' * 8}.1234abcd.partial"  # an interrupted model download
    partial.mkdir(parents=True)
    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, PublishingBackend())["tokenizer"]
    art = Path(uri.removeprefix("file://"))
    orphan = art / "data-deadbeef0000"  # a loser's or a killed publisher's files
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"partial")
    half = art.parent / "0123456789abcdef" / "data-0000aaaa0000"  # publish killed before its manifest
    half.mkdir(parents=True)
    (half / "x").write_bytes(b"partial")
    tmp = art / f".manifest.json.{'ab' * 16}.tmp"  # the store's temp name, beside the manifest
    tmp.write_bytes(b"")
    work = tmp_path / "work" / "cpt-0011223344556677"
    (work / "checkpoints").mkdir(parents=True)
    (work / WORK_MARKER).write_text("cpt 0011223344556677\n")  # as the local backend makes one
    old = time.time() - 7200
    for p in (orphan, half, tmp, partial):
        os.utime(p, (old, old))
    args = ["gc", "--store", str(tmp_path / "store"), "--workdir", str(tmp_path / "work")]
    dry = CliRunner().invoke(app, args)
    assert dry.exit_code == 0, dry.output
    assert "5 item(s) found" in dry.output, dry.output
    assert all(p.exists() for p in (orphan, half, tmp, work, partial))
    done = CliRunner().invoke(app, [*args, "--delete"])
    assert done.exit_code == 0 and "5 item(s) removed" in done.output, done.output
    assert not any(p.exists() for p in (orphan, half, tmp, work, partial))
    assert check_artifact(uri) is None, "gc must never touch a whole artifact's data"
    unref = CliRunner().invoke(app, [*args, "--unreferenced"])
    assert "0 item(s)" in unref.output, "the artifact is named by run record demo"


# ---- locks: a second run of the same artifact waits and reuses ---------------------------------------------


def test_two_runs_of_the_same_artifact_one_produces_the_other_waits_and_reuses(tmp_path):
    backend = PublishingBackend(delay_s=1.0)
    cfgs = [load_pipeline(write_config(tmp_path, "run-a")), load_pipeline(write_config(tmp_path, "run-b"))]
    results, errors = {}, []

    def go(cfg):
        try:
            results[cfg.run_id] = pl.run_all(cfg, backend)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(c,)) for c in cfgs]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(30)
    assert not errors and len(backend.runs) == 1
    assert results["run-a"] == results["run-b"]
    store = ArtifactStore(cfgs[0].store.uri)
    statuses = sorted(pl.RunRecord.load(store, r).stages["tokenizer"]["status"] for r in ("run-a", "run-b"))
    assert statuses == ["produced", "reused"]


def test_concurrent_publishers_really_race_and_the_loser_cleans_up(tmp_path, monkeypatch):
    """Both publishers pass the existence check and upload before either creates the manifest (a barrier)."""
    from dilforge_shared import store as store_mod
    from dilforge_shared.errors import ArtifactExistsError

    barrier = threading.Barrier(2, timeout=20)
    original = store_mod.LocalStorage.create_bytes

    def racing_create(self, key, data):
        if key == MANIFEST_NAME:
            barrier.wait()
        return original(self, key, data)

    monkeypatch.setattr(store_mod.LocalStorage, "create_bytes", racing_create)
    uri = str(tmp_path / "store" / "artifacts" / "tokenizer" / "same")
    outcomes = []

    def go(i):
        out = tmp_path / f"out{i}"
        out.mkdir()
        (out / "w.bin").write_bytes(f"writer {i}".encode())
        try:
            publish(
                uri,
                out,
                Manifest(
                    code_version="test",
                    kind="tokenizer",
                    artifact_id="same",
                    run_id="r",
                    stage="tokenizer",
                    producer=current_producer("test"),
                    config={},
                    data_dir="x",
                    files=[],
                ),
            )
            outcomes.append(("won", i))
        except ArtifactExistsError:
            outcomes.append(("lost", i))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(o for o, _ in outcomes) == ["lost", "won"]
    winner = next(i for o, i in outcomes if o == "won")
    data_dirs = [p.name for p in Path(uri).iterdir() if p.name.startswith("data-")]
    assert data_dirs == [json.loads((Path(uri) / MANIFEST_NAME).read_text())["data_dir"]], "loser's files remain"
    assert (fetch(uri).path / "w.bin").read_text() == f"writer {winner}"


# ---- caches keyed by content --------------------------------------------------------------------------------


def test_mirror_prefix_refreshes_when_the_source_changes(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"old weights")
    dest = tmp_path / "cache" / "m"
    mirror_prefix(str(src), dest)
    assert (dest / "model.safetensors").read_bytes() == b"old weights"
    (src / "model.safetensors").write_bytes(b"new weights!")
    mirror_prefix(str(src), dest)
    assert (dest / "model.safetensors").read_bytes() == b"new weights!"
    (dest / "model.safetensors").write_bytes(b"x")  # a damaged copy is replaced too
    mirror_prefix(str(src), dest)
    assert (dest / "model.safetensors").read_bytes() == b"new weights!"


# ---- interpolation allow-list, secrets, one-line errors ----------------------------------------------------


def _yaml(tmp_path: Path, uri: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(
        f"run_id: r\nstore: {{uri: {tmp_path / 'store'}}}\n"
        f"tokenizer: {{strategy: replace, corpora: [{{uri: '{uri}'}}], vocab_sizes: [1000]}}\n"
    )
    return path


@pytest.mark.parametrize(
    "name", ["DILFORGE_S3_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY", "HOME", "DILFORGE_VAR_API_TOKEN"]
)
def test_config_may_not_interpolate_secrets_or_unlisted_variables(tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "s3cr3t-value")
    with pytest.raises(ConfigError, match=rf"\${{{name}}} may not be interpolated"):
        load_pipeline(_yaml(tmp_path, f"${{{name}}}/c.txt"))


def test_config_interpolates_allowed_and_user_variables_and_data_option_leaves_environ_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS", "/corpora")
    monkeypatch.delenv("DILFORGE_DATA", raising=False)
    cfg = load_pipeline(_yaml(tmp_path, "${DILFORGE_VAR_CORPUS}/${DILFORGE_DATA}"), variables={"DILFORGE_DATA": "d"})
    assert cfg.tokenizer.corpora[0].uri == "/corpora/d"
    result = CliRunner().invoke(
        app, ["validate", "-c", str(_yaml(tmp_path, "${DILFORGE_DATA}/x.txt")), "--data", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert "DILFORGE_DATA" not in os.environ


def test_credentials_are_masked_in_every_log_line(monkeypatch, caplog):
    from dilforge_shared.settings import MaskSecrets

    monkeypatch.setenv("DILFORGE_S3_ACCESS_KEY_ID", "AKIAEXAMPLEKEYID")
    monkeypatch.setenv("DILFORGE_S3_SECRET_ACCESS_KEY", "very-secret-value")
    handler = logging.StreamHandler()
    handler.addFilter(MaskSecrets())
    record = logging.LogRecord(
        "botocore",
        logging.DEBUG,
        __file__,
        1,
        "Authorization: Credential=%s/%s sig=%s",
        ("AKIAEXAMPLEKEYID", "2026", "very-secret-value"),
        None,
    )
    handler.filter(record)
    assert record.getMessage() == "Authorization: Credential=AKIAEXAMPLEKEYID/2026 sig=***"  # the key id is public


def test_the_local_stacks_keys_mask_the_secret_and_never_the_projects_name(monkeypatch):
    """compose.yaml's identity: key id `dilforge` (the project's name, public), secret `dilforge-local-only`.
    Logs keep every s3://dilforge/... and dilforge_cpt, and still never show the secret."""
    from dilforge_shared.settings import redact as mask

    for prefix in ("AWS", "DILFORGE_S3"):
        monkeypatch.setenv(f"{prefix}_ACCESS_KEY_ID", "dilforge")
        monkeypatch.setenv(f"{prefix}_SECRET_ACCESS_KEY", "dilforge-local-only")
    line = "s3://dilforge/store/artifacts -m dilforge_cpt key dilforge secret dilforge-local-only"
    assert mask(line) == "s3://dilforge/store/artifacts -m dilforge_cpt key dilforge secret ***"
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEXAMPLETOKEN")
    assert mask("token FwoGZXIvYXdzEXAMPLETOKEN") == "token ***"


@pytest.mark.parametrize("case", ["not_utf8", "store_under_file", "no_stages", "missing_config"])
def test_operator_mistakes_are_one_line_errors(tmp_path, case):
    config = _yaml(tmp_path, str(tmp_path / "c.txt"))
    (tmp_path / "c.txt").write_text("bir\n")
    args = ["run-all", "-c", str(config)]
    expected = {
        "not_utf8": "not UTF-8",
        "store_under_file": "Not a directory",
        "no_stages": "no stage section",
        "missing_config": "cannot read config",
    }[case]
    if case == "not_utf8":
        config.write_bytes(config.read_bytes() + b"# \xff\xfe latin-1 \xe7\n")
    elif case == "store_under_file":
        (tmp_path / "file").write_text("x")
        args += ["--store", str(tmp_path / "file" / "store")]
    elif case == "no_stages":
        config.write_text(f"run_id: r\nstore: {{uri: {tmp_path / 'store'}}}\n")
    else:
        args = ["run-all", "-c", str(tmp_path / "nope.yaml")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert result.output.count("\n") <= 2


def test_frozen_s3_endpoint_fails_within_the_retry_budget(monkeypatch):
    """A loopback socket that accepts and never answers: bounded by timeouts × attempts, one-line error."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setenv("DILFORGE_S3_READ_TIMEOUT", "1")
    monkeypatch.setenv("DILFORGE_S3_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    start = time.monotonic()
    try:
        result = CliRunner().invoke(app, ["manifest", "show", "s3://b/a", "--s3-endpoint-url", endpoint])
    finally:
        server.close()
    assert result.exit_code == 1 and "Read timeout" in result.output, result.output
    assert time.monotonic() - start < 15


def test_default_s3_budget_is_under_a_minute(monkeypatch):
    from dilforge_shared.settings import settings

    for name in ("DILFORGE_S3_READ_TIMEOUT", "DILFORGE_S3_CONNECT_TIMEOUT", "DILFORGE_S3_MAX_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    s = settings()
    assert s.s3_max_attempts * (s.s3_connect_timeout + s.s3_read_timeout) <= 60


def test_a_full_disk_in_a_stage_is_a_one_line_failure_naming_the_file(tmp_path, monkeypatch):
    import errno

    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.config import STAGE_CONFIGS
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_shared.contract import OptMl, stage_main

    cfg = load_pipeline(write_config(tmp_path))
    opt = OptMl(tmp_path / "opt")
    write_inputs(opt, build_hyperparameters(cfg.tokenizer, str(tmp_path / "store" / "a"), "r", {}))
    monkeypatch.setenv("DILFORGE_OPT_ML", str(opt.root))

    def body(config, ctx):
        raise OSError(errno.EFBIG, "File too large", str(ctx.opt.model_dir / "model.safetensors"))

    assert stage_main(STAGE_CONFIGS["tokenizer"], body, "test", ["train"]) == 1
    failure = opt.failure_file.read_text()
    assert failure == f"{opt.model_dir / 'model.safetensors'}: File too large (disk full or a file-size limit)"


# ---- bounded readers -----------------------------------------------------------------------------------------


def test_oversize_policies(tmp_path, caplog):
    import gzip

    from dilforge_shared.corpus import iter_located_texts, iter_records
    from dilforge_shared.errors import InputError

    words = [f"söz{i}" for i in range(200)]
    long_line = " ".join(words)
    for name, opener in (("c.txt", open), ("c.txt.gz", gzip.open)):
        with opener(tmp_path / name, "wt", encoding="utf-8") as f:
            f.write(f"short\n{long_line}\nəşğ\n")
        uri = str(tmp_path / name)
        with pytest.raises(InputError, match=rf"{name}:2: line longer than 100 bytes"):
            list(iter_located_texts(uri, max_document_bytes=100))
        pieces = [
            (line, text) for _, line, text in iter_located_texts(uri, max_document_bytes=100, on_oversize="split")
        ]
        assert pieces[0] == (1, "short") and pieces[-1] == (3, "əşğ")
        middle = [text for line, text in pieces[1:-1]]
        assert all(line == 2 for line, _ in pieces[1:-1]) and len(middle) > 1
        assert all(len(t.encode()) <= 100 for t in middle)
        assert " ".join(middle).split() == words, "split keeps every word, cut at whitespace"
        truncated = [text for _, _, text in iter_located_texts(uri, max_document_bytes=100, on_oversize="truncate")]
        assert truncated[0] == "short" and truncated[2] == "əşğ" and long_line.startswith(truncated[1])
        assert 96 <= len(truncated[1].encode()) <= 100
        with caplog.at_level(logging.WARNING):
            skipped = [text for _, _, text in iter_located_texts(uri, max_document_bytes=100, on_oversize="skip")]
        assert skipped == ["short", "əşğ"] and f"{name}:2" in caplog.text
    record = tmp_path / "r.jsonl"
    record.write_text(json.dumps({"text": long_line}) + "\n" + json.dumps({"text": "ok"}) + "\n")
    with pytest.raises(InputError, match="r.jsonl:1: line longer than 100 bytes"):
        list(iter_records(str(record), max_document_bytes=100, on_oversize="split"))
    assert [r["text"] for _, r in iter_records(str(record), max_document_bytes=100, on_oversize="skip")] == ["ok"]


def test_a_multibyte_character_on_the_read_boundary_is_never_broken(tmp_path):
    from dilforge_shared.corpus import iter_texts

    path = tmp_path / "a.txt"
    path.write_text("ə" * 1000 + "\n", encoding="utf-8")  # 2 bytes each; bound 101 is odd
    pieces = list(iter_texts(str(path), max_document_bytes=101, on_oversize="split"))
    assert "".join(pieces) == "ə" * 1000 and all(len(p.encode()) <= 101 for p in pieces)


def test_stamp_mode_skips_hashing_until_a_file_changes(tmp_path, monkeypatch):
    from dilforge_shared import store as store_mod

    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, PublishingBackend())["tokenizer"]
    hashed = []  # verify_files (in store) does the hashing
    original = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda p: hashed.append(p.name) or original(p))
    assert check_artifact(uri, mode="stamp") is None and len(hashed) == 2  # first time: full, then stamped
    assert check_artifact(uri, mode="stamp") is None and len(hashed) == 2  # stamp matches: no hashing
    target = _data_dir(uri) / "tokenizer.json"
    target.write_text('{"model": "bpf"}')  # same size, new mtime
    assert "sha256" in check_artifact(uri, mode="stamp")
    assert check_artifact(uri) is not None, "sha256 mode (default) catches it too"


def test_located_records_span_a_folder_and_hand_bad_lines_to_on_bad(tmp_path):
    """The shared JSONL reader SFT reads through: every file behind the URI in order, each record with its file
    and line; a line that is not a JSON object raises naming both, or goes to on_bad and is skipped."""
    from dilforge_shared.corpus import iter_located_records
    from dilforge_shared.errors import InputError

    (tmp_path / "d").mkdir()
    a, b = tmp_path / "d" / "a.jsonl", tmp_path / "d" / "b.jsonl"
    a.write_text('{"n": 1}\n\n[1, 2]\n{"n": 2}\n')
    b.write_text('{"n": 3\n{"n": 4}\n')
    with pytest.raises(InputError, match=r"a\.jsonl:3: expected a JSON object, got list"):
        list(iter_located_records(str(tmp_path / "d")))
    bad: list[tuple[str, int, str]] = []
    got = list(iter_located_records(str(tmp_path / "d"), on_bad=lambda *where: bad.append(where)))
    assert got == [(str(a), 1, {"n": 1}), (str(a), 4, {"n": 2}), (str(b), 2, {"n": 4})]
    assert bad == [
        (str(a), 3, "expected a JSON object, got list"),
        (str(b), 1, "not valid JSON: Expecting ',' delimiter (column 8)"),
    ]


def test_credentials_in_a_store_url_are_refused_and_masked_in_any_log_line(tmp_path):
    """Issue 31: an `s3_endpoint_url` with `user:password@` was printed by the dry run and sent in CreateModel's
    environment. Configs refuse it (naming the field); any such URL in a log line is masked all the same."""
    import logging

    from dilforge_coordinator.config import PipelineConfig
    from dilforge_shared.settings import MaskSecrets
    from dilforge_shared.settings import redact as mask

    raw = {"run_id": "r", "store": {"uri": "s3://b/s", "s3_endpoint_url": "http://admin:hunter2@127.0.0.1:8333"}}
    with pytest.raises(ValueError, match=r"store\.s3_endpoint_url[\s\S]*holds credentials"):
        PipelineConfig.model_validate(raw)
    assert mask("GET http://admin:hunter2@host:9000/b/k") == "GET http://***@host:9000/b/k"
    assert mask("s3://bucket/key@v2 and http://host/a@b") == "s3://bucket/key@v2 and http://host/a@b"
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "endpoint %s", ("https://u:p@e.example",), None)
    MaskSecrets(values=[]).filter(record)
    assert record.getMessage() == "endpoint https://***@e.example"


def test_a_stage_killed_in_a_container_is_told_as_killed_not_only_as_its_exit_code():
    from dilforge_coordinator.backends.local import _exit_reason

    oom = " (the kernel's OOM killer sends this when memory runs out)"
    assert _exit_reason(-9) == "killed by SIGKILL" + oom  # a local process
    assert _exit_reason(137) == "exit code 137: killed by SIGKILL" + oom  # docker's 128 + 9
    assert _exit_reason(1) == "exit code 1"
