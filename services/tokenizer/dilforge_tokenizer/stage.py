"""The tokenizer stage, top to bottom.

parse (config, base tokenizer, validation sets) → stream the corpora once into one BPE training at
the largest swept size (the held-out slice is collected on the way) → cut every smaller size from it
→ measure each size and the base on the held-out slice and validation sets → pick a size by the
config's rule → write the tokenizer folder, metrics.json and sweep.md to model_dir.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path

from dilforge_shared.configs.tokenizer import TokenizerConfig
from dilforge_shared.contract import StageContext, StageResult, log_config
from dilforge_shared.corpus import iter_texts
from dilforge_shared.errors import DilforgeError, InputError
from dilforge_shared.textmetrics import measure, tokenizers_encoder
from tokenizers import Tokenizer
from tqdm import tqdm

from . import base as base_tok
from . import bpe, llama3
from .stream import CorpusStream

log = logging.getLogger("dilforge.tokenizer")

HELDOUT = "heldout"


def read_validation_sets(config: TokenizerConfig, endpoint_url: str | None) -> dict[str, list[str]]:
    """Validation sets are small (dev sets): read whole; an empty one is an error, not a NaN."""
    sets = {}
    for source in config.validation:
        texts = list(iter_texts(source.uri, source.format, source.text_field, endpoint_url, config.normalization,
                                    **source.bounds))
        if not texts:
            raise InputError("validation set is empty: no non-blank text in it", path=source.uri)
        sets[source.label] = texts
    return sets


def measure_sets(tok: Tokenizer, sets: dict[str, list[str]]) -> dict[str, dict]:
    """One encode_batch call per set (the sets are small and already in memory): fewer, larger
    batches keep the tokenizer's threads busier than the 256-text default."""
    encode = tokenizers_encoder(tok)
    return {name: measure(texts, encode, batch_size=max(1, len(texts))).summary()
            for name, texts in sets.items() if texts}


def select_size(rows: list[dict], rule: str, tolerance: float, set_name: str) -> dict:
    """smallest_within_tolerance: the smallest size whose fertility on `set_name` is at most
    (1 + tolerance) x the best fertility of the sweep; largest: the largest size."""
    rows = sorted(rows, key=lambda r: r["vocab_size"])
    if rule == "largest":
        return rows[-1]
    best = min(r["sets"][set_name]["tokens_per_word"] for r in rows)
    return next(r for r in rows if r["sets"][set_name]["tokens_per_word"] <= best * (1 + tolerance))


def verify_output(out: Path, tok: Tokenizer | None) -> dict:
    """Check what is about to be published: the tokenizer round-trips text and the special-token roles
    named in tokenizer_config.json exist. `tok` is the tokenizer just saved (reloading a 50k-vocab
    file costs ~0.2 s; the tests load every strategy's output with both libraries instead)."""
    sample = "Azərbaycan dili türk dillərinin oğuz qrupuna daxildir. Hello world!"
    config_file = out / "tokenizer_config.json"
    try:
        raw = tok or Tokenizer.from_file(str(out / "tokenizer.json"))
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise DilforgeError(f"output tokenizer in {out} does not load: {exc}") from None
    ids = raw.encode(sample, add_special_tokens=False).ids
    if raw.decode(ids) != sample:
        raise DilforgeError(f"output tokenizer in {out} does not round-trip text")
    roles = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token")}
    for role, token in roles.items():
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and raw.token_to_id(content) is None:
            raise DilforgeError(f"{config_file}: {role} {content!r} is not in the vocabulary")
    return {"vocab_size_total": raw.get_vocab_size(with_added_tokens=True), **roles,
            "has_chat_template": (out / "chat_template.jinja").exists() or "chat_template" in config}


def sweep_table(rows: list[dict], base: dict[str, dict] | None, selected: int | None) -> str:
    head = "| vocab size | set | tokens/word | bytes/token | words 3+ tokens |"
    sep = "|---:|---|---:|---:|---:|"
    if base:
        head += " base tokens/word | base bytes/token | base words 3+ |"
        sep += "---:|---:|---:|"
    lines = [head, sep]

    def cells(s: dict) -> str:
        return f" {s['tokens_per_word']:.3f} | {s['bytes_per_token']:.3f} | {100 * s['share_words_3plus']:.1f}% |"
    for row in sorted(rows, key=lambda r: r["vocab_size"]):
        mark = " (selected)" if row["vocab_size"] == selected else ""
        for name, s in row["sets"].items():
            line = f"| {row['vocab_size']}{mark} | {name} |" + cells(s)
            if base and name in base:
                line += cells(base[name])
            lines.append(line)
    if not rows and base:
        lines = ["| set | base tokens/word | base bytes/token | base words 3+ tokens |", "|---|---:|---:|---:|"]
        lines += [f"| {name} |" + cells(s) for name, s in base.items()]
    return "\n".join(lines) + "\n"


