"""Continued BPE (merge-compatible extend), the dead-token audit and pruning, on hand-made corpora."""

from __future__ import annotations

import json
from collections import Counter

from dilforge_tokenizer import audit, bpe, continued, llama3, pretokens
from factories import bpe_from_text, load_bench
from tokenizers import Tokenizer, models, pre_tokenizers

# "abc" 10x and "dbc" 5x: a raw BPE learns "bc" first (15) and then "abc" from (a, bc); but the base
# merges (a, b) first, so appended naively, (a, bc) never applies and "abc" is never produced.
LINES = Counter({"abc": 10, "dbc": 5})


def base_doc() -> dict:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["ab"] = len(vocab)
    tok = llama3.empty_bpe()
    tok.model = models.BPE(vocab=vocab, merges=[("a", "b")])
    return json.loads(tok.to_str())


def encode_words(doc: dict, words) -> list[list[str]]:
    model = continued.model_only(doc)
    return [enc.tokens for enc in model.encode_batch(list(words), add_special_tokens=False)]


def test_naive_appending_leaves_a_token_dead_and_continued_bpe_does_not():
    doc = base_doc()
    base = bpe.from_doc(doc)
    words = pretokens.of_lines(LINES, base)
    first_new = len(doc["model"]["vocab"])

    raw = bpe_from_text([[line] * n for line, n in LINES.items()], first_new + 3, 2, template=base)
    naive, added = load_bench("tokenizer_extend").naive_extend(doc, bpe.model_of(raw))  # the bench's baseline
    assert "abc" in naive["model"]["vocab"] and added >= 2
    report, dead = audit.audit(naive, bpe.from_doc(naive), words, set(range(first_new, first_new + added)), {})
    assert naive["model"]["vocab"]["abc"] in dead and report["num_dead_new_tokens"] >= 1

    learned = continued.learn_merges(continued.segment(words, doc), 2, 2)
    ext, added = continued.extend_doc(doc, learned, 2)
    assert added == 2 and ext["model"]["vocab"]["abc"] == first_new  # (ab, c): the most frequent pair over [ab, c]
    report, dead = audit.audit(ext, bpe.from_doc(ext), words, {first_new, first_new + 1}, {})
    assert dead == set() and report["dead_new_tokens_frac"] == 0.0
    assert encode_words(ext, ["abc", "dbc"])[0] == ["abc"]


def test_extend_keeps_base_ids_and_merges_in_place_and_smaller_sizes_are_prefixes():
    doc = base_doc()
    words = pretokens.of_lines(Counter({"abc abd abe": 3, "dbc dbd xyzw xyzw": 4}), bpe.from_doc(doc))
    learned = continued.learn_merges(continued.segment(words, doc), 50, 1)
    big, n_big = continued.extend_doc(doc, learned, 50)
    small, n_small = continued.extend_doc(doc, learned, 3)
    assert n_small == 3 and n_big > 3
    for out in (small, big):
        assert all(out["model"]["vocab"][t] == i for t, i in doc["model"]["vocab"].items())
        assert out["model"]["merges"][: len(doc["model"]["merges"])] == doc["model"]["merges"]
    assert big["model"]["merges"][: len(small["model"]["merges"])] == small["model"]["merges"]
    tok = bpe.from_doc(big)
    for text in ("abc abd abe", "dbc xyzw", "Azərbaycan dili"):
        assert tok.decode(tok.encode(text).ids) == text


