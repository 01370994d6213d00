"""BPE building blocks: exact truncation, size selection, config rules (extension: test_tokenizer_continued.py)."""

from __future__ import annotations

import factories
import pytest
from dilforge_shared.families import LLAMA3
from dilforge_tokenizer import base as base_tok
from dilforge_tokenizer import bpe, family_out
from dilforge_tokenizer.config import TokenizerConfig
from dilforge_tokenizer.report import select
from pydantic import ValidationError


@pytest.fixture(scope="module")
def wiki(data_root) -> list[str]:
    return factories.wiki_lines(3000)


def test_truncating_a_larger_training_equals_training_at_that_size(wiki):
    big = bpe.model_of(factories.bpe_from_text([wiki], 900, 2))
    small = bpe.model_of(factories.bpe_from_text([wiki], 600, 2))
    cut = bpe.truncate(big, 600)
    assert cut["model"]["vocab"] == small["model"]["vocab"]
    assert cut["model"]["merges"] == small["model"]["merges"]
    assert len(big["model"]["vocab"]) == 900  # the original is left whole


def replaced(wiki, trained_size: int, size: int):
    """What the stage's `replace` strategy builds for a Llama 3 base: a truncated BPE finished in its family."""
    return family_out.finish(
        bpe.from_doc(bpe.truncate(bpe.model_of(factories.bpe_from_text([wiki], trained_size, 2)), size)), LLAMA3
    )


def test_replace_tokenizer_puts_llama3_specials_after_the_regular_vocab(wiki):
    tok = replaced(wiki, 700, 600)
    assert tok.get_vocab_size(with_added_tokens=False) == 600
    assert tok.token_to_id(LLAMA3.bos) == 600 and tok.token_to_id(LLAMA3.eot) == 609
    assert tok.encode("Salam").ids[0] == 600  # BOS prepended


def test_extend_refuses_a_non_byte_level_base(tmp_path):
    from dilforge_shared.errors import InputError

    with pytest.raises(InputError, match="byte-level"):
        base_tok.check_extendable({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Metaspace"}}, "base/")
    with pytest.raises(InputError, match="model type 'Unigram'"):
        base_tok.check_extendable({"model": {"type": "Unigram"}}, "base/")
    with pytest.raises(InputError, match="has none"):
        base_tok.check_extendable(
            {"model": {"type": "BPE", "merges": []}, "pre_tokenizer": {"type": "ByteLevel"}}, "base/"
        )


def rows(*pairs):
    return [
        {"vocab_size": v, "sets": {"heldout": {"tokens_per_word": f}, "en": {"tokens_per_word": e}}}
        for v, f, e in pairs
    ]


def select_size(sweep, rule, tolerance, set_name):
    return select(sweep, rule, tolerance, set_name)[0]


def test_selection_rules():
    sweep = rows((8000, 2.0, 1.2), (16000, 1.60, 1.2), (32000, 1.58, 1.3), (50000, 1.55, 1.4))
    assert select_size(sweep, "largest", 0.02, "heldout")["vocab_size"] == 50000
    # best 1.55; 1.58 <= 1.55 * 1.02 = 1.581 -> 32000 is the smallest within 2 %
    assert select_size(sweep, "smallest_within_tolerance", 0.02, "heldout")["vocab_size"] == 32000
    assert select_size(sweep, "smallest_within_tolerance", 0.0, "heldout")["vocab_size"] == 50000
    assert select_size(sweep, "smallest_within_tolerance", 0.5, "heldout")["vocab_size"] == 8000


def test_selection_keeps_the_retained_language_within_its_bound():
    sweep = rows((8000, 2.0, 1.2), (16000, 1.60, 1.2), (32000, 1.58, 1.3), (50000, 1.55, 1.4))
    base = {"en": {"tokens_per_word": 1.25}}
    # en bound 1.25 * 1.05 = 1.3125: 50000 is out, so the best eligible is 1.58 (32000), 16000 within 2 %
    row, met = select(sweep, "smallest_within_tolerance", 0.02, "heldout", "en", 0.05, base)
    assert (row["vocab_size"], met) == (16000, True)
    assert select(sweep, "largest", 0.02, "heldout", "en", 0.05, base) == (sweep[2], True)
    row, met = select(sweep, "largest", 0.02, "heldout", "en", 0.0, {"en": {"tokens_per_word": 1.0}})
    assert (row["vocab_size"], met) == (8000, False)  # none passes: the closest to the bound, flagged


CORPUS = [{"uri": "/data/az.txt"}]


def test_config_rejects_vocab_below_alphabet_plus_specials():
    with pytest.raises(ValidationError, match=r"vocab_sizes\n.*500 is not above the byte alphabet \+ special tokens"):
        TokenizerConfig(strategy="replace", corpora=CORPUS, vocab_sizes=[500])
    with pytest.raises(ValidationError, match="vocab_sizes\n.*500 is not above the byte alphabet"):
        TokenizerConfig(
            strategy="extend", compare_with=["replace"], base_tokenizer="/b", corpora=CORPUS, vocab_sizes=[500]
        )
    with pytest.raises(ValidationError, match="num_new_tokens\n.*0 must be positive"):
        TokenizerConfig(strategy="extend", base_tokenizer="/b", corpora=CORPUS, num_new_tokens=[0])


def test_config_rejects_unknown_field_and_bad_selection_set():
    with pytest.raises(ValidationError, match="vocab_size\n.*Extra inputs are not permitted"):
        TokenizerConfig(corpora=CORPUS, vocab_size=1000)
    with pytest.raises(ValidationError, match="selection_set\n.*'flores' is not one of"):
        TokenizerConfig(corpora=CORPUS, selection_set="flores")
    ok = TokenizerConfig(
        corpora=CORPUS,
        selection_set="flores",
        validation=[{"uri": "/d.tsv", "text_field": "azj_Latn", "name": "flores"}],
    )
    assert ok.selection_set == "flores"
    # extend without base_tokenizer takes the pipeline's `model` artifact (PipelineConfig checks one exists)
    assert TokenizerConfig(strategy="extend", corpora=CORPUS).needed_inputs() == ("model",)
    assert TokenizerConfig(strategy="extend", corpora=CORPUS, base_tokenizer="/t").needed_inputs() == ()
    with pytest.raises(ValidationError, match="retain_set 'en' is not a validation set name"):
        TokenizerConfig(corpora=CORPUS, retain_set="en")
    with pytest.raises(ValidationError, match="corpora: at least one corpus is needed with strategy 'replace'"):
        TokenizerConfig(strategy="base", base_tokenizer="/b", compare_with=["replace"])


def test_write_folder_loads_like_the_transformers_save(tmp_path, wiki):
    """The stage writes the HF folder without importing transformers; it must load the same."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = replaced(wiki, 600, 600)
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=LLAMA3.bos,
        eos_token=LLAMA3.eot,
        pad_token=LLAMA3.pad,
        model_max_length=131072,
        chat_template=LLAMA3.chat_template,
        clean_up_tokenization_spaces=False,
    ).save_pretrained(str(tmp_path / "hf"))
    family_out.write_folder(tok, tmp_path / "plain", LLAMA3)
    a, b = (AutoTokenizer.from_pretrained(str(tmp_path / d), trust_remote_code=False) for d in ("hf", "plain"))
    text = "Bakı Azərbaycanın paytaxtıdır."
    assert a(text)["input_ids"] == b(text)["input_ids"]
    assert (len(a), a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        len(b),
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    assert a.chat_template == b.chat_template == LLAMA3.chat_template
    assert a.model_max_length == b.model_max_length
