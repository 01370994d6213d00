"""Artifact identity: ids hash what determines the output (identity fields, code version, input digests) and
nothing else; reuse and publishing prove it (issue 22 item 1, issue 23 item 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import get_args

import metrics_samples
import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.config import STAGE_CONFIGS, load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_coordinator.schemas import schemas
from dilforge_shared import identity
from dilforge_shared.configs import IDENTITY_KEY, is_run_only
from dilforge_shared.store import fetch
from pydantic import BaseModel
from test_coordinator import InProcessBackend, write_config

# The decision for every stage config field, in one list per stage: these are run-only (they change how, where
# or how fast a stage runs, never what it publishes); every other field is identity. A new field is identity
# until it is marked RUN_ONLY and added here.
RUN_ONLY = {
    "model": [],
    "curate": ["num_workers"],
    "tokenizer": ["corpora.name", "validation.name"],
    "cpt": [
        "activation_checkpointing",
        "checkpoint_every",
        "compile",
        "corpora.name",
        "distributed_backend",
        "eval_every",
        "eval_micro_batch_size",
        "fsdp",
        "liger",
        "log_every",
        "master_port",
        "micro_batch_size",
        "num_checkpoints_kept",
        "num_processes_per_node",
        "peak_tflops_per_device",
        "tokenize_batch_size",
        "tokenize_workers",
        "validation.name",
    ],
    "sft": [
        "activation_checkpointing",
        "attention",
        "checkpoint_every",
        "eval_micro_batch_size",
        "liger",
        "log_every",
        "memory_budget_fraction",
        "micro_batch_size",
        "num_checkpoints_kept",
        "train.name",
        "validation.name",
    ],
    "eval": [
        "assistant.batch_size",
        "bpb.batch_size",
        "device",
        "parallel_sets.az.name",
        "parallel_sets.en.name",
        "tasks.batch_size",
        "tasks.translation.az.name",
        "tasks.translation.en.name",
        "text_sets.name",
    ],
}


def run_only_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every run-only field of a config class, nested models included."""
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        if is_run_only(info):
            out.append(path)
            continue
        for sub in _model_types(info.annotation):
            out += run_only_paths(sub, f"{path}.")
    return sorted(set(out))