def test_prune_drops_dead_leaves_keeps_base_ids_and_renumbers_densely():
    doc = base_doc()
    vocab = dict(doc["model"]["vocab"])
    first = len(vocab)
    for k, token in enumerate(["abc", "dd", "ddd", "xy"]):
        vocab[token] = first + k
    merges = [*doc["model"]["merges"], ["ab", "c"], ["d", "d"], ["dd", "d"], ["x", "y"]]
    ext = {**doc, "model": {**doc["model"], "vocab": vocab, "merges": merges}}
    # "dd" is dead but "ddd" (kept) is built from it; "xy" is dead and nothing uses it
    pruned, n = audit.prune(ext, first, {first + 1, first + 3})
    assert n == 1 and "xy" not in pruned["model"]["vocab"] and ["x", "y"] not in pruned["model"]["merges"]
    assert [pruned["model"]["vocab"][t] for t in ("abc", "dd", "ddd")] == [first, first + 1, first + 2]
    assert all(pruned["model"]["vocab"][t] == i for t, i in doc["model"]["vocab"].items())
    tok = bpe.from_doc(pruned)
    assert tok.encode("ddd abc", add_special_tokens=False).tokens[0] == "ddd"


def test_audit_counts_tokens_not_produced_from_their_own_string():
    doc = base_doc()
    vocab = dict(doc["model"]["vocab"])
    vocab["bc"] = len(vocab)  # no merge makes it: "bc" encodes to [b, c]
    odd = {**doc, "model": {**doc["model"], "vocab": vocab, "ignore_merges": False}}
    report, dead = audit.audit(
        odd, Tokenizer.from_str(json.dumps(odd)), ["abc", "bc"], {vocab["bc"]}, {"az": ["abc bc"]}
    )
    assert report["num_new_not_from_own_string"] == 1 and dead == {vocab["bc"]}
    assert 0 < report["vocab_used_frac"]["az"] < 0.05


def with_tokens(doc: dict, tokens: list[str], merges: list[list[str]], ignore_merges: bool) -> tuple[dict, int]:
    vocab = dict(doc["model"]["vocab"])
    first = len(vocab)
    for k, token in enumerate(tokens):
        vocab[token] = first + k
    model = {
        **doc["model"],
        "vocab": vocab,
        "merges": [*doc["model"]["merges"], *merges],
        "ignore_merges": ignore_merges,
    }
    return {**doc, "model": model}, first


def test_prune_with_ignore_merges_drops_intermediates_of_whole_word_tokens_only():
    # "abcd" (a word of its own) is built through "abc", which nothing else produces: dead. "xyz" is
    # produced inside "xyzq" (x y z q → [xyz, q]), so its intermediate "xy" must stay.
    doc = base_doc()
    words = ["abcd", "xyzq"]
    for ignore in (True, False):
        ext, first = with_tokens(
            doc, ["abc", "abcd", "xy", "xyz"], [["ab", "c"], ["abc", "d"], ["x", "y"], ["xy", "z"]], ignore
        )
        before = encode_words(ext, words)
        assert before == [["abcd"], ["xyz", "q"]]
        _, dead = audit.audit(ext, bpe.from_doc(ext), words, set(range(first, first + 4)), {})
        assert dead == {first, first + 2}  # abc, xy
        used, parts_needed = audit.corpus_use(ext, words, first)
        assert {first, first + 2}.isdisjoint(used) and {first + 1, first + 3} <= used.keys()
        pruned, n = audit.prune(ext, first, dead, parts_needed)
        # the base's own merges can be skipped unread: the same result
        assert audit.prune(ext, first, dead, parts_needed, num_fixed_merges=len(doc["model"]["merges"])) == (pruned, n)
        vocab = pruned["model"]["vocab"]
        assert encode_words(pruned, words) == before  # the corpus encodes exactly as before
        assert "xy" in vocab and ["x", "y"] in pruned["model"]["merges"]
        if ignore:
            assert (
                n == 1
                and "abc" not in vocab
                and [vocab["abcd"], vocab["xy"], vocab["xyz"]] == [first, first + 1, first + 2]
            )
            assert ["abc", "d"] not in pruned["model"]["merges"]  # "abcd" is reached by lookup, not by merges
            assert bpe.from_doc(pruned).encode("abcd", add_special_tokens=False).tokens == ["abcd"]
        else:  # without the lookup, "abcd" needs "abc": nothing can go
            assert n == 0 and "abc" in vocab


