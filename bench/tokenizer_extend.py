#!/usr/bin/env python
"""Merge-compatible `extend` vs naive appending vs `replace`, on the full shared corpus, FLORES dev az + en.

All in one process, on the corpus mixture of a preset (--config; configs/az-tokenizer.yaml by default, read once):
  raw trainer   tokenizers' BpeTrainer on the raw corpus at (new tokens + 256) — the old extend's
                training, appended naively to the base (its dead tokens are measured too)
  continued     the stage's extend: pre-tokenize with the base, segment each unique word with the base's
                BPE, continue training over those segmentations (tokenizers trainer on mapped symbols)
  replace       a fresh byte-level BPE at --replace-size (optional)
Printed: hardware and date, the training time of each and the ratio continued / raw trainer, and one
row per tokenizer with tokens/word, bytes/token and words in 3+ tokens on FLORES dev az and en, and the
share of new tokens never produced on the training corpus.

    python bench/tokenizer_extend.py --base /tmp/llama32-tokenizer --sizes 32000 64000 --replace-size 50000
    python bench/tokenizer_extend.py --base SMOLLM2_DIR --sizes 8000 16000 32000  (SMOLLM2_DIR: the HF folder of `coordinator models import smollm2-135m-instruct`)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections import Counter
from pathlib import Path

import hardware  # bench/hardware.py
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # factories.bpe_from_text: tokenizers' BPE training on raw text


def corpus_lines(data: Path, config: Path, list_weight: float | None = None, recase: bool | None = None) -> Counter:
    """The preset's training lines with how often each is fed; `list_weight`/`recase` override those of its
    word_counts sources (for the sensitivity rows)."""
    from dilforge_tokenizer.config import TokenizerConfig
    from dilforge_tokenizer.stream import CorpusStream

    text = config.read_text().replace("${DILFORGE_DATA}", str(data))
    section = yaml.safe_load(text)["tokenizer"]
    for source in section.get("corpora", []):
        if source.get("format") == "word_counts":
            source.update({k: v for k, v in (("weight", list_weight), ("recase", recase)) if v is not None})
    config = TokenizerConfig(**{k: v for k, v in section.items() if k in ("corpora", "dedup", "validation_fraction")})
    stream = CorpusStream(
        config.corpora,
        seed=config.seed,
        validation_fraction=config.validation_fraction,
        dedup=config.dedup,
        progress=False,
    )
    lines = Counter(stream.lines())
    lines.update(stream.fed_words)
    return lines


def fed(lines: Counter):
    """The training lines, each as often as it was fed (weights), for a trainer on raw text."""
    return itertools.chain.from_iterable(itertools.repeat(line, n) for line, n in lines.items())


def naive_extend(base: dict, corpus: dict) -> tuple[dict, int]:
    """The baseline (the stage's `extend` before continued BPE): append a raw corpus BPE's tokens missing from
    `base`; returns (doc, added). New tokens take ids after the base's highest id (special tokens included), in
    the order the corpus BPE learned them; the merges that create them are appended after the base's merges, so
    every base id keeps its meaning. Tokens whose merges the base's own merges pre-empt are never produced: the
    dead tokens the bench measures and continued BPE avoids."""
    from dilforge_tokenizer import bpe

    doc, vocab, merges, as_strings = bpe.editable_copy(base)
    next_id = max(vocab.values()) + 1
    new_tokens = set()
    for token, _ in sorted(corpus["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = next_id
            new_tokens.add(token)
            next_id += 1
    existing = {bpe.merge_pair(m) for m in merges}
    for merge in corpus["model"]["merges"]:
        a, b = bpe.merge_pair(merge)
        if a + b in new_tokens and (a, b) not in existing:
            merges.append(f"{a} {b}" if as_strings else [a, b])
            existing.add((a, b))
    return doc, len(new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", REPO.parent / "shared/data")))
    parser.add_argument("--base", type=Path, required=True, help="HF tokenizer folder (Llama 3.2, SmolLM2, ...)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32000, 64000], help="new tokens for extend")
    parser.add_argument("--replace-size", type=int, default=0, help="also train replace at this size (0: no)")
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument(
        "--config",
        type=Path,
        default=REPO / "configs/az-tokenizer.yaml",
        help="preset whose tokenizer corpora (mixture, dedup) are read",
    )
    parser.add_argument(
        "--word-list-weight", type=float, default=None, help="override the weight of the preset's word_counts sources"
    )
    parser.add_argument(
        "--no-recase",
        dest="recase",
        action="store_const",
        const=False,
        default=None,
        help="feed the preset's word_counts sources as listed (recase off)",
    )
    args = parser.parse_args()

    from dilforge_shared.corpus import iter_texts
    from dilforge_shared.families import LLAMA3, detect_family
    from dilforge_tokenizer import audit, bpe, continued, family_out, pretokens
    from dilforge_tokenizer import base as base_tok
    from dilforge_tokenizer import candidates as stage
    from dilforge_tokenizer.base import Base
    from dilforge_tokenizer.report import measure_sets
    from factories import bpe_from_text

    flores = str(args.data / "az/dev/flores200.dev.partial_from_sib200.tsv")
    sets = {
        "az": list(iter_texts(flores, text_field="azj_Latn")),
        "en": list(iter_texts(flores, text_field="eng_Latn")),
    }
    tok, doc = base_tok.load(args.base, str(args.base))
    family = detect_family(base_tok.vocab_tokens(doc), str(args.base))
    first_new = max([*doc["model"]["vocab"].values(), *(t["id"] for t in doc.get("added_tokens", []))]) + 1
    print(
        f"# extend bench: base {args.base} ({family.name}, {first_new} ids)\n{hardware.describe('tokenizers')}\n"
        f"corpus: the mixture of {args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config} over {args.data}; sets: FLORES dev (510) az, en; "
        f"min_frequency {args.min_frequency}; word-list overrides: weight {args.word_list_weight}, recase {args.recase}; load average at start {os.getloadavg()}\n"
    )

    t0 = time.perf_counter()
    lines = corpus_lines(args.data, args.config, args.word_list_weight, args.recase)
    read_s = time.perf_counter() - t0
    largest = max(args.sizes)

    t0 = time.perf_counter()
    raw = bpe_from_text(fed(lines), largest + 256, args.min_frequency, template=tok)
    raw_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    words = pretokens.of_lines(lines, tok)
    words_s = time.perf_counter() - t0
    seg = continued.segment(words, doc)
    segment_s = time.perf_counter() - t0 - words_s
    learned = continued.learn_merges(seg, largest, args.min_frequency)
    cont_s = time.perf_counter() - t0

    rows = [("base", tok, doc, set())]
    naive_doc, added = naive_extend(doc, bpe.truncate(bpe.model_of(raw), min(args.sizes) + 256))
    rows.append(
        (
            f"extend, naive (raw BPE {min(args.sizes) + 256})",
            bpe.from_doc(naive_doc),
            naive_doc,
            set(range(first_new, first_new + added)),
        )
    )
    refill_s: dict[int, float] = {}
    base = Base(folder=args.base, uri=str(args.base), tok=tok, doc=doc, family=family)
    for size in sorted(args.sizes):
        ext, added = continued.extend_doc(doc, learned, size)
        new_ids = set(range(first_new, first_new + added))
        rows.append((f"extend, continued {size}", bpe.from_doc(ext), ext, new_ids))
        cand = stage.Candidate("extend", size, rows[-1][1], ext, new_ids, first_new, family, learned=learned)
        _, cand.dead = audit.audit(ext, cand.tok, words, new_ids, {})
        if cand.dead:  # what prune_dead publishes: dead new tokens dropped, further merges in their place
            t0 = time.perf_counter()
            pruned, _ = stage.prune_and_refill(cand, base, words)
            refill_s[size] = time.perf_counter() - t0
            n = len(pruned["model"]["vocab"]) - first_new
            rows.append(
                (
                    f"extend, continued {size}, dead pruned + refilled",
                    bpe.from_doc(pruned),
                    pruned,
                    set(range(first_new, first_new + n)),
                )
            )
    replace_s = None
    if args.replace_size:
        t0 = time.perf_counter()
        trained = bpe_from_text(fed(lines), args.replace_size, args.min_frequency)
        replace_s = time.perf_counter() - t0
        rdoc = bpe.model_of(trained)
        rwords = words if rdoc["pre_tokenizer"] == doc["pre_tokenizer"] else pretokens.of_lines(lines, trained)
        rows.append(
            (
                f"replace {args.replace_size}",
                family_out.finish(trained, family if family else LLAMA3, doc),
                rdoc,
                {i for t, i in rdoc["model"]["vocab"].items() if len(t) > 1},
            )
        )

    print(
        f"corpus read {read_s:.1f} s ({len(lines):,} unique lines, {sum(lines.values()):,} fed); "
        f"{len(words):,} unique words\n"
    )
    print("| training | seconds | ratio to raw trainer |\n|---|---:|---:|")
    print(f"| raw trainer (tokenizers BpeTrainer, {largest + 256} on raw text) | {raw_s:.1f} | 1.00 |")
    print(
        f"| continued extend, {largest} new (pre-tokenize {words_s:.1f} + segment {segment_s:.1f} + "
        f"train {cont_s - words_s - segment_s:.1f}) | {cont_s:.1f} | {cont_s / raw_s:.2f} |"
    )
    for size, sec in refill_s.items():
        print(
            f"| prune_dead at {size} new (audit, prune, refill with further merges; after training) | {sec:.1f} | "
            f"{sec / raw_s:.2f} |"
        )
    if replace_s is not None:
        print(f"| replace {args.replace_size} (raw trainer) | {replace_s:.1f} | {replace_s / raw_s:.2f} |")
    print(
        "\n| tokenizer | vocab | new tokens | dead new | az tokens/word | az bytes/token | az words 3+ | "
        "en tokens/word | en bytes/token | en words 3+ |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, t, d, new_ids in rows:
        w = rwords if name.startswith("replace") else words
        report, _ = audit.audit(d, t, w, new_ids, {})
        s = measure_sets(t, sets)
        dead = "-" if report["dead_new_tokens_frac"] is None else f"{100 * report['dead_new_tokens_frac']:.2f}%"
        print(
            f"| {name} | {t.get_vocab_size(with_added_tokens=True):,} | {len(new_ids):,} | {dead} | "
            + " | ".join(
                f"{s[k]['tokens_per_word']:.4f} | {s[k]['bytes_per_token']:.3f} | "
                f"{100 * s[k]['share_words_3plus']:.1f}%"
                for k in ("az", "en")
            )
            + " |",
            flush=True,
        )
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