def sweep(config: TokenizerConfig, trained: Tokenizer, trained_doc: dict | None, base_doc: dict | None,
          sets: dict[str, list[str]]) -> tuple[list[dict], dict[int, Tokenizer]]:
    """Every size of the sweep, cut from the one training, finished and measured on every set."""
    largest = max(config.vocab_sizes)
    rows, built = [], {}
    for size in tqdm(sorted(config.vocab_sizes), desc="sweep", disable=not sys.stderr.isatty()):
        if config.strategy == "replace":
            # the largest size is the trained tokenizer itself: no serialise/parse round trip
            tok = llama3.finish(trained) if size == largest else bpe.replace_tokenizer(trained_doc, size)
            info = {"vocab_size_regular": tok.get_vocab_size(with_added_tokens=False)}
        else:
            doc, added = bpe.extend(base_doc, bpe.truncate(trained_doc, size))
            tok, info = bpe.from_doc(doc), {"num_added_tokens": added}
        built[size] = tok
        rows.append({"vocab_size": size, "vocab_size_total": bpe.vocab_size_with_specials(tok), **info,
                     "sets": measure_sets(tok, sets)})
    return rows, built


def run(config: TokenizerConfig, ctx: StageContext) -> StageResult:
    t_start = time.perf_counter()
    tty = sys.stderr.isatty()
    log_config(config, {"num_sizes": len(config.vocab_sizes), "train_vocab_size": max(config.vocab_sizes),
                        "trainings": 0 if config.strategy == "base" else 1})
    endpoint = ctx.endpoint_url
    extra_inputs = []
    base_dir = base_model = base_doc = None
    # The base: config.base_tokenizer, else the pipeline's `model` artifact. The contract records its
    # lineage by the same ref the coordinator fingerprinted (shared models.config_refs / the 'model' input).
    base_uri = config.base_tokenizer or (ctx.input("model").uri if ctx.has_input("model") else None)
    if base_uri:
        base_dir = (base_tok.resolve(config.base_tokenizer, ctx.checkpoint_dir, endpoint) if config.base_tokenizer
                    else ctx.input("model").path)
        base_model, base_doc = base_tok.load(base_dir, base_uri, parse_json=config.strategy == "extend")
        if config.strategy == "extend":
            bpe.check_extendable(base_doc, base_uri)
    validation = read_validation_sets(config, endpoint)

    stream = CorpusStream(config.corpora, seed=config.seed, validation_fraction=config.validation_fraction,
                          num_validation_lines=config.num_validation_lines, max_lines=config.max_lines,
                          dedup=config.dedup, normalization=config.normalization, endpoint_url=endpoint)
    rows: list[dict] = []
    selected = trained = trained_doc = None
    t_train = time.perf_counter()
    if config.strategy == "base":
        if config.corpora:
            stream.drain_heldout()
    else:
        size = max(config.vocab_sizes)
        log.info("training one %s BPE at %d tokens (serves sizes %s)", config.strategy, size, sorted(config.vocab_sizes))
        trained = bpe.train(stream.batches(), size, config.min_frequency,
                            template=base_model if config.strategy == "extend" else None, show_progress=tty)
        if sum(s.lines_trained for s in stream.stats.values()) == 0:
            raise InputError("no training text left after holding out the validation slice"
                             + (" and dropping duplicates" if config.dedup else ""),
                             path=", ".join(s.uri for s in config.corpora))
        # smaller sizes (and extend) are cut from the trained model's JSON
        trained_doc = bpe.model_of(trained) if config.strategy == "extend" or len(config.vocab_sizes) > 1 else None
    seconds_train = time.perf_counter() - t_train
    log.info("corpus: %s", json.dumps(stream.summary()["total"]))

    sets = {HELDOUT: stream.heldout, **validation} if stream.heldout else dict(validation)
    if not sets:
        raise InputError("nothing to measure: give corpora (for a held-out slice) or validation sets",
                         path="validation")
    t_metrics = time.perf_counter()
    base_metrics = measure_sets(base_model, sets) if base_model is not None else None

    published = base_model
    if config.strategy == "base":
        base_tok.copy_folder(base_dir, ctx.model_dir)
    else:
        rows, built = sweep(config, trained, trained_doc, base_doc, sets)
        if config.selection_set not in rows[0]["sets"]:
            raise InputError(f"selection_set {config.selection_set!r} has no text to measure (empty held-out slice?)",
                             path="selection_set")
        selected = select_size(rows, config.selection, config.selection_tolerance, config.selection_set)["vocab_size"]
        if config.strategy == "replace":
            llama3.write_folder(built[selected], ctx.model_dir)
        else:  # the base's config files (special-token roles, chat template) with the extended vocab
            base_tok.copy_folder(base_dir, ctx.model_dir)
            built[selected].save(str(ctx.model_dir / "tokenizer.json"))
        published = built[selected]
    seconds_metrics = time.perf_counter() - t_metrics
    output = verify_output(ctx.model_dir, published)

    metrics = {
        "strategy": config.strategy,
        "selected_vocab_size": selected,
        "selection": {"rule": config.selection, "tolerance": config.selection_tolerance, "set": config.selection_set},
        "word_definition": "whitespace-separated (str.split); tokens without BOS/EOS; fertility = sum tokens / sum words",
        "sweep": rows,
        "base": {"uri": base_uri, "sets": base_metrics} if base_metrics is not None else None,
        "output": output,
        "corpus": stream.summary(),
        "seconds": {"train": round(seconds_train, 2), "measure_and_save": round(seconds_metrics, 2),
                    "total": round(time.perf_counter() - t_start, 2)},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    table = sweep_table(rows, base_metrics, selected)
    log.info("sweep (selected %s):\n%s", selected, table)
    (ctx.model_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (ctx.model_dir / "sweep.md").write_text(table)
    return StageResult(metrics=metrics, extra_inputs=extra_inputs)