def test_costly_tokens_alone_hold_dead_rows_and_have_few_uses_per_row():
    # "abc" is dead and only "abcd" is built from it; "xy" is dead and only "xyz" is built from it. "abcd" is
    # used once (1 use over 2 rows), "xyz" ten times (5 uses per row): at a price of 3 only "abcd" is costly.
    doc = base_doc()
    ext, first = with_tokens(
        doc, ["abc", "abcd", "xy", "xyz"], [["ab", "c"], ["abc", "d"], ["x", "y"], ["xy", "z"]], ignore_merges=False
    )
    words = Counter({"abcd": 1, "xyzq": 10})
    counts, parts_needed = audit.corpus_use(ext, words, first)
    assert (counts[first + 1], counts[first + 3]) == (1, 10) and first not in counts and first + 2 not in counts
    num_fixed = len(doc["model"]["merges"])
    costly = audit.costly_tokens(ext, first, counts, 3.0, parts_needed, num_fixed)
    assert costly == {first + 1}
    assert audit.costly_tokens(ext, first, counts, 0.5, parts_needed, num_fixed) == set()
    dead = {first, first + 2}
    pruned, n = audit.prune(ext, first, dead | costly, parts_needed, num_fixed)
    assert n == 2 and set(pruned["model"]["vocab"]) - set(doc["model"]["vocab"]) == {"xy", "xyz"}
    # a shared dead part is nobody's alone: "abc" also builds "abce", so neither holder is costly
    ext2, first2 = with_tokens(doc, ["abc", "abcd", "abce"], [["ab", "c"], ["abc", "d"], ["abc", "e"]], False)
    counts2, parts2 = audit.corpus_use(ext2, Counter({"abcd": 1, "abce": 1}), first2)
    assert audit.costly_tokens(ext2, first2, counts2, 100.0, parts2, num_fixed) == set()


def test_extend_doc_skips_excluded_tokens_and_what_is_built_on_them():
    doc = base_doc()
    base_id = {t: i for t, i in doc["model"]["vocab"].items()}
    learned = [
        ([base_id["ab"]], [base_id["c"]]),
        ([base_id["ab"], base_id["c"]], [base_id["d"]]),
        ([base_id["x"]], [base_id["y"]]),
    ]
    ext, added = continued.extend_doc(doc, learned, 3, exclude={"abc"})
    assert added == 1 and set(ext["model"]["vocab"]) - set(doc["model"]["vocab"]) == {"xy"}
    ext, added = continued.extend_doc(doc, learned, 3)
    assert added == 3 and {"abc", "abcd", "xy"} <= set(ext["model"]["vocab"])


def test_digit_barrier_learns_no_digit_token_and_numbers_encode_as_in_the_base():
    """digit_tokens: as_base. Without the barrier the same corpus learns digit groups (the test can fail)."""
    doc = base_doc()
    lines = Counter({"abc 19 1919 2015 abd": 20, "19 20 2015 x19 dbc": 15})
    words = pretokens.of_lines(lines, bpe.from_doc(doc))
    seg = continued.segment(words, doc)
    barrier = continued.digit_ids(doc)
    assert {doc["model"]["vocab"][d] for d in "0123456789"} <= barrier and doc["model"]["vocab"]["a"] not in barrier

    learned_free = continued.learn_merges(seg, 30, 2)
    free, _ = continued.extend_doc(doc, learned_free, 30)
    assert any(any(ch.isdigit() for ch in t) for t in free["model"]["vocab"] if t not in doc["model"]["vocab"])

    learned = continued.learn_merges(seg, 30, 2, barrier=barrier)
    ext, added = continued.extend_doc(doc, learned, 30)
    new = [t for t in ext["model"]["vocab"] if t not in doc["model"]["vocab"]]
    assert added == len(new) > 0 and not any(ch.isdigit() for t in new for ch in t)
    assert "abc" in new or "bc" in new  # letters still merge
    numbers = ["19", "1919", "2015", "20"]
    assert encode_words(ext, numbers) == encode_words(doc, numbers)
    assert encode_words(free, numbers) != encode_words(doc, numbers)
