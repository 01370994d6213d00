"""Merge-compatible extension: continue the base tokenizer's BPE training on the new corpus.

The base's merges fire first at encode time, so new merges are learned over the base's segmentation: each base id
of each unique word becomes one private character, and the Rust BPE trainer learns merges over those strings."""

from __future__ import annotations

import json
import logging
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from .bpe import editable_copy, merge_pair, repeated

log = logging.getLogger("dilforge.tokenizer")

CODE_OFFSET = 0x10000  # above the BMP: no whitespace, no surrogates; 0x10000 + any vocab id < 0x110000


def model_only(doc: dict) -> Tokenizer:
    """The base's BPE model alone: encodes one already pre-tokenized, byte-level word per input string."""
    bare = dict.fromkeys(("truncation", "padding", "normalizer", "pre_tokenizer", "post_processor", "decoder"))
    bare.update(version=doc.get("version", "1.0"), added_tokens=[], model=doc["model"])
    return Tokenizer.from_str(json.dumps(bare, ensure_ascii=False))


@dataclass
class Segmented:
    """Unique corpus words, their counts and the base model's segmentation of each (ids)."""

    words: list[str]
    counts: list[int]
    ids: list[array]  # of unsigned ints


def encoded_ids(encoder: Tokenizer, texts: list[str], chunk: int = 16_384) -> Iterator[list[int]]:
    """The ids of each text, `chunk` texts at a time (an Encoding object per text is large)."""
    for start in range(0, len(texts), chunk):
        for enc in encoder.encode_batch(texts[start : start + chunk], add_special_tokens=False):
            yield enc.ids


def segment(words: Counter, doc: dict) -> Segmented:
    """Each unique word's segmentation by the base's BPE model, as compact arrays of ids."""
    unique = list(words)
    ids = [array("I", i) for i in encoded_ids(model_only(doc), unique)]
    return Segmented(words=unique, counts=[words[w] for w in unique], ids=ids)


def digit_ids(doc: dict) -> frozenset[int]:
    """The base ids whose token contains a digit (byte-level strings keep ASCII digits as they are)."""
    return frozenset(i for t, i in doc["model"]["vocab"].items() if any(ch.isdigit() for ch in t))


def _training_text(seg: Segmented, barrier: frozenset[int] = frozenset()) -> Iterator[str]:
    """Each word as a string of one private character per base token, repeated by its count, spaces between.
    A `barrier` id becomes a space: no learned merge has it as a part, nor joins the tokens on its two sides."""
    return repeated(
        ("".join(" " if i in barrier else chr(CODE_OFFSET + i) for i in ids), count)
        for ids, count in zip(seg.ids, seg.counts, strict=True)
        if ids
    )


def learn_merges(
    seg: Segmented,
    num_new: int,
    min_frequency: int,
    slack: float = 0.15,
    show_progress: bool = False,
    barrier: frozenset[int] = frozenset(),
) -> list[tuple[list[int], list[int]]]:
    """The continued merges, in order, as pairs of base-id sequences (each side: the base tokens it spans).
    No merge involves a `barrier` id (`digit_ids` for `digit_tokens: as_base`)."""
    alphabet = {i for ids in seg.ids for i in ids if i not in barrier}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    target = len(alphabet) + int(num_new * (1 + slack)) + 100
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=min_frequency,
        special_tokens=[],
        show_progress=show_progress,
        limit_alphabet=len(alphabet) + 1,
    )
    tok.train_from_iterator(_training_text(seg, barrier=barrier), trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple([ord(c) - CODE_OFFSET for c in part] for part in merge_pair(m)) for m in merges]


def extend_doc(
    base: dict,
    learned: list[tuple[list[int], list[int]]],
    num_new: int,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> tuple[dict, int]:
    """(`base` with the learned merges appended until `num_new` new tokens exist, how many were added). Base ids
    and merges keep their place, new ids follow the highest; a merge the base has is skipped, and so is one
    whose result is in `exclude` (tokens pruning dropped)."""
    doc, vocab, merges, as_strings = editable_copy(base)
    id_to_token = {i: t for t, i in base["model"]["vocab"].items()}
    existing = {merge_pair(m) for m in merges}
    next_id = max(vocab.values()) + 1
    added = 0
    for left_ids, right_ids in learned:
        if added >= num_new:
            break
        left = "".join(id_to_token[i] for i in left_ids)
        right = "".join(id_to_token[i] for i in right_ids)
        if (left, right) in existing or left not in vocab or right not in vocab:
            continue
        merged = left + right
        if merged in exclude:
            continue
        if merged not in vocab:
            vocab[merged] = next_id
            next_id += 1
            added += 1
        merges.append(f"{left} {right}" if as_strings else [left, right])
        existing.add((left, right))
    return doc, added
