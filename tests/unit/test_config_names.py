"""One name per idea across the stage configs (the shared training knobs of dilforge_shared/training.py)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from dilforge_coordinator.config import CONFIG_SCHEMA_VERSION, load_pipeline
from dilforge_cpt.config import CptConfig
from dilforge_sft.config import SftConfig
from dilforge_shared.configs import validate_model
from dilforge_shared.errors import ConfigError
from dilforge_shared.training import Batching, Checkpointing, SourceLimits, Warmup

ROOT = Path(__file__).resolve().parents[2]
CPT = {
    "scratch_model": {},
    "corpora": [{"uri": "a.txt"}, {"uri": "b.txt"}],
    "validation": [{"uri": "dev.txt"}],
    "phase2": {"num_steps": 4},
}
SFT = {"train": [{"uri": "chat.jsonl"}]}


def test_both_stages_share_one_definition_of_each_knob():
    for group in (Batching, Warmup, Checkpointing):
        for name, info in group.model_fields.items():
            cpt_field = (
                CptConfig.model_fields.get(name) or CptConfig.model_fields["phase1"].annotation.model_fields[name]
            )
            sft_field = SftConfig.model_fields[name]
            assert cpt_field.description == sft_field.description == info.description, name
            assert cpt_field.json_schema_extra == sft_field.json_schema_extra == info.json_schema_extra, name
    for source in (CptConfig.model_fields["corpora"], SftConfig.model_fields["train"]):
        assert (
            source.annotation.__args__[0].model_fields["max_docs"].description
            == SourceLimits.model_fields["max_docs"].description
        )


def test_warmup_as_a_count_or_a_share():
    assert Warmup().warmup_steps(100) == 0
    assert Warmup(warmup_ratio=0.03).warmup_steps(100) == 3
    assert Warmup(num_warmup_steps=5, warmup_ratio=0.5).warmup_steps(100) == 5  # the count wins
    cfg = validate_model(CptConfig, {**CPT, "phase2": {"num_steps": 10, "warmup_ratio": 0.25}}, "r.yaml")
    assert cfg.phase2.warmup_steps(cfg.phase2.num_steps) == 3
    with pytest.raises(ConfigError, match=r"phase2.num_warmup_steps \(11\) exceeds phase2.num_steps"):
        validate_model(CptConfig, {**CPT, "phase2": {"num_steps": 10, "num_warmup_steps": 11}}, "w.yaml")


def test_a_global_batch_that_does_not_divide_names_both_fields():
    with pytest.raises(ConfigError, match=r"global_batch_size \(10\) must be a multiple of micro_batch_size \(4\)"):
        validate_model(SftConfig, {**SFT, "global_batch_size": 10, "micro_batch_size": 4}, "b.yaml")


def test_new_names_load_without_warnings_in_every_preset(data_root):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for preset in sorted((ROOT / "configs").glob("*.yaml")):
            load_pipeline(preset)


def test_exported_schema_carries_the_config_version():
    schema = json.loads((ROOT / "schemas" / "pipeline.schema.json").read_text())
    assert schema["x-dilforge-config-version"] == CONFIG_SCHEMA_VERSION == "1.3.0"
    props = schema["$defs"]
    assert "learning_rate" in props["Phase1"]["properties"] and "lr" not in props["Phase1"]["properties"]
    assert {"global_batch_size", "micro_batch_size", "eval_micro_batch_size", "activation_checkpointing"} <= set(
        props["SftConfig"]["properties"]
    ) & set(props["CptConfig"]["properties"])
    assert "per_device_batch_size" not in props["SftConfig"]["properties"]
    assert "nproc_per_node" not in props["StageResources"]["properties"]


def test_lines_per_document_is_bounded_before_any_work():
    """Issue 31: num_lines_per_document 1e9 built one document of a whole corpus in memory (12.7 GB RSS)."""
    raw = {"corpora": [{"uri": "a", "num_lines_per_document": 10**9}], "phase1": {"num_steps": 1}}
    with pytest.raises(ConfigError, match=r"corpora\.0\.num_lines_per_document.*less than or equal to 1024"):
        validate_model(CptConfig, raw, "big.yaml")


# Integer fields without an upper bound, each with why none is needed: caps on data read (the data bounds them),
# cadences (a larger value means less work) and document filters. Everything else that scales memory or time must
# declare a maximum (issue 31: 1e9 in one field built a whole corpus in memory).
UNBOUNDED_BY_DESIGN = {
    "model.gguf_converter": "a fixed version literal, not a choice",
    "curate.quality.min_words": "a filter threshold",
    "curate.quality.max_words": "a filter threshold",
    "curate.quality.min_stop_words": "a filter threshold",
    "tokenizer.max_lines": "a cap on data read",
    "cpt.corpora[].max_docs": "a cap on data read",
    "sft.train[].max_docs": "a cap on data read",
    "sft.validation[].max_docs": "a cap on data read",
    "eval.generation.num_prompts": "a cap on data read",
    "eval.assistant.per_language": "a cap on data read",
    "eval.tasks.sib200.max_examples": "a cap on data read",
    "eval.tasks.translation[].max_examples": "a cap on data read",
    "eval.tasks.instructions.max_examples": "a cap on data read",
    "eval.tasks.multiple_choice[].max_examples": "a cap on data read",
    "eval.max_docs_per_set": "a cap on data read",
    "eval.max_bytes_per_set": "a cap on data read",
    "cpt.checkpoint_every": "a cadence",
    "sft.checkpoint_every": "a cadence",
    "cpt.log_every": "a cadence",
    "sft.log_every": "a cadence",
    "cpt.eval_every": "a cadence",
}


def _unbounded_integers(schema: dict) -> set[str]:
    defs, out, seen = schema.get("$defs", {}), set(), set()

    def walk(node, path: str) -> None:
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            name = node["$ref"].split("/")[-1]
            if (name, path) not in seen:
                seen.add((name, path))
                walk(defs[name], path)
            return
        if node.get("type") == "integer" and "maximum" not in node and "exclusiveMaximum" not in node:
            out.add(path)
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in node.get(key, []):
                walk(sub, path)
        walk(node.get("items"), f"{path}[]")
        for i, sub in enumerate(node.get("prefixItems") or []):
            walk(sub, f"{path}[{i}]")
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}" if path else key)

    walk(schema, "")
    return out


def test_every_integer_that_scales_memory_or_time_has_an_upper_bound():
    from dilforge_coordinator.schemas import schemas

    unbounded = _unbounded_integers(schemas()["pipeline.schema.json"])
    assert unbounded == set(UNBOUNDED_BY_DESIGN), (
        f"new unbounded: {sorted(unbounded - set(UNBOUNDED_BY_DESIGN))}; "
        f"no longer unbounded: {sorted(set(UNBOUNDED_BY_DESIGN) - unbounded)}"
    )


@pytest.mark.parametrize(
    ("section", "raw", "field"),
    [
        ("cpt", {"seq_len": 10**9}, "cpt.seq_len"),
        ("cpt", {"global_batch_size": 10**9}, "cpt.global_batch_size"),
        ("cpt", {"micro_batch_size": 10**9}, "cpt.micro_batch_size"),
        ("cpt", {"phase1": {"num_steps": 10**12}}, "cpt.phase1.num_steps"),
        ("cpt", {"scratch_model": {"num_hidden_layers": 100_000}}, "cpt.scratch_model.num_hidden_layers"),
        ("sft", {"max_length": 10**9}, "sft.max_length"),
        ("sft", {"lora": {"r": 10**6}}, "sft.lora.r"),
        ("sft", {"seed": 2**70}, "sft.seed"),
        ("tokenizer", {"vocab_sizes": [10**9]}, "tokenizer.vocab_sizes.0"),
        ("eval", {"generation": {"max_new_tokens": 10**9}}, "eval.generation.max_new_tokens"),
        ("eval", {"tasks": {"bootstrap_iters": 10**9}}, "eval.tasks.bootstrap_iters"),
    ],
)
def test_a_huge_value_is_refused_at_validation_naming_the_field(tmp_path, section, raw, field):
    base = {
        "cpt": {"corpora": [{"uri": "a"}], "phase1": {"num_steps": 1}},
        "sft": {"train": [{"uri": "a.jsonl"}]},
        "tokenizer": {"corpora": [{"uri": "a"}]},
        "eval": {},
    }[section]
    merged = {
        **base,
        **{
            k: ({**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v)
            for k, v in raw.items()
        },
    }
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"run_id": "r", "store": {"uri": str(tmp_path / "s")}, section: merged}))
    with pytest.raises(ConfigError, match=re.escape(field) + r"(\.[^:]+)?: .*less than or equal to"):
        load_pipeline(path)
