"""Fertility, bytes per token and the 3+ split share, on hand-checked strings."""

from __future__ import annotations

import itertools
import math

import pytest
from dilforge_shared.fertility import measure, tokenizers_encoder, tokens_per_word_span
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def fixed(offsets_by_text: dict[str, list[tuple[int, int]]]):
    return lambda texts: [offsets_by_text[t] for t in texts]


def test_fertility_with_hand_made_offsets():
    # "Salam dünya": Sa|lam  dü|n|ya  -> 5 tokens, 2 words; "dünya" is split 3 ways; 12 UTF-8 bytes (ü = 2)
    text = "Salam dünya"
    offsets = [(0, 2), (2, 5), (6, 8), (8, 9), (9, 11)]
    stats = measure([text], fixed({text: offsets}))
    assert (stats.num_words, stats.num_tokens, stats.num_bytes, stats.num_words_3plus) == (2, 5, 12, 1)
    assert stats.tokens_per_word == 2.5
    assert stats.bytes_per_token == 12 / 5
    assert stats.share_words_3plus == 0.5


def test_ratio_of_sums_not_mean_of_ratios():
    a, b = "bir", "iki üç dörd beş"
    enc = fixed({a: [(0, 1), (1, 2), (2, 3)], b: [(0, 3), (4, 6), (7, 11), (12, 15)]})
    stats = measure([a, b], enc, batch_size=1)
    assert stats.tokens_per_word == 7 / 5  # the mean of per-text ratios would be (3 + 1) / 2 = 2
    assert stats.num_texts == 2 and stats.num_words_3plus == 1


def test_whitespace_tokens_count_as_tokens_but_for_no_word():
    text = "ev  \nqapı"
    # 'ev', '  \n' (whitespace only), 'qa', 'pı'
    assert tokens_per_word_span(text, [(0, 2), (2, 5), (5, 7), (7, 9)]) == [1, 2]
    stats = measure([text], fixed({text: [(0, 2), (2, 5), (5, 7), (7, 9)]}))
    assert stats.num_tokens == 4 and stats.num_words == 2 and stats.tokens_per_word == 2.0


def test_token_with_leading_space_counts_for_its_word_only():
    # Llama-style " dünya" token spans the space before the word
    assert tokens_per_word_span("Salam dünya", [(0, 5), (5, 11)]) == [1, 1]


def test_byte_level_tokenizer_without_merges_gives_one_token_per_byte():
    """A real byte-level tokenizer with no merges: tokens == UTF-8 bytes, so every figure is known."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["Salam dünya", "Bakı şəhəri"]
    stats = measure(texts, tokenizers_encoder(tok))
    nbytes = sum(len(t.encode()) for t in texts)  # 12 + 15 (ü ı ş ə ə take 2 bytes each)
    assert stats.num_tokens == nbytes == 27
    assert stats.num_words == 4
    assert stats.tokens_per_word == 27 / 4
    assert stats.bytes_per_token == 1.0
    assert stats.share_words_3plus == 1.0


def test_ratios_are_rounded_and_nan_on_an_empty_set():
    text = "bir iki üç"
    stats = measure([text], fixed({text: [(0, 1), (1, 3), (4, 7), (8, 10)]}))
    assert stats.tokens_per_word == 1.3333 and stats.num_words == 3
    assert math.isnan(measure([], fixed({})).tokens_per_word)


@pytest.mark.parametrize("text,expected", [("  ", []), ("a", [1]), ("a b", [1, 1])])
def test_word_counts_edge_cases(text, expected):
    offsets = [(i, i + 1) for i, ch in enumerate(text) if not ch.isspace()]
    assert tokens_per_word_span(text, offsets) == expected


def test_bisect_counts_match_a_naive_overlap_count():
    import random

    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("ab ə\n") for _ in range(rng.randint(0, 30)))
        cuts = sorted(set(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12)))))
        offsets = list(itertools.pairwise(cuts))
        naive = [
            sum(1 for s, e in offsets if s < we and e > ws)
            for ws, we in [(m.start(), m.end()) for m in __import__("re").finditer(r"\S+", text)]
        ]
        assert tokens_per_word_span(text, offsets) == naive
