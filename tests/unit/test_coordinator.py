import json
import textwrap

import metrics_samples
import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.backends.local import write_inputs
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import STAGE_CONFIGS, load_pipeline
from dilforge_coordinator.pipeline import build_hyperparameters
from dilforge_coordinator.records import ArtifactStore
from dilforge_shared.contract import OptMl, StageResult, stage_main
from dilforge_shared.errors import ConfigError, DilforgeError
from typer.testing import CliRunner


class InProcessBackend:
    """Runs the real contract in this process with a fake stage body; counts runs."""

    name = "inprocess"

    def __init__(self, tmp_path, monkeypatch, fail: bool = False):
        self.tmp_path, self.monkeypatch, self.fail, self.runs = tmp_path, monkeypatch, fail, []

    def run(self, job):
        opt = OptMl(self.tmp_path / f"opt-{len(self.runs)}")
        write_inputs(opt, build_hyperparameters(job.config, job.artifact_uri, job.run_id, job.inputs))
        self.monkeypatch.setenv("DILFORGE_OPT_ML", str(opt.root))
        self.runs.append(job)

        def body(config, ctx):
            if self.fail:
                raise DilforgeError("corpus.txt:3: not valid UTF-8")
            (ctx.opt.model_dir / "out.txt").write_text(json.dumps(sorted(ctx.request.inputs)))
            return StageResult(metrics=metrics_samples.sample(job.stage))

        if stage_main(STAGE_CONFIGS[job.stage], body, "test", ["train"]) != 0:
            raise pl.StageFailed(job.stage, opt.failure_file.read_text())


def write_config(tmp_path, vocab=1000, corpus_text="bir iki üç\n"):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text)
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        textwrap.dedent(f"""
        run_id: demo
        store: {{uri: {tmp_path / "store"}}}
        tokenizer:
          strategy: replace
          corpora: [{{uri: "${{DILFORGE_VAR_CORPUS_DIR}}/corpus.txt"}}]
          vocab_sizes: [{vocab}]
    """)
    )
    return path


def test_rerun_reuses_and_changed_config_or_data_makes_a_new_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    backend = InProcessBackend(tmp_path, monkeypatch)
    first = pl.run_all(load_pipeline(write_config(tmp_path)), backend)
    again = pl.run_all(load_pipeline(write_config(tmp_path)), backend)
    assert again == first and len(backend.runs) == 1
    changed = pl.run_all(load_pipeline(write_config(tmp_path, vocab=2000)), backend)
    assert changed["tokenizer"] != first["tokenizer"] and len(backend.runs) == 2
    new_data = pl.run_all(load_pipeline(write_config(tmp_path, vocab=2000, corpus_text="dörd\n")), backend)
    assert new_data["tokenizer"] != changed["tokenizer"] and len(backend.runs) == 3


