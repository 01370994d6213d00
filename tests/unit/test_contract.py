import json

import metrics_samples
import pytest
from dilforge_coordinator.backends.local import write_inputs
from dilforge_coordinator.pipeline import build_hyperparameters
from dilforge_shared.contract import OptMl, ResourceConfig, StageResult, parse_hyperparameters, stage_main
from dilforge_shared.errors import ConfigError
from dilforge_shared.store import fetch
from dilforge_tokenizer.config import TokenizerConfig

CONFIG = {"strategy": "replace", "corpora": [{"uri": "/data/az.txt"}], "vocab_sizes": [1000]}


def hp(**overrides):
    base = {
        "stage_config": json.dumps(CONFIG),
        "artifact_uri": "s3://b/artifacts/tokenizer/x",
        "run_id": "r1",
        "inputs": "{}",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_parse_hyperparameters_strings_into_a_validated_request():
    req = parse_hyperparameters(hp(inputs=json.dumps({"cpt": "s3://b/m"})), TokenizerConfig, "hp.json")
    assert req.config == TokenizerConfig.model_validate(CONFIG)
    assert req.inputs == {"cpt": "s3://b/m"} and req.run_id == "r1"


def test_build_and_parse_are_inverse():
    config = TokenizerConfig.model_validate(CONFIG)
    built = build_hyperparameters(config, "file:///s/a", "r2", {"x": "file:///s/b"}, "http://127.0.0.1:1")
    assert all(isinstance(v, str) for v in built.values())
    req = parse_hyperparameters(built, TokenizerConfig, "hp")
    assert req.config == config and req.s3_endpoint_url == "http://127.0.0.1:1"


def test_unknown_config_field_is_named():
    bad = dict(CONFIG, vocab_sizez=[1])
    with pytest.raises(ConfigError, match=r"vocab_sizez: Extra inputs are not permitted"):
        parse_hyperparameters(hp(stage_config=json.dumps(bad)), TokenizerConfig, "hp.json")


def test_non_string_hyperparameter_is_rejected():
    with pytest.raises(ConfigError, match="'run_id' must be a string"):
        parse_hyperparameters(hp(run_id=3), TokenizerConfig, "hp.json")


def test_unknown_hyperparameter_is_rejected_but_sagemaker_keys_pass():
    with pytest.raises(ConfigError, match="unknown hyperparameters \\['epochs'\\]"):
        parse_hyperparameters(hp(epochs="3"), TokenizerConfig, "hp.json")
    parse_hyperparameters(hp(sagemaker_job_name="j"), TokenizerConfig, "hp.json")


def test_stage_config_uri_is_read(tmp_path):
    doc = tmp_path / "cfg.json"
    doc.write_text(json.dumps(CONFIG))
    req = parse_hyperparameters(hp(stage_config=None, stage_config_uri=str(doc)), TokenizerConfig, "hp.json")
    assert req.config.corpora[0].uri == "/data/az.txt"


def test_resource_config_sorts_hosts_and_picks_master(tmp_path):
    opt = OptMl(tmp_path)
    write_inputs(
        opt, {}, resource={"current_host": "algo-1", "hosts": ["algo-2", "algo-1"], "network_interface_name": "eth0"}
    )
    res = ResourceConfig.load(opt)
    assert res.hosts == ["algo-1", "algo-2"] and res.node_rank == 0


def run_main(tmp_path, monkeypatch, run_fn, **hp_overrides):
    opt = OptMl(tmp_path / "optml")
    write_inputs(opt, hp(artifact_uri=str(tmp_path / "store" / "a"), **hp_overrides))
    monkeypatch.setenv("DILFORGE_OPT_ML", str(opt.root))
    code = stage_main(TokenizerConfig, run_fn, "dilforge-tokenizer", ["train"])
    return code, opt


def test_stage_main_publishes_what_run_left_in_model_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("dilforge_shared.contract.lineage", lambda ctx: [])

    def run(config, ctx):
        (ctx.opt.model_dir / "tokenizer.json").write_text("{}")
        return StageResult(metrics=metrics_samples.sample("tokenizer", peak_rss_mib=1.4))

    code, opt = run_main(tmp_path, monkeypatch, run)
    assert code == 0 and not opt.failure_file.exists()
    art = fetch(str(tmp_path / "store" / "a"))
    assert art.manifest.metrics == metrics_samples.sample("tokenizer", peak_rss_mib=1.4)
    assert art.manifest.config["vocab_sizes"] == [1000] and art.manifest.run_id == "r1"


def test_stage_main_failure_writes_reason_and_publishes_nothing(tmp_path, monkeypatch):
    from dilforge_shared.errors import InputError

    def run(config, ctx):
        (ctx.opt.model_dir / "half.bin").write_text("x")
        raise InputError("not valid UTF-8", path="/data/az.txt", line=7)

    code, opt = run_main(tmp_path, monkeypatch, run)
    assert code == 1
    assert opt.failure_file.read_text() == "/data/az.txt:7: not valid UTF-8"
    assert not (tmp_path / "store" / "a").exists()


def test_stage_main_bad_config_fails_before_running(tmp_path, monkeypatch):
    ran = []
    code, opt = run_main(
        tmp_path, monkeypatch, lambda c, x: ran.append(1), stage_config=json.dumps(dict(CONFIG, vocab_sizes=[100]))
    )
    assert code == 1 and not ran
    assert "vocab_sizes" in opt.failure_file.read_text()


def test_a_stage_downloads_into_dilforge_cache_else_its_opt_ml_cache(tmp_path, monkeypatch):
    seen = []

    def run(config, ctx):
        seen.append(ctx.cache_dir)
        (ctx.opt.model_dir / "tokenizer.json").write_text("{}")
        return StageResult(metrics=metrics_samples.sample("tokenizer", peak_rss_mib=1.4))

    monkeypatch.setattr("dilforge_shared.contract.lineage", lambda ctx: [])
    monkeypatch.delenv("DILFORGE_CACHE", raising=False)
    _, opt = run_main(tmp_path / "a", monkeypatch, run)
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "shared-cache"))
    run_main(tmp_path / "b", monkeypatch, run)
    assert seen == [opt.root / "cache", tmp_path / "shared-cache"]
