"""The gate before a model ships (coordinator gate.py): serve, deploy and export print the assistant figures and
refuse a model below the thresholds, or one without figures, unless --force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from dilforge_coordinator import gate
from dilforge_coordinator.cli import app
from dilforge_eval.assistant import share
from dilforge_eval.metrics import AssistantFigures, AssistantSection, AssistantThresholds
from dilforge_serve import cli as serve_cli
from dilforge_serve import export as export_cli
from dilforge_shared.manifest import Manifest, artifact_ref, current_producer
from dilforge_shared.store import publish
from typer.testing import CliRunner


def figures(in_language: int, ended: int, n: int = 40, language: str = "az") -> AssistantFigures:
    return AssistantFigures(
        language=language,
        n=n,
        in_language=share([True] * in_language + [False] * (n - in_language)),
        ended_turn=share([True] * ended + [False] * (n - ended)),
        looping=share([False] * n),
        parroting=share([False] * n),
    )


def section(sft: AssistantFigures, model: str = "sft") -> AssistantSection:
    return AssistantSection(
        prompts="builtin:assistant",
        max_new_tokens=96,
        batch_size=16,
        thresholds=AssistantThresholds(language="az", min_in_language=0.9, min_ended_turn=0.9),
        figures={model: {"az": sft, "en": figures(40, 40, language="en"), "az-no-diacritics": figures(30, 36)}},
    )


def test_judge_passes_a_good_model_and_names_what_is_short():
    good = gate.judge(section(figures(37, 38)), "sft", "eval artifact e1")
    assert good.refusal is None and good.lines[0].startswith("assistant figures of the sft model (eval artifact e1")
    assert "  az (n 40): in language 0.93 [0.80–0.97], ended the turn 0.95" in good.lines[1]
    assert any(line.startswith("  az-no-diacritics (n 40): in language 0.75") for line in good.lines)
    wrong_language = gate.judge(section(figures(3, 38)), "sft", "e1")
    assert wrong_language.refusal == "sft model below the thresholds: answers in az 0.07 < 0.9"
    rambling = gate.judge(section(figures(40, 20)), "sft", "e1")
    assert rambling.refusal == "sft model below the thresholds: ending the turn 0.50 < 0.9"
    # exactly at the threshold passes
    assert gate.judge(section(figures(36, 36)), "sft", "e1").refusal is None


def test_judge_refuses_without_figures():
    assert "no assistant figures" in gate.judge(None, "sft", "eval artifact e1").refusal
    assert "for the sft model" in gate.judge(section(figures(40, 40), model="cpt"), "sft", "e1").refusal


@pytest.fixture
def no_exec(monkeypatch):
    """The model serve or export goes on to load, recorded instead of loading it (both run in this process)."""
    calls: list[str] = []

    def record(model, **kwargs):
        calls.append(model)
        raise typer.Exit(0)

    monkeypatch.setattr(serve_cli, "resolve_served_model", record)
    monkeypatch.setattr(export_cli, "resolve_served_model", record)
    return calls


@pytest.mark.parametrize("command", ["serve", "export"])
def test_serve_and_export_refuse_a_model_without_figures_unless_forced(command, tmp_path, no_exec):
    folder = tmp_path / "plain-hf-folder"
    folder.mkdir()
    args = [command, str(folder), "--store", str(tmp_path / "store")] + (
        ["--out", str(tmp_path)] if command == "export" else []
    )
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1 and not no_exec
    error = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"refusing to {command}" in error[0] and "no eval measured it" in error[0]
    assert "--force" in error[0]
    forced = CliRunner().invoke(app, [*args, "--force"])
    assert forced.exit_code == 0 and no_exec == [str(folder)], forced.output
    assert f"warning: {command} anyway (--force)" in forced.output


def test_coordinator_serve_is_the_servers_own_command_with_local_defaults(tmp_path, no_exec):
    folder = tmp_path / "m"
    folder.mkdir()
    res = CliRunner().invoke(app, ["serve", str(folder), "--force"])
    assert res.exit_code == 0 and "http://127.0.0.1:8000/v1" in res.output and no_exec == [str(folder)], res.output
    bad = CliRunner().invoke(app, ["serve", str(folder), "--force", "--dtype", "float7"])  # the server's own check
    assert bad.exit_code == 1 and "error: --dtype 'float7' is not one of" in bad.output and len(no_exec) == 1


@pytest.mark.parametrize(("sft", "code"), [(figures(38, 39), 0), (figures(5, 39), 1)])
def test_serve_prints_the_figures_and_gates_on_them(sft, code, tmp_path, no_exec, monkeypatch):
    monkeypatch.setattr(gate, "eval_section", lambda *a: (section(sft), "sft", "eval artifact e1"))
    folder = tmp_path / "m"
    folder.mkdir()
    res = CliRunner().invoke(app, ["serve", str(folder)])
    assert res.exit_code == code and len(no_exec) == 1 - code, res.output
    assert "assistant figures of the sft model (eval artifact e1" in res.output and "az-no-diacritics" in res.output
    assert ("below the thresholds: answers in az 0.12 < 0.9" in res.output) is bool(code)


def test_deploy_refuses_unless_forced_and_dry_run_is_not_gated(tmp_path, monkeypatch):
    from dilforge_coordinator import deploy

    preset = tmp_path / "pipe.yaml"
    preset.write_text(
        "run_id: gated\nstore: {uri: s3://bucket/store}\n"
        "sagemaker: {role_arn: 'arn:aws:iam::123456789012:role/x', region: eu-west-1}\n"
    )
    monkeypatch.setattr(gate, "eval_section", lambda *a: (section(figures(5, 39)), "sft", "eval artifact e1"))
    monkeypatch.setattr(deploy, "serve_image", lambda cfg, dry_run: "serve@sha256:" + "0" * 64)
    sent: list = []
    monkeypatch.setattr(deploy, "plan", lambda *a, **k: sent.append(a) or (_ for _ in ()).throw(SystemExit(7)))
    res = CliRunner().invoke(app, ["deploy", "-c", str(preset), "s3://bucket/store/artifacts/sft/a1"])
    assert res.exit_code == 1 and "refusing to deploy" in res.output and not sent
    forced = CliRunner().invoke(app, ["deploy", "-c", str(preset), "s3://bucket/store/artifacts/sft/a1", "--force"])
    assert forced.exit_code == 7 and len(sent) == 1  # past the gate, into planning
    dry = CliRunner().invoke(app, ["deploy", "-c", str(preset), "s3://bucket/store/artifacts/sft/a1", "--dry-run"])
    assert dry.exit_code == 7 and "refusing" not in dry.output


def _publish(store, stage: str, kind: str, artifact_id: str, metrics: dict, inputs=()) -> str:
    uri = f"{store.as_uri()}/artifacts/{stage}/{artifact_id}"
    folder = store.parent / f"src-{artifact_id}"
    folder.mkdir()
    (folder / "x.txt").write_text(artifact_id)
    m = Manifest(
        code_version="test",
        kind=kind,
        artifact_id=artifact_id,
        run_id="r1",
        stage=stage,
        producer=current_producer("tests"),
        config={},
        data_dir="pending",
        files=[],
        metrics=metrics,
        inputs=list(inputs),
    )
    publish(uri, folder, m)
    return uri


def test_eval_section_reads_the_eval_that_measured_this_artifact(tmp_path, monkeypatch):
    import metrics_samples
    from dilforge_coordinator import records
    from dilforge_shared.store import read_manifest

    store = tmp_path / "store"
    sft = _publish(store, "sft", "adapter", "sft1", metrics_samples.sample("sft", base_model="x"))
    other = _publish(store, "sft", "adapter", "sft2", metrics_samples.sample("sft", base_model="x"))
    metrics = {**metrics_samples.sample("eval"), "assistant": section(figures(38, 39)).model_dump(mode="json")}
    ev = _publish(store, "eval", "eval_report", "ev1", metrics, [artifact_ref("sft", sft, read_manifest(sft)[0])])
    asked = []
    monkeypatch.setattr(records, "run_artifact", lambda run, st, stage, ep=None: asked.append(st) or ev)
    got, label, source = gate.eval_section(sft, str(store), None, None)
    # an artifact of another store than --store's (default .dilforge/store): its run's eval is in its own store
    assert gate.eval_section(sft, str(tmp_path / "elsewhere"), None, None)[1] == "sft"
    assert [Path(a).resolve() for a in asked] == [store.resolve()] * 2
    assert label == "sft" and source == "eval artifact ev1" and got.figures["sft"]["az"].in_language.count == 38
    with pytest.raises(gate.DilforgeError, match="did not measure"):
        gate.eval_section(other, str(store), None, None)
    assert json.loads(json.dumps(got.model_dump(mode="json")))["thresholds"]["min_ended_turn"] == 0.9