def test_run_record_and_status_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    produced = pl.run_all(load_pipeline(write_config(tmp_path)), InProcessBackend(tmp_path, monkeypatch))
    result = CliRunner().invoke(app, ["status", "demo", "--store", str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    assert "tokenizer" in result.output and "produced" in result.output and produced["tokenizer"] in result.output


def test_failed_stage_is_recorded_and_nothing_published(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    cfg = load_pipeline(write_config(tmp_path))
    with pytest.raises(pl.StageFailed, match="corpus.txt:3: not valid UTF-8"):
        pl.run_all(cfg, InProcessBackend(tmp_path, monkeypatch, fail=True))
    record = pl.RunRecord.load(ArtifactStore(cfg.store.uri), "demo")
    assert record.stages["tokenizer"]["status"] == "failed"
    assert not list((tmp_path / "store").glob("artifacts/**/manifest.json"))


def test_unset_variable_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("DILFORGE_VAR_CORPUS_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"\$\{DILFORGE_VAR_CORPUS_DIR\} is used but not set"):
        load_pipeline(write_config(tmp_path))


def test_cli_validate_prints_every_bad_field_and_exits_1(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "run_id: demo\nstore: {uri: /tmp/s}\ntokenizer: {strategy: extend, vocab_sizes: [1000], colour: red}\n"
    )
    result = CliRunner().invoke(app, ["validate", "--config", str(path)])
    assert result.exit_code == 1
    assert "tokenizer.colour: Extra inputs are not permitted" in result.output
    assert str(path) in result.output


def test_cli_manifest_show_and_validate(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    uri = pl.run_all(load_pipeline(write_config(tmp_path)), InProcessBackend(tmp_path, monkeypatch))["tokenizer"]
    shown = CliRunner().invoke(app, ["manifest", "show", uri])
    assert shown.exit_code == 0 and "tokenizer artifact" in shown.output and "out.txt" in shown.output
    ok = CliRunner().invoke(app, ["manifest", "validate", uri])
    assert ok.exit_code == 0 and "1 files verified" in ok.output
    data_dir = next((tmp_path / "store").glob("artifacts/tokenizer/*/data-*"))
    (data_dir / "out.txt").write_text("{}")  # same size as "[]", different content
    bad = CliRunner().invoke(app, ["manifest", "validate", uri])
    assert bad.exit_code == 1 and "out.txt does not match its sha256" in bad.output


def test_stage_without_required_upstream_fails_clearly(tmp_path):
    from dilforge_coordinator.config import PipelineConfig

    cfg = PipelineConfig.model_validate(
        {
            "run_id": "x",
            "store": {"uri": str(tmp_path)},
            "tokenizer": {"strategy": "replace", "corpora": [{"uri": str(tmp_path)}], "vocab_sizes": [1000]},
        }
    )
    cls = type(cfg.tokenizer)
    try:
        cls.required_inputs = ("cpt",)
        with pytest.raises(DilforgeError, match=r"needs upstream artifacts \['cpt'\]"):
            pl.plan_stage(cfg, "tokenizer", {})
    finally:
        cls.required_inputs = ()


def test_base_model_content_is_part_of_the_fingerprint(tmp_path):
    """A base tokenizer/model rewritten in place at the same path must not reuse the old artifact."""
    from dilforge_coordinator.config import PipelineConfig

    base = tmp_path / "base_tok"
    base.mkdir()
    (base / "tokenizer.json").write_text('{"v": 1}')
    cfg = PipelineConfig.model_validate(
        {
            "run_id": "x",
            "store": {"uri": str(tmp_path / "s")},
            "tokenizer": {"strategy": "base", "base_tokenizer": str(base), "vocab_sizes": [1000]},
        }
    )
    before = pl.plan_stage(cfg, "tokenizer", {}).artifact_id
    assert pl.plan_stage(cfg, "tokenizer", {}).artifact_id == before
    (base / "tokenizer.json").write_text('{"v": 2}')
    assert pl.plan_stage(cfg, "tokenizer", {}).artifact_id != before


def test_the_report_of_an_s3_store_is_named_in_the_store_not_downloaded(monkeypatch):
    """Issue 32: run-all on an S3 store printed the report's path in a download cache in the system temp folder,
    after fetching the whole eval artifact there; it names the report in the store instead."""
    from types import SimpleNamespace

    from dilforge_coordinator import cli

    monkeypatch.setattr(cli, "fetch", lambda *a, **k: pytest.fail("downloaded the eval artifact"))
    monkeypatch.setattr(cli, "read_manifest", lambda uri, endpoint: (SimpleNamespace(data_dir="data-abc"), "sha"))
    assert (
        cli.report_location("s3://b/store/artifacts/eval/0123", None)
        == "s3://b/store/artifacts/eval/0123/data-abc/report.html"
    )


def test_a_failed_attempt_never_replaces_the_last_good_artifact(tmp_path, monkeypatch):
    """Issue 31: a failing `run tokenizer` recorded the failed id in place of the good tokenizer, so downstream
    stages lost their input and `gc --unreferenced --delete` would have deleted the good artifact."""
    from dilforge_coordinator.gc import find_store_garbage
    from dilforge_coordinator.records import ArtifactStore, RunRecord, good_artifacts

    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    good = pl.run_all(load_pipeline(write_config(tmp_path)), InProcessBackend(tmp_path, monkeypatch))["tokenizer"]
    failing = InProcessBackend(tmp_path, monkeypatch, fail=True)
    with pytest.raises(pl.StageFailed):
        pl.run_all(load_pipeline(write_config(tmp_path, vocab=2000)), failing)
    store = ArtifactStore(str(tmp_path / "store"))
    record = RunRecord.load(store, "demo")
    assert record.stages["tokenizer"]["status"] == "failed" and record.stages["tokenizer"]["artifact"] != good
    assert good_artifacts(store, "demo") == {"tokenizer": good}
    assert pl.upstream_from_record(load_pipeline(write_config(tmp_path)))["tokenizer"] == good
    unreferenced = [g for g in find_store_garbage(store, 0, unreferenced=True) if g.kind == "unreferenced"]
    assert good.rstrip("/") not in [g.uri.rstrip("/") for g in unreferenced]
    with pytest.raises(pl.StageFailed):  # a second failure keeps the same last good artifact
        pl.run_all(load_pipeline(write_config(tmp_path, vocab=2000)), failing)
    assert RunRecord.load(store, "demo").stages["tokenizer"]["last_good"] == store.relative(good)