def _model_types(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [t for arg in get_args(annotation) for t in _model_types(arg)]


@pytest.mark.parametrize("stage", list(STAGE_CONFIGS))
def test_every_run_only_field_is_a_recorded_decision(stage):
    assert run_only_paths(STAGE_CONFIGS[stage]) == sorted(RUN_ONLY[stage])


def test_the_json_schema_shows_which_fields_are_run_only():
    cpt = schemas()["pipeline.schema.json"]["$defs"]["CptConfig"]["properties"]
    assert cpt["log_every"][IDENTITY_KEY] == "run-only"
    assert IDENTITY_KEY not in cpt["seq_len"]


def cpt_pipeline(tmp_path: Path, **cpt) -> dict:
    (tmp_path / "c.txt").write_text("bir iki üç\n")
    section = {
        "scratch_model": {},
        "corpora": [{"uri": str(tmp_path / "c.txt")}],
        "validation": [{"uri": str(tmp_path / "c.txt")}],
        "phase2": {"num_steps": 2},
        **cpt,
    }
    return {"run_id": "r", "store": {"uri": str(tmp_path / "store")}, "cpt": section}


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """raw pipeline → the CPT job's planned id, fed a real (fake-trained) tokenizer artifact."""
    from dilforge_coordinator.config import PipelineConfig

    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    tok = pl.run_all(load_pipeline(write_config(tmp_path)), InProcessBackend(tmp_path, monkeypatch))["tokenizer"]
    return lambda raw: pl.plan_stage(PipelineConfig.model_validate(raw), "cpt", {"tokenizer": tok}).artifact_id


def test_run_only_changes_keep_the_id_identity_changes_and_a_code_version_bump_do_not(tmp_path, monkeypatch, planned):
    base = planned(cpt_pipeline(tmp_path))
    run_only = {
        "log_every": 1,
        "eval_every": 3,
        "checkpoint_every": 7,
        "master_port": 29600,
        "compile": True,
        "num_processes_per_node": 2,
        "tokenize_batch_size": 10,
        "micro_batch_size": 2,
        "fsdp": "on",
        "liger": "off",
        "num_checkpoints_kept": 5,
    }
    assert planned(cpt_pipeline(tmp_path, **run_only)) == base
    renamed = cpt_pipeline(tmp_path)
    renamed["cpt"]["corpora"][0]["name"] = "wiki"
    assert planned(renamed) == base, "a data source's display name is run-only"
    assert planned(cpt_pipeline(tmp_path, seq_len=64)) != base
    assert planned(cpt_pipeline(tmp_path, phase2={"num_steps": 3})) != base
    real = identity.code_version
    monkeypatch.setattr(identity, "code_version", lambda stage: real(stage) + ("-edited" if stage == "cpt" else ""))
    assert planned(cpt_pipeline(tmp_path)) != base


def test_a_corpus_is_identified_by_its_content_where_the_config_names_it(tmp_path, monkeypatch, planned):
    """A copy under another name or path, or a link, of the corpus is the same input (same id); the same two
    files in swapped roles (training vs validation, or swapped weights) are not."""
    base = planned(cpt_pipeline(tmp_path))
    (tmp_path / "copies").mkdir()
    (tmp_path / "copies" / "corpus-copy.txt").write_bytes((tmp_path / "c.txt").read_bytes())
    (tmp_path / "link.txt").symlink_to(tmp_path / "c.txt")
    for other in (tmp_path / "copies" / "corpus-copy.txt", tmp_path / "link.txt"):
        moved = cpt_pipeline(tmp_path)
        moved["cpt"]["corpora"][0]["uri"] = str(other)
        assert planned(moved) == base, other
    (tmp_path / "d.txt").write_text("dörd beş altı\n")
    two = cpt_pipeline(tmp_path)
    two["cpt"]["corpora"] = [{"uri": str(tmp_path / "c.txt"), "weight": 2.0}, {"uri": str(tmp_path / "d.txt")}]
    swapped = cpt_pipeline(tmp_path)
    swapped["cpt"]["corpora"] = [{"uri": str(tmp_path / "c.txt")}, {"uri": str(tmp_path / "d.txt"), "weight": 2.0}]
    assert planned(two) != planned(swapped) != base
    roles = cpt_pipeline(tmp_path)
    roles["cpt"]["validation"] = [{"uri": str(tmp_path / "d.txt")}]
    flipped = cpt_pipeline(tmp_path)
    flipped["cpt"]["corpora"] = [{"uri": str(tmp_path / "d.txt")}]
    assert planned(roles) != planned(flipped)


def test_a_code_version_bump_makes_a_new_artifact_and_the_manifest_records_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    backend = InProcessBackend(tmp_path, monkeypatch)
    first = pl.run_all(load_pipeline(write_config(tmp_path)), backend)["tokenizer"]
    assert fetch(first).manifest.code_version == identity.code_version("tokenizer")
    assert pl.run_all(load_pipeline(write_config(tmp_path)), backend)["tokenizer"] == first and len(backend.runs) == 1
    real = identity.code_version
    monkeypatch.setattr(identity, "code_version", lambda stage: real(stage) + "-edited")  # as after a code edit
    bumped = pl.run_all(load_pipeline(write_config(tmp_path)), backend)["tokenizer"]
    assert bumped != first and len(backend.runs) == 2
    assert fetch(bumped).manifest.code_version == real("tokenizer") + "-edited"


def test_a_valid_artifact_copied_into_another_artifacts_folder_is_not_reused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    backend = InProcessBackend(tmp_path, monkeypatch)
    small = pl.run_all(load_pipeline(write_config(tmp_path, vocab=1000)), backend)["tokenizer"]
    cfg = load_pipeline(write_config(tmp_path, vocab=2000))
    target = pl.plan_stage(cfg, "tokenizer", {}).artifact_uri
    shutil.copytree(small.removeprefix("file://"), target.removeprefix("file://"))
    assert check_artifact(target) is None, "whole, as files go"
    assert "sits in folder" in check_artifact(target, identity=True)
    assert pl.run_all(cfg, backend)["tokenizer"] == target and len(backend.runs) == 2  # rebuilt, not reused
    assert "moved it to" in capsys.readouterr().out
    manifest = fetch(target).manifest
    assert manifest.artifact_id == target.rsplit("/", 1)[-1] and manifest.config["vocab_sizes"] == [2000]


def test_an_artifact_whose_recorded_data_digests_give_another_id_is_not_reused(tmp_path, monkeypatch):
    """The folder and manifest ids agree, but the manifest recorded other data than the id was planned from."""
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    backend = InProcessBackend(tmp_path, monkeypatch)
    cfg = load_pipeline(write_config(tmp_path))
    uri = pl.run_all(cfg, backend)["tokenizer"]
    path = Path(uri.removeprefix("file://")) / "manifest.json"
    raw = json.loads(path.read_text())
    raw["inputs"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(raw))
    from dilforge_shared.manifest import sha256_bytes
    from dilforge_shared.store import manifest_digest_key

    # a consistent manifest (its recorded digest rewritten too, so the damage check passes): only identity can tell
    (path.parent / manifest_digest_key(raw["data_dir"])).write_text(sha256_bytes(path.read_bytes()))
    assert "give id" in check_artifact(uri, identity=True)
    assert pl.run_all(cfg, backend)["tokenizer"] == uri and len(backend.runs) == 2


class ChangingBackend(InProcessBackend):
    """Changes the corpus after the run was planned, before the stage starts."""

    def run(self, job):
        (self.tmp_path / "corpus.txt").write_text("başqa mətn\n")
        return super().run(job)


def test_a_corpus_changed_between_planning_and_the_stage_fails_the_stage_and_publishes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    cfg = load_pipeline(write_config(tmp_path))
    with pytest.raises(pl.StageFailed, match=r"give artifact id \w+, not the planned \w+: data, an upstream"):
        pl.run_all(cfg, ChangingBackend(tmp_path, monkeypatch))
    assert not list((tmp_path / "store").glob("artifacts/**/manifest.json"))


def test_a_corpus_changed_while_the_stage_reads_it_fails_naming_it_and_publishes_nothing(tmp_path, monkeypatch):
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_shared.contract import OptMl, StageResult, stage_main

    monkeypatch.setenv("DILFORGE_VAR_CORPUS_DIR", str(tmp_path))
    cfg = load_pipeline(write_config(tmp_path))
    job = pl.plan_stage(cfg, "tokenizer", {})
    opt = OptMl(tmp_path / "opt")
    write_inputs(opt, build_hyperparameters(job.config, job.artifact_uri, job.run_id, job.inputs))
    monkeypatch.setenv("DILFORGE_OPT_ML", str(opt.root))

    def body(config, ctx):
        (ctx.opt.model_dir / "out.txt").write_text("trained")
        (tmp_path / "corpus.txt").write_text("dəyişdi\n")  # after the stage read it
        return StageResult(metrics=metrics_samples.sample("tokenizer"))

    assert stage_main(STAGE_CONFIGS["tokenizer"], body, "test", ["train"]) == 1
    failure = opt.failure_file.read_text()
    assert "inputs changed while the stage ran: data:corpus.txt" in failure and "nothing published" in failure
    assert not list((tmp_path / "store").glob("artifacts/**/manifest.json"))
