"""The gate before a model ships: `serve`, `deploy` and `export` print the model's assistant figures (the eval
artifact of its run: answers in the target language, ending the turn, looping, parroting, per prompt group) and
refuse a model under the pipeline's thresholds (`eval.assistant.min_in_language` / `min_ended_turn`, recorded in
the eval artifact), or one without figures, unless forced; each refusal is one line naming the reason."""

from __future__ import annotations

from dataclasses import dataclass

import typer
from dilforge_eval.metrics import AssistantFigures, AssistantSection, EvalMetrics
from dilforge_shared.contract import read_metrics
from dilforge_shared.errors import ConfigError, DilforgeError, ManifestNotFound

from .common import fail

LABELS = {"sft": "sft", "cpt": "cpt", "model": "base"}  # the artifact's stage -> its label in the eval report


@dataclass(frozen=True)
class Verdict:
    """What the gate found: lines to print, and the reason to refuse (None: the model passes)."""

    lines: list[str]
    refusal: str | None


def _share(name: str, s) -> str:
    return f"{name} {s.value:.2f} [{s.low:.2f}–{s.high:.2f}]" if s.value is not None else f"{name} –"


def figure_line(group: str, f: AssistantFigures) -> str:
    parts = [
        _share("in language", f.in_language),
        _share("ended the turn", f.ended_turn),
        _share("looping", f.looping),
        _share("parroting", f.parroting),
    ]
    if f.chrf is not None:
        parts.append(f"chrF++ {f.chrf.score:.1f}")
    return f"  {group} (n {f.n}): " + ", ".join(parts)


def judge(section: AssistantSection | None, label: str, source: str) -> Verdict:
    """The figures of model `label` in an eval artifact's assistant section, against its thresholds."""
    if section is None:
        return Verdict([], f"{source} has no assistant figures (eval.assistant was off)")
    groups = section.figures.get(label)
    t = section.thresholds
    if not groups or t.language not in groups:
        return Verdict([], f"{source} has no assistant figures for the {label} model in {t.language!r}")
    lines = [f"assistant figures of the {label} model ({source}; 95 % intervals):"]
    lines += [figure_line(g, f) for g, f in groups.items()]
    f = groups[t.language]
    short = []
    if f.in_language.value is None or f.in_language.value < t.min_in_language:
        short.append(f"answers in {t.language} {f.in_language.value:.2f} < {t.min_in_language}")
    if f.ended_turn.value is None or f.ended_turn.value < t.min_ended_turn:
        short.append(f"ending the turn {f.ended_turn.value:.2f} < {t.min_ended_turn}")
    return Verdict(lines, f"{label} model below the thresholds: {', '.join(short)}" if short else None)


def manifest_or_none(uri: str, endpoint_url: str | None = None):
    """The artifact's manifest (read, not downloaded with its files), or None for a plain HF folder/prefix."""
    from dilforge_shared.store import read_manifest

    try:
        return read_manifest(uri, endpoint_url)[0]
    except ManifestNotFound:
        return None


def eval_section(
    artifact: str, store: str, run: str | None, endpoint: str | None
) -> tuple[AssistantSection | None, str, str]:
    """(assistant section, label of the artifact's model, where it came from) from the eval artifact of the
    artifact's run (`run`, else the run id in the artifact's manifest) in the artifact's own store (`store` for an
    artifact kept outside one). DilforgeError when there is none."""
    from dilforge_shared.store import read_manifest, store_of

    from . import records

    manifest = manifest_or_none(artifact, endpoint)
    if manifest is None:
        raise DilforgeError(f"{artifact} is not a pipeline artifact, so no eval measured it")
    label = LABELS.get(manifest.stage)
    if label is None:
        raise DilforgeError(f"{artifact} is a {manifest.stage} artifact, not a model")
    run_id = run or manifest.run_id
    store = found[0] if (found := store_of(artifact, endpoint)) else store
    try:
        eval_uri = records.run_artifact(run_id, store, "eval", endpoint)
        eval_manifest, _ = read_manifest(eval_uri, endpoint)
    except (ConfigError, ManifestNotFound) as exc:
        raise DilforgeError(f"no eval artifact for run {run_id!r} in {store} ({exc})") from None
    measured = {i.name: i.sha256 for i in eval_manifest.inputs}  # an upstream artifact as `artifact:<id>`
    if measured.get(manifest.stage) != f"artifact:{manifest.artifact_id}":
        raise DilforgeError(f"the eval artifact of run {run_id!r} did not measure {artifact} (rerun the eval stage)")
    metrics = read_metrics(EvalMetrics, eval_manifest.metrics, eval_uri)
    return metrics.assistant, label, f"eval artifact {eval_manifest.artifact_id}"


def check(artifact: str, store: str, run: str | None, endpoint: str | None, force: bool, action: str) -> None:
    """Print the artifact's assistant figures; refuse (exit 1, one line) below the thresholds or without figures,
    unless `force`."""
    try:
        verdict = judge(*eval_section(artifact, store, run, endpoint))
    except DilforgeError as exc:
        verdict = Verdict([], f"no assistant figures: {exc}")
    for line in verdict.lines:
        typer.echo(line)
    if verdict.refusal is None:
        return
    if force:
        typer.echo(f"warning: {action} anyway (--force): {verdict.refusal}", err=True)
        return
    fail(f"refusing to {action} {artifact}: {verdict.refusal} (--force to {action} it anyway)")
