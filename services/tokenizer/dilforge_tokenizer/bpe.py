"""BPE building blocks: one training at the largest size, exact truncation to smaller sizes, an editable copy.

BPE training is greedy and deterministic: the vocabulary trained at size N is the first N tokens (and their
merges) of one trained at any larger size, so a sweep trains once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from . import llama3


def trainer(vocab_size: int, min_frequency: int, show_progress: bool = False) -> trainers.BpeTrainer:
    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )


def train_from_counts(words: Counter, vocab_size: int, min_frequency: int, show_progress: bool = False) -> Tokenizer:
    """What tokenizers' BPE training with Llama 3's pre-tokenizer learns from a corpus whose pre-tokens are `words`:
    a byte-level pre-token holds no whitespace, so the trainer's whitespace split of their repetition counts exactly
    these pre-tokens."""
    counter = Tokenizer(models.BPE())
    counter.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    counter.train_from_iterator(repeated(words.items()), trainer=trainer(vocab_size, min_frequency, show_progress))
    learned = model_of(counter)["model"]
    doc = model_of(llama3.empty_bpe())
    doc["model"]["vocab"], doc["model"]["merges"] = learned["vocab"], learned["merges"]
    return from_doc(doc)


def repeated(items: Iterable[tuple[str, int]], batch_chars: int = 1 << 16) -> Iterator[str]:
    """Each (pre-token, count) as the pre-token `count` times with spaces between, in strings of about
    `batch_chars` characters at most: the trainer holds each string's alignments (16 bytes per byte) while it
    splits it."""
    out: list[str] = []
    size = 0
    for word, count in items:
        if count <= 0 or not word:
            continue
        unit = word + " "
        while count > 0:
            n = min(count, max(1, (batch_chars - size) // len(unit)))
            out.append(unit * n)
            size += n * len(unit)
            count -= n
            if size + len(unit) > batch_chars:
                yield "".join(out)
                out, size = [], 0
    if out:
        yield "".join(out)


def model_of(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


def merge_pair(merge) -> tuple[str, str]:
    if isinstance(merge, str):  # older tokenizer.json: "a b"
        a, b = merge.split(" ", 1)
        return a, b
    return merge[0], merge[1]


def truncate(doc: dict, size: int) -> dict:
    """The tokenizer.json that training at `size` would have produced, cut from a larger training: the merges
    up to the one that creates id size-1."""
    vocab = doc["model"]["vocab"]
    if len(vocab) <= size:
        return doc
    doc = {**doc, "model": dict(doc["model"])}  # shallow: vocab and merges are rebuilt below
    model = doc["model"]
    merges = []
    for merge in model["merges"]:
        a, b = merge_pair(merge)
        rid = vocab[a + b]
        if rid >= size:
            break
        merges.append(merge)
        if rid == size - 1:
            break
    model["vocab"] = {t: i for t, i in vocab.items() if i < size}
    model["merges"] = merges
    return doc


def from_doc(doc: dict) -> Tokenizer:
    return Tokenizer.from_str(json.dumps(doc, ensure_ascii=False))


def editable_copy(base: dict) -> tuple[dict, dict[str, int], list, bool]:
    """(doc, vocab, merges, merges_are_strings): a copy of `base` whose vocab and merges can be appended to. The
    vocab takes in the added tokens: tokenizers would otherwise renumber them after the vocab on load."""
    doc = {**base, "model": dict(base["model"])}  # shallow copies: the base doc stays untouched
    vocab: dict[str, int] = dict(doc["model"]["vocab"])
    merges: list = list(doc["model"]["merges"])
    doc["model"]["vocab"], doc["model"]["merges"] = vocab, merges
    for added_token in doc.get("added_tokens", []):
        vocab.setdefault(added_token["content"], added_token["id"])
    return doc, vocab, merges, bool(merges) and isinstance(merges[0], str)
