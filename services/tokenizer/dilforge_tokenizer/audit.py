"""Dead-token audit and pruning: a token never produced on the training corpus is an embedding row the model pays
for and never trains. Words are encoded once each with the BPE model alone (no token crosses a pre-token)."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable

from tokenizers import Tokenizer

from .bpe import merge_pair
from .continued import encoded_ids, model_only


def used_ids(encoder: Tokenizer, texts: list[str]) -> set[int]:
    return set(itertools.chain.from_iterable(encoded_ids(encoder, texts)))


def audit(
    doc: dict,
    tok: Tokenizer,
    words: Iterable[str] | None,
    new_ids: set[int],
    sets: dict[str, list[str]],
) -> tuple[dict, set[int]]:
    """The audit dict and the set of dead new ids. `words`: the training corpus's unique pre-tokenized words
    (byte-level strings, under this tokenizer's pre-tokenizer; None without a corpus); `new_ids`: the tokens
    this strategy added."""
    model = model_only(doc)
    vocab = doc["model"]["vocab"]
    specials = {t["content"] for t in doc.get("added_tokens", [])}
    regular = {t: i for t, i in vocab.items() if t not in specials}
    train_used = used_ids(model, list(words)) if words is not None else set()
    dead_new = {i for i in new_ids if i not in train_used}
    strings = list(regular)
    not_own = [regular[t] for t, ids in zip(strings, encoded_ids(model, strings), strict=True) if ids != [regular[t]]]
    usage = {"train": round(len(train_used & set(regular.values())) / max(1, len(regular)), 4)}
    for name, texts in sets.items():
        ids = used_ids(tok, texts)
        usage[name] = round(len(ids & set(regular.values())) / max(1, len(regular)), 4)
    report = {
        "num_regular_tokens": len(regular),
        "num_new_tokens": len(new_ids),
        "num_dead_new_tokens": len(dead_new),
        "dead_new_tokens_frac": round(len(dead_new) / len(new_ids), 4) if new_ids else None,
        "num_dead_tokens": sum(1 for i in regular.values() if i not in train_used),
        "num_not_from_own_string": len(not_own),
        "num_new_not_from_own_string": sum(1 for i in not_own if i in new_ids),
        "vocab_used_frac": usage,
    }
    return report, dead_new


def corpus_use(doc: dict, words: Iterable[str], first_new_id: int) -> tuple[Counter, set[int] | None]:
    """One encode of the corpus words (weighted when a Counter): (how often each id is produced, the new ids whose
    merge chain must stay). With `ignore_merges` (Llama 3) a word that is itself a token is emitted whole, so only
    tokens produced inside a longer segmentation keep their chain; None: every kept token needs its chain."""
    lookup = bool(doc["model"].get("ignore_merges"))
    vocab = doc["model"]["vocab"]
    weights = words if isinstance(words, Counter) else None
    words = list(words)
    counts: Counter = Counter()
    chained: set[int] = set()
    for word, ids in zip(words, encoded_ids(model_only(doc), words), strict=True):
        n = weights[word] if weights is not None else 1
        for i in ids:
            counts[i] += n
        if lookup and not (len(ids) == 1 and vocab.get(word) == ids[0]):  # not a whole word found by lookup
            chained.update(i for i in ids if i >= first_new_id)
    return counts, (chained if lookup else None)


def costly_tokens(
    doc: dict,
    first_new_id: int,
    counts: Counter,
    price: float,
    parts_needed: set[int] | None = None,
    num_fixed_merges: int = 0,
) -> set[int]:
    """Produced new tokens whose uses per row fall below `price` (what a refill row buys), counting as theirs the
    dead tokens only they are built from. `counts`, `parts_needed`: from `corpus_use` on `doc`."""
    vocab = doc["model"]["vocab"]
    producing: dict[str, tuple[str, str]] = {}
    for m in doc["model"]["merges"][num_fixed_merges:]:
        a, b = merge_pair(m)
        producing.setdefault(a + b, (a, b))
    dead = {i for i in vocab.values() if i >= first_new_id and not counts.get(i)}
    holders: dict[int, set[int]] = defaultdict(set)
    for token, i in vocab.items():
        if (
            i < first_new_id
            or i in dead
            or token not in producing
            or (parts_needed is not None and i not in parts_needed)
        ):
            continue
        stack = list(producing[token])
        while stack:  # down the chain through dead parts only: a produced part is paid for by its own uses
            part = stack.pop()
            j = vocab[part]
            if j in dead and i not in holders[j]:
                holders[j].add(i)
                stack.extend(producing.get(part, ()))
    exclusive = Counter(next(iter(h)) for h in holders.values() if len(h) == 1)
    return {i for i, k in exclusive.items() if counts[i] / (1 + k) < price}


def prune(
    doc: dict, first_new_id: int, dead: set[int], parts_needed: set[int] | None = None, num_fixed_merges: int = 0
) -> tuple[dict, int]:
    """`doc` without the dead tokens at or above `first_new_id` that no kept token is built from. Ids below it never
    change, kept new tokens are renumbered densely in order, a merge stays when its result and parts do; the
    first `num_fixed_merges` (the base's) are kept unread."""
    vocab: dict[str, int] = doc["model"]["vocab"]
    fixed, tail = doc["model"]["merges"][:num_fixed_merges], doc["model"]["merges"][num_fixed_merges:]
    merges = [merge_pair(m) for m in tail]
    as_strings = bool(doc["model"]["merges"]) and isinstance(doc["model"]["merges"][0], str)
    producing: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for a, b in merges:
        producing[a + b].append((a, b))
    kept = {t for t, i in vocab.items() if i >= first_new_id and i not in dead}
    # a merge producing a base token from new parts keeps those parts
    stack = [t for t in kept if parts_needed is None or vocab[t] in parts_needed]
    stack += [t for t in producing if vocab[t] < first_new_id]
    seen = set(stack)
    while stack:
        token = stack.pop()
        for a, b in producing.get(token, ()):
            for part in (a, b):
                if vocab[part] >= first_new_id and part not in kept:
                    kept.add(part)
                if part not in seen:
                    seen.add(part)
                    stack.append(part)
    removed = {t for t, i in vocab.items() if i >= first_new_id and t not in kept}
    if not removed:
        return doc, 0
    order = sorted((i, t) for t, i in vocab.items() if i >= first_new_id and t in kept)
    new_vocab = {t: i for t, i in vocab.items() if i < first_new_id}
    new_vocab.update({t: first_new_id + k for k, (_, t) in enumerate(order)})
    new_merges = [
        *fixed,
        *(
            (f"{a} {b}" if as_strings else [a, b])
            for a, b in merges
            if a not in removed and b not in removed and (a + b) not in removed
        ),
    ]
    out = {**doc, "model": {**doc["model"], "vocab": new_vocab, "merges": new_merges}}
    return out, len(removed)
