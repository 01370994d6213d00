"""The one resolver (`dilforge_shared.models`): one precedence rule, one way to find a folder of a kind, one way
to find an adapter's base; every stage's base lookup follows the rule (torch-free, seconds)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from dilforge_coordinator.config import PipelineConfig
from dilforge_cpt.config import CptConfig
from dilforge_sft.config import SftConfig
from dilforge_shared.configs import validate_model
from dilforge_shared.errors import ConfigError
from dilforge_shared.manifest import InputRef, Manifest, current_producer
from dilforge_shared.models import Resolved, choose, find_dir, open_model, resolve
from dilforge_shared.serving import adapter_base, resolve_chat_model
from dilforge_shared.store import fetch, publish
from dilforge_tokenizer.config import TokenizerConfig


def hf(root, tokenizer=True):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_text("w")
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
    return root


def adapter(root, base="/declared/base"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    (root / "adapter_model.safetensors").write_text("a")
    return root


def published(tmp_path, name, folder, config=None, inputs=()):
    uri = str(tmp_path / "store" / "artifacts" / "sft" / name)
    publish(
        uri,
        folder,
        Manifest(
            code_version="test",
            kind="adapter",
            artifact_id=name,
            run_id="r",
            stage="sft",
            producer=current_producer("test"),
            config=config or {},
            data_dir="pending",
            files=[],
            inputs=list(inputs),
        ),
    )
    return uri


# ---- the precedence rule ----------------------------------------------------------------------------


def test_the_config_field_wins_then_the_nearest_upstream_input(caplog):
    inputs = {"model": "s3://b/model", "cpt": "s3://b/cpt"}
    with caplog.at_level(logging.WARNING):
        picked = choose("base_model", "/explicit", inputs)
    assert (picked.uri, picked.input) == ("/explicit", None)
    assert "base_model=/explicit wins over the upstream 'cpt' artifact" in caplog.text
    assert choose("base_model", None, inputs) == choose("base_model", "", inputs)
    assert choose("base_model", None, inputs).input == "cpt"  # cpt is nearer than model
    assert choose("base_model", None, {"model": "m"}).input == "model"
    assert choose("base_model", None, inputs, order=("model",)).uri == "s3://b/model"
    assert choose("base_model", None, {"tokenizer": "t"}) is None


class Ctx:
    """The part of a StageContext the base lookups read: request.inputs and input(name)."""

    def __init__(self, inputs, tmp_path):
        self.request = SimpleNamespace(inputs={k: str(v) for k, v in inputs.items()})
        self.endpoint_url, self.cache_dir = None, tmp_path / "cache"

    def has_input(self, name):
        return name in self.request.inputs

    def input(self, name):
        return fetch(self.request.inputs[name])


@pytest.fixture
def two_bases(tmp_path):
    """An upstream model artifact and a plain folder, with different tokenizers so each lookup shows which won."""
    art_dir = hf(tmp_path / "artifact-files" / "model")
    (art_dir / "tokenizer.json").write_text('{"from": "artifact"}')
    art = published(tmp_path, "m1", art_dir.parent)
    plain = hf(tmp_path / "plain")
    (plain / "tokenizer.json").write_text('{"from": "field"}')
    return art, plain


def test_every_stage_applies_the_same_rule(tmp_path, two_bases, monkeypatch):
    """tokenizer, cpt and sft pick the config field over an upstream input, and the input without the field."""
    from dilforge_cpt.model_init import base_model_source
    from dilforge_sft.stage import resolve_base as sft_base
    from dilforge_tokenizer.base import resolve_base as tok_base

    art, plain = two_bases
    corpus = [{"uri": str(tmp_path / "c.txt")}]

    def tok_cfg(**kw):
        return TokenizerConfig.model_validate({"strategy": "extend", "corpora": corpus, **kw})

    both, only_input = Ctx({"model": art}, tmp_path), Ctx({"model": art}, tmp_path)

    class Chosen(Exception):
        pass

    def load(folder, uri):
        raise Chosen(json.loads((folder / "tokenizer.json").read_text())["from"])

    monkeypatch.setattr("dilforge_tokenizer.base.load", load)
    for cfg, ctx, expected in (
        (tok_cfg(base_tokenizer=str(plain)), both, "field"),
        (tok_cfg(), only_input, "artifact"),
    ):
        with pytest.raises(Chosen, match=expected):
            tok_base(cfg, ctx)

    cpt = CptConfig.model_validate(
        {"corpora": corpus, "validation": corpus, "base_model": str(plain), "phase1": {"num_steps": 1}}
    )
    assert base_model_source(cpt, both).input is None
    assert base_model_source(cpt.model_copy(update={"base_model": None}), both).input == "model"

    sft = SftConfig.model_validate({"train": [{"uri": str(tmp_path / "t.jsonl")}], "base_model": str(plain)})
    assert sft_base(sft, Ctx({"model": art}, tmp_path))[0] == plain
    folder, uri = sft_base(sft.model_copy(update={"base_model": None}), Ctx({"model": art, "cpt": art}, tmp_path))
    assert folder.name == "model" and uri == art


def test_a_pipeline_that_gives_a_base_twice_is_refused(tmp_path):
    base = {"run_id": "r", "store": {"uri": str(tmp_path / "s")}}
    corpus = [{"uri": str(tmp_path / "c.txt")}]
    with pytest.raises(ConfigError, match=r"sft.base_model and the pipeline's cpt stage both give the base model"):
        validate_model(
            PipelineConfig,
            {
                **base,
                "cpt": {"corpora": corpus, "validation": corpus, "base_model": "/m", "phase1": {"num_steps": 1}},
                "sft": {"train": corpus, "base_model": "/m"},
            },
            "test",
        )
    with pytest.raises(ConfigError, match=r"sft.base_model and the pipeline's `model:` block"):
        validate_model(
            PipelineConfig, {**base, "model": {"source": "./m"}, "sft": {"train": corpus, "base_model": "/m"}}, "test"
        )


# ---- finding a folder of a kind ---------------------------------------------------------------------


def test_find_dir_prefers_root_then_the_named_subfolders_and_refuses_a_tie(tmp_path):
    root = tmp_path / "a"
    hf(root / "model")
    hf(root / "merged")
    (root / "config-only").mkdir(parents=True)
    (root / "config-only" / "config.json").write_text("{}")  # no weights: not a model
    assert find_dir(root, "model", "a") == root / "merged"
    assert find_dir(root, "tokenizer", "a") == root / "merged"
    hf(root)
    assert find_dir(root, "model", "a") == root
    tie = tmp_path / "b"
    hf(tie / "x")
    hf(tie / "y")
    with pytest.raises(ConfigError, match=r"b: several model folders \['x', 'y'\]; point at one"):
        find_dir(tie, "model", "b")
    assert find_dir(tie, "adapter", "b", required=False) is None
    with pytest.raises(ConfigError, match="no PEFT adapter"):
        find_dir(tie, "adapter", "b")
    deep = tmp_path / "c"
    hf(deep / "one" / "two" / "three", tokenizer=False)
    assert find_dir(deep, "model", "c") == deep / "one" / "two" / "three"


# ---- an adapter's base, one way -----------------------------------------------------------------------


def test_an_adapter_artifacts_base_is_its_sft_lineage_by_the_same_rule(tmp_path):
    folder = tmp_path / "sft-files"
    adapter(folder / "adapter")
    cpt = InputRef(name="cpt", kind="manifest", uri="s3://b/artifacts/cpt/c1", sha256="1" * 64)
    model = InputRef(name="model", kind="manifest", uri="s3://b/artifacts/model/m1", sha256="2" * 64)
    for name, config, inputs, expected in [
        ("s1", {}, [model, cpt], cpt.uri),  # cpt before model
        ("s2", {}, [model], model.uri),
        ("s3", {"base_model": "/direct"}, [], "/direct"),  # the field the SFT run used
        ("s4", {}, [], "/declared/base"),
    ]:  # nothing recorded: adapter_config.json
        src = open_model(published(tmp_path, name, folder, config, inputs))
        assert adapter_base(Resolved(src.path / "adapter", src.uri, src.manifest)) == expected, name
    plain = adapter(tmp_path / "plain-adapter", base="/from/config")
    assert adapter_base(resolve(str(plain), "adapter")) == "/from/config"


def test_chat_loads_an_adapter_on_the_base_its_lineage_names_or_the_merged_weights(tmp_path):
    base = hf(tmp_path / "base")
    folder = tmp_path / "sft-files"
    adapter(folder / "adapter", base="/somewhere/else")
    hf(folder / "merged")
    uri = published(tmp_path, "s1", folder, {"base_model": str(base)})
    spec = resolve_chat_model(uri)
    assert spec.base_dir == base and spec.adapter_dir.name == "adapter" and spec.tokenizer_dir == spec.adapter_dir
    merged = resolve_chat_model(uri, prefer_merged=True)
    assert merged.adapter_dir is None and merged.base_dir.name == "merged"
    assert resolve_chat_model(uri, base=str(hf(tmp_path / "other"))).base_dir == tmp_path / "other"
    bare = adapter(tmp_path / "bare", base="")
    with pytest.raises(ConfigError, match="an adapter without a recorded base model; pass --base"):
        resolve_chat_model(str(bare))
