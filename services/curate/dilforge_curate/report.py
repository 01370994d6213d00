"""What the curate stage tells its user: counts per step from datatrove's per-task stats, examples of what each
step removed, the metrics for the manifest, report.md and the data card (README.md beside the shards)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from datatrove.data import Document
from dilforge_shared.errors import InputError
from dilforge_shared.settings import redact
from tabulate import tabulate

from .config import CurateConfig
from .metrics import CurateMetrics, CurateStep, Redacted, SourceCount

# (key, a unique part of the datatrove step's name, what it removes), in pipeline order
STEPS = (
    ("empty", "Empty", "documents with no text left after normalising"),
    ("language", "Language ID", "documents not in the target language (or below the score)"),
    ("repetition", "Gopher Repetition", "repeated lines, paragraphs and n-grams (word spam)"),
    ("lines", "FineWeb Quality", "line-level boilerplate: menus, lists, lines without punctuation"),
    ("quality", "Gopher Quality", "too short or long, symbol spam, few letters, no stop words"),
    ("duplicates", "MinHash stage 4", "exact and near duplicates (all but one copy of each cluster)"),
)
EXAMPLE_CHARS = 240


def record(self, doc: Document) -> dict:
    """An output record: `text` first; provenance without local paths, so the output is the same wherever it ran."""
    scores = {key: doc.metadata[key] for key in ("language_score", "token_count") if key in doc.metadata}
    return {"text": doc.text, "id": doc.id, "source": doc.metadata.get("source"), **scores}


def _merged(folder: Path) -> list[tuple[str, Counter]]:
    """Per step (in order): every stat summed over the finished tasks (a resumed run included)."""
    steps: list[tuple[str, Counter]] = []
    for path in sorted((folder / "stats").glob("*.json")):
        for i, step in enumerate(json.loads(path.read_text())):
            if i == len(steps):
                steps.append((step["name"], Counter()))
            for key, value in step.get("stats", {}).items():
                steps[i][1][key] += value["total"] if isinstance(value, dict) else value
    return steps


def _find(steps: list[tuple[str, Counter]], part: str) -> Counter:
    return next((stats for name, stats in steps if part in name), Counter())


def _examples(folder: Path, limit: int) -> list[str]:
    out: list[str] = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(out) >= limit:
                    return out
                text = json.loads(line)["text"].replace("\n", " ⏎ ")
                out.append(text[:EXAMPLE_CHARS] + ("…" if len(text) > EXAMPLE_CHARS else ""))
    return out


def collect(work: Path, config: CurateConfig, seconds: dict[str, float]) -> CurateMetrics:
    """The metrics of a finished run, from the work folder: counts, removals with examples, throughput."""
    filtered = _merged(work / "logs" / "filter")
    written = _merged(work / "logs" / "write")
    reader, normalise, redact = (_find(filtered, p) for p in ("dilforge sources", "Normalise", "Redact contacts"))
    steps = []
    for key, part, _ in STEPS:
        stats = _find(written if key == "duplicates" else filtered, part)
        reasons = Counter({k.removeprefix("dropped_"): v for k, v in stats.items() if k.startswith("dropped_")})
        examples = _examples(work / "removed" / key, config.output.num_examples)
        steps.append(
            CurateStep(step=key, removed=stats["dropped"], reasons=dict(reasons.most_common()), examples=examples)
        )
    kept, tokens = _find(written, "Source counter"), _find(written, "📊 Counter")
    read, bytes_read, cpu = reader["documents"], reader["bytes"], cpu_seconds(work)
    return CurateMetrics(
        language=config.language,
        documents_read=read,
        documents_kept=kept["kept"],
        chars_read=reader["doc_len"],
        chars_kept=kept["chars"],
        words_kept=kept["words"],
        tokens_kept=tokens.get("tokens") if tokens else None,
        per_source={
            s.label: SourceCount(read=reader[f"source:{s.label}"], kept=kept[f"kept:{s.label}"]) for s in config.corpora
        },
        empty_sources=[s.label for s in config.corpora if reader[f"empty_source:{s.label}"]],
        steps=steps,
        repairs={k: normalise[k] for k in ("encoding_repaired", "unicode_normalised", "whitespace_normalised")},
        redacted={
            kind: Redacted(documents=redact[f"documents_with_{kind}"], replaced=redact[f"{kind}s_replaced"])
            for kind in ("email", "phone", "card")
        },
        num_shards=config.output.num_shards,
        seconds=dict(seconds),
        bytes_read=bytes_read,
        cpu_seconds=cpu,
        mb_per_cpu_second=round(bytes_read / 1e6 / cpu["total"], 3) if cpu.get("total") else None,
        documents_per_cpu_second=round(read / cpu["total"], 1) if cpu.get("total") else None,
    )


def cpu_seconds(work: Path) -> dict[str, float]:
    """CPU seconds per phase, summed over its tasks (each task's own, recorded beside its completion mark, on
    whichever host ran it), and their total."""
    phases = {}
    for folder in sorted((work / "logs").glob("*/cpu")):
        phases[folder.parent.name] = round(sum(float(f.read_text() or 0) for f in folder.iterdir()), 2)
    return {**phases, "total": round(sum(phases.values()), 2)} if phases else {}


def check_not_empty(m: CurateMetrics, config: CurateConfig) -> None:
    """Never a silent empty corpus: no document read, or none kept, is an error saying where they went."""
    if m.documents_read == 0:
        raise InputError(
            "curate.corpora: no document in any source (every file empty or blank)",
            path=", ".join(s.uri for s in config.corpora),
        )
    if m.documents_kept == 0:
        removed = "; ".join(
            f"{s.step} {s.removed}" + (f" ({_top(s.reasons)})" if s.reasons else "") for s in m.steps if s.removed
        )
        raise InputError(
            f"curate: none of the {m.documents_read} documents survived ({removed}); is curate.language "
            f"({config.language!r}) the corpus's language, or are the quality bounds too strict for it?",
            path=", ".join(s.uri for s in config.corpora),
        )


def _top(reasons: dict[str, int], n: int = 3) -> str:
    return ", ".join(f"{k} {v}" for k, v in list(reasons.items())[:n])


def write(out_dir: Path, config: CurateConfig, m: CurateMetrics) -> None:
    """report.md (what each step removed, with examples) and README.md (the data card); tables by tabulate."""
    what = {key: text for key, _, text in STEPS}
    steps = [[s.step, s.removed, _top(s.reasons, 6) or what[s.step]] for s in m.steps]
    lines = [
        f"# Curation report ({config.language})",
        "",
        f"Read {m.documents_read:,} documents ({m.chars_read:,} characters); kept {m.documents_kept:,} "
        f"({m.chars_kept:,} characters, {m.words_kept:,} words"
        + (f", {m.tokens_kept:,} tokens" if m.tokens_kept is not None else "")
        + ").",
        "",
        tabulate(steps, ["step", "removed", "why"], "pipe", intfmt=","),
    ]
    r = m.repairs
    lines += [
        "",
        f"Repaired: {r['encoding_repaired']:,} mis-decoded documents, {r['unicode_normalised']:,} Unicode "
        f"normalised, {r['whitespace_normalised']:,} whitespace.",
        "Redacted: "
        + ", ".join(f"{v.replaced:,} {k}s in {v.documents:,} documents" for k, v in m.redacted.items())
        + ".",
    ]
    if m.empty_sources:
        lines += ["", f"Empty sources (skipped): {', '.join(m.empty_sources)}."]
    for s in m.steps:
        if s.examples:
            lines += ["", f"## Removed by {s.step}", ""] + [f"- {e}" for e in s.examples]
    (out_dir / "report.md").write_text(redact("\n".join(lines)) + "\n", encoding="utf-8")

    q = config.quality
    sources = [
        [s.label, s.licence or "not given", m.per_source[s.label].read, m.per_source[s.label].kept]
        for s in config.corpora
    ]
    card = [
        f"# Data card: curated {config.language} corpus",
        "",
        f"Shards `shard-*.{config.output.format}`, field `text` (also `id`, `source`, `language_score`, "
        "`token_count`). Made by dilforge's curate stage on datatrove; steps and counts in report.md.",
        "",
        tabulate(sources, ["source", "licence", "documents read", "kept"], "pipe", intfmt=",", disable_numparse=[0, 1]),
        "",
        f"Language: {config.language} (lingua, score ≥ {config.language_id.min_score}"
        + (
            f", or within {lid.relative_margin} of {', '.join(lid.relatives)} or written in its own letters"
            if (lid := config.language_id).relatives
            else ""
        )
        + "); contact details replaced by "
        f"{config.redact.email_placeholder}, {config.redact.phone_placeholder}, {config.redact.card_placeholder}; "
        f"near duplicates removed by MinHash ({config.dedup.num_buckets}×{config.dedup.hashes_per_bucket}, "
        f"{config.dedup.n_grams}-grams).",
        "",
        f"Length and lines: documents of {q.min_words:,} to {q.max_words:,} words are kept (quality.min_words: "
        f"Gopher's and FineWeb's minimum is 50, for web pages; shorter documents are dropped, counted in report.md); "
        f"at least {q.line_punct_thr:.1%} of a document's lines must end a sentence (quality.line_punct_thr; "
        f"a line ends one with .!? or {q.line_end_closers}), so a one-line document without that is dropped.",
    ]
    (out_dir / "README.md").write_text(redact("\n".join(card)) + "\n", encoding="utf-8")  # no secret in a card
