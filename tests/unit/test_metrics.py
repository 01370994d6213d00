"""Typed metrics between stages (contract.validate_metrics, read_metrics): a producer's renamed metric fails its
publish, and eval reads the upstream fields it shows through its own models (compare.READERS), so a field renamed in a
producer's model without its consumer fails here too, and an upstream artifact of another shape is an InputError."""

from __future__ import annotations

import metrics_samples
import pytest
from dilforge_coordinator.config import STAGE_CONFIGS
from dilforge_cpt.metrics import CptMetrics
from dilforge_eval import compare
from dilforge_sft.metrics import SftMetrics
from dilforge_shared.contract import read_metrics, validate_metrics
from dilforge_shared.errors import DilforgeError, InputError

STAGE_METRICS = {stage: config.metrics_model for stage, config in STAGE_CONFIGS.items()}


@pytest.mark.parametrize("stage", sorted(metrics_samples.SAMPLES))
def test_every_stage_sample_validates_and_round_trips(stage):
    typed = validate_metrics(stage, STAGE_METRICS[stage], metrics_samples.sample(stage))
    assert type(typed) is STAGE_METRICS[stage]
    again = STAGE_METRICS[stage].model_validate(typed.model_dump(mode="json"))
    assert again == typed


@pytest.mark.parametrize(
    "stage,key", [(stage, key) for stage, sample in sorted(metrics_samples.SAMPLES.items()) for key in sample]
)
def test_renaming_any_published_metric_fails_the_publish_naming_it(stage, key):
    metrics = metrics_samples.sample(stage)
    metrics[f"{key}_renamed"] = metrics.pop(key)
    with pytest.raises(DilforgeError, match=rf"stage {stage} publishes metrics .*metrics\.{key}(_renamed)?:"):
        validate_metrics(stage, STAGE_METRICS[stage], metrics)


def test_a_nested_rename_and_a_stray_validation_key_are_refused():
    bad = metrics_samples.sample("cpt")
    bad["history"][0]["train_loss"] = bad["history"][0].pop("loss")
    with pytest.raises(DilforgeError, match=r"metrics\.history\.0\."):
        validate_metrics("cpt", CptMetrics, bad)
    stray = metrics_samples.sample("cpt")
    stray["validation"][0]["val_ppl"] = 3.0
    with pytest.raises(DilforgeError, match="unknown validation metric 'val_ppl'"):
        validate_metrics("cpt", CptMetrics, stray)
    typed = CptMetrics.model_validate(metrics_samples.sample("cpt"))
    assert typed.validation[1].model_extra == {"val_bpb/az": 3.9}


def test_an_upstream_manifest_that_does_not_parse_names_the_artifact_and_field():
    old = metrics_samples.sample("sft")
    del old["train_loss_history"]
    with pytest.raises(InputError, match=r"s3://b/sft/1: metrics do not match SftMetrics .*train_loss_history"):
        read_metrics(SftMetrics, old, "s3://b/sft/1")


def test_eval_reads_curves_cost_and_step0_from_the_published_metrics():
    """What eval reads of the cpt and sft metrics as their models publish them; a field renamed in a producer's
    model (and so in its sample) fails here, and an upstream artifact without it is an InputError naming it."""
    out = {"curves": {}, "cost": {}}
    for stage, model in (("cpt", CptMetrics), ("sft", SftMetrics)):
        compare.upstream(stage, model.model_validate(metrics_samples.sample(stage)).model_dump(mode="json"), out)
    assert out["curves"] == {
        "cpt": {
            "loss": [[1.0, 5.5], [2.0, 5.0], [3.0, 4.5], [4.0, 4.0]],
            "validation/val_loss": [[0.0, 6.5], [4.0, 4.1]],
        },
        "sft": {"loss": [[1.0, 3.0], [2.0, 2.5]]},
    }
    assert out["cost"] == {
        "cpt": {"tokens_seen": 4096, "total_tokens": 4096, "tokens_per_s": 100.0, "peak_memory_gb": 0.46},
        "sft": {"train_runtime_s": 2.5, "train_steps_per_second": 0.8, "optimizer_steps": 2},
    }
    assert out["transplant"].step0_bpb == {"random": {"val": 5.27}, "mean_of_pieces": {"val": 2.81}}


def test_an_upstream_manifest_without_a_field_eval_reads_names_the_artifact_and_field():
    from types import SimpleNamespace

    from dilforge_eval.stage import upstream_sections

    old = metrics_samples.sample("sft")
    del old["train_loss_history"]
    art = SimpleNamespace(uri="s3://b/sft/1", manifest=SimpleNamespace(metrics=old))
    ctx = SimpleNamespace(has_input=lambda name: name == "sft", input=lambda name: art)
    with pytest.raises(
        InputError, match=r"s3://b/sft/1: sft metrics do not hold .*metrics\.train_loss_history: Field required"
    ):
        upstream_sections(ctx)


def test_an_upstream_sweep_of_another_shape_names_the_field():
    from types import SimpleNamespace

    from dilforge_eval.stage import upstream_sections

    bad = metrics_samples.sample("tokenizer", sweep=3)
    art = SimpleNamespace(uri="s3://b/tok/1", manifest=SimpleNamespace(metrics=bad))
    ctx = SimpleNamespace(has_input=lambda name: name == "tokenizer", input=lambda name: art)
    with pytest.raises(
        InputError, match=r"s3://b/tok/1: tokenizer metrics do not hold .*\(metrics\.sweep: Input should be"
    ):
        upstream_sections(ctx)


def _edit(sample: dict, path: str, value) -> dict:
    """`sample` with the value at a dotted path (list indices as numbers) replaced, or removed where value is ..."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = sample
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return sample


@pytest.mark.parametrize(
    "stage,path,value",
    [
        ("cpt", "history.0.step", "abc"),
        ("cpt", "history.0.loss", "high"),
        ("cpt", "tokens_per_s", "fast"),
        ("cpt", "transplant", 3),
        ("cpt", "transplant.step0_val_bpb_by_set", {"x": "ab"}),
        ("cpt", "validation.0.val_loss", ...),
        ("sft", "train_loss_history.0.loss", [1]),
        ("tokenizer", "comparison.0.languages", ["az"]),
        ("tokenizer", "sweep.0.sets", ...),
    ],
)
def test_an_upstream_field_eval_reads_of_another_shape_is_an_input_error_naming_it(stage, path, value):
    from types import SimpleNamespace

    from dilforge_eval.stage import upstream_sections

    bad = _edit(metrics_samples.sample(stage), path, value)
    art = SimpleNamespace(uri=f"s3://b/{stage}/1", manifest=SimpleNamespace(metrics=bad))
    ctx = SimpleNamespace(has_input=lambda name: name == stage, input=lambda name: art)
    field = path.split(".")[0]
    with pytest.raises(InputError, match=rf"s3://b/{stage}/1: {stage} metrics do not hold .*metrics\.{field}"):
        upstream_sections(ctx)


def test_eval_shows_the_tokenizer_rows_as_published():
    out = {"curves": {}, "cost": {}}
    sample = metrics_samples.sample("tokenizer")
    compare.upstream("tokenizer", sample, out)
    assert out["vocab_sweep"].rows == sample["sweep"]
    assert out["vocab_sweep"].base == sample.get("base")
    if out["tokenizer_comparison"] is not None:
        assert out["tokenizer_comparison"].rows == sample["comparison"]
