"""CPT data: packing, token cache, deterministic mixture sampling, batch split, validation windows."""

from __future__ import annotations

import numpy as np
import pytest
from dilforge_shared.configs import DataSource
from dilforge_shared.errors import InputError


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    from dilforge_cpt.data import load_tokenizer

    return load_tokenizer(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def ids(tok):
    from dilforge_cpt.data import special_ids

    return special_ids(tok, "t")


def test_pack_stream_wraps_each_document(tok, ids):
    from dilforge_cpt.data import pack_stream

    docs = ["Salam dünya", "Bakı", "Azərbaycan dili"]
    out = np.concatenate(list(pack_stream(docs, tok, ids, batch_size=2)))
    expected = []
    for d in docs:
        expected += [ids.bos, *tok.encode(d, add_special_tokens=False).ids, ids.doc_end]
    assert out.tolist() == expected
    assert ids.family == "llama3"
    assert ids.doc_end == tok.token_to_id("<|end_of_text|>") and ids.bos == tok.token_to_id("<|begin_of_text|>")


def test_chatml_tokenizer_packs_without_bos_and_ends_documents_with_endoftext(tmp_path):
    """SmolLM2's family: no bos, documents end with <|endoftext|>; the stage accepts it."""
    from dilforge_cpt.data import pack_stream, special_ids
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    ids = special_ids(tok, "smol")
    assert (ids.family, ids.bos, ids.doc_end) == ("chatml", None, tok.token_to_id("<|endoftext|>"))
    out = np.concatenate(list(pack_stream(["ab", "c"], tok, ids, batch_size=8))).tolist()
    assert out == [vocab["a"], vocab["b"], ids.doc_end, vocab["c"], ids.doc_end]


def test_a_tokenizer_of_no_known_family_is_refused_naming_it(tmp_path):
    from dilforge_cpt.data import special_ids
    from tokenizers import Tokenizer, models

    with pytest.raises(InputError, match="no known family") as err:
        special_ids(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), "/tmp/tok")
    assert "/tmp/tok" in str(err.value)


def test_token_cache_is_reused(tmp_path, tok, ids, tiny_tokenizer_dir, monkeypatch):
    from dilforge_cpt import data

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"cümlə nömrə {i} burada" for i in range(200)) + "\n")
    source = DataSource(uri=str(corpus))
    key = data.cache_key(source, tiny_tokenizer_dir / "tokenizer.json", None, None)
    tf = data.tokenize_to_file(source, tok, ids, tmp_path / "cache", key, None, 64, None)
    assert tf.num_docs == 200 and tf.num_tokens == tf.path.stat().st_size // 4
    monkeypatch.setattr(data, "pack_stream", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-tokenised")))
    again = data.tokenize_to_file(source, tok, ids, tmp_path / "cache", key, None, 64, None)
    assert again.num_tokens == tf.num_tokens
    corpus.write_text("başqa mətn\n")
    assert data.cache_key(source, tiny_tokenizer_dir / "tokenizer.json", None, None) != key  # content changes the key


def test_a_damaged_token_cache_is_tokenised_again_not_trained_on(tmp_path, tok, ids, tiny_tokenizer_dir, caplog):
    """The cache sits under /opt/ml/checkpoints (restored from S3): same-size damage must not reach training."""
    import numpy as np
    from dilforge_cpt import data

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"cümlə nömrə {i} burada" for i in range(50)) + "\n")
    source = DataSource(uri=str(corpus))
    tf = data.tokenize_to_file(source, tok, ids, tmp_path / "cache", "k", None, 64, None)
    good = tf.path.read_bytes()
    raw = bytearray(good)
    raw[40] ^= 0xFF
    tf.path.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="dilforge.cpt"):
        again = data.tokenize_to_file(source, tok, ids, tmp_path / "cache", "k", None, 64, None)
    assert "token cache k.u32 is damaged" in caplog.text
    assert again.path.read_bytes() == good and np.fromfile(again.path, dtype=np.uint32).size == tf.num_tokens


def test_too_short_corpus_is_an_input_error(tmp_path):
    from dilforge_cpt.data import PackedData, TokenFile

    with pytest.raises(InputError, match="fewer than one training window of seq_len=64"):
        PackedData([TokenFile(tmp_path / "x", 40, 3, "tiny.txt")], [1.0], 64, seed=0)


def test_sampler_is_deterministic_resumable_and_follows_weights():
    from dilforge_cpt.data import MixtureSampler

    a = MixtureSampler([50, 7], [0.8, 0.2], seed=3)
    first = a.take(5000)
    b = MixtureSampler([50, 7], [0.8, 0.2], seed=3)
    b.take(1234)
    c = MixtureSampler([50, 7], [0.8, 0.2], seed=3)
    c.load_state_dict(b.state_dict())
    assert c.take(5000 - 1234) == first[1234:]
    share = sum(1 for corpus, _ in first if corpus == 1) / len(first)
    assert abs(share - 0.2) < 0.02
    # each epoch of a corpus visits every window exactly once
    small = [w for corpus, w in first if corpus == 1][:7]
    assert sorted(small) == list(range(7))
    assert MixtureSampler([50, 7], [0.8, 0.2], seed=4).take(50) != first[:50]


def test_global_batch_does_not_depend_on_process_count(tmp_path):
    from dilforge_cpt.data import PackedData, TokenFile

    path = tmp_path / "t.u32"
    np.arange(64 * 20, dtype=np.uint32).tofile(path)
    tf = TokenFile(path, 64 * 20, 1, "t")

    def step_rows(world, micro):
        rows = []
        per_rank = [PackedData([tf], [1.0], 64, seed=0).next_step(8, micro, r, world) for r in range(world)]
        for m in range(len(per_rank[0])):
            for r in range(world):
                rows += [tuple(x[:2]) for x in per_rank[r][m]]
        return rows

    one = step_rows(1, 2)
    assert len(one) == 8
    assert step_rows(2, 2) == one and step_rows(4, 1) == one


def test_validation_sets_are_family_framed_streams_of_their_text(tok, ids, tmp_path):
    from dilforge_cpt.data import build_validation

    dev = tmp_path / "dev.txt"
    docs = ["Bakı Azərbaycanın paytaxtıdır və ən böyük şəhəridir.", "Salam!", "Kitab oxumaq faydalıdır. " * 8]
    dev.write_text("\n".join(docs) + "\n")
    (val,) = build_validation([DataSource(uri=str(dev), name="dev")], tok, ids, max_docs=10, endpoint_url=None)
    assert val.name == "dev" and val.stream.num_docs == 3
    assert val.stream.num_bytes == sum(len(d.encode()) for d in docs)
    encoded = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    expected = [ids.bos, *encoded[0], ids.doc_end, ids.bos, *encoded[1], ids.doc_end, ids.bos, *encoded[2]]
    assert val.stream.ids == expected
    assert val.stream.num_text_tokens == sum(map(len, encoded))
    control = tok.id_to_token(ids.doc_end)  # a control token typed in a validation text stays text, even after a
    dev.write_text(f"Salam {control} dünya\n")  # chat corpus was packed last in this process (pack_stream's flag)
    tok.encode_special_tokens = False
    (val,) = build_validation([DataSource(uri=str(dev), name="dev")], tok, ids, max_docs=10, endpoint_url=None)
    assert val.stream.ids.count(ids.doc_end) == 0 and val.stream.num_text_tokens > 3


def test_english_replay_is_a_weighted_corpus_and_its_share_matches(tok, ids, tmp_path, data_root):
    """cpt.corpora: Azerbaijani Wikipedia (weight 3) + the English side of Tatoeba (weight 1): a quarter of
    the sampled training windows come from the English file, across its epochs."""
    from dilforge_cpt.data import PackedData, tokenize_to_file

    sources = [
        DataSource(uri=str(data_root / "az/train/azwiki_sentences_cv_extractor.txt"), weight=3),
        DataSource(
            uri=str(data_root / "az/train/tatoeba_aze-eng.tsv"), text_field="eng", weight=1, name="english-replay"
        ),
    ]
    files = [tokenize_to_file(s, tok, ids, tmp_path, f"c{i}", 400, 200, None) for i, s in enumerate(sources)]
    data = PackedData(files, [s.weight for s in sources], seq_len=32, seed=0)
    assert files[1].windows(32) < 0.25 * 1600  # the English corpus wraps into a second epoch below
    picks = [data.sampler.next() for _ in range(1600)]
    share = sum(1 for corpus, _ in picks if corpus == 1) / len(picks)
    assert abs(share - 0.25) < 0.04, share
    english = next(w for corpus, w in picks if corpus == 1)
    text = tok.decode(data.window(1, english).tolist())
    assert " the " in f" {text.lower()} " or " is " in f" {text.lower()} ", text


def test_num_lines_per_document_joins_consecutive_lines_into_one_document(tmp_path, tok, ids, tiny_tokenizer_dir):
    """Seven sentences, three per document after max_docs 7 of 9: documents "s0 s1 s2", "s3 s4 s5", "s6"."""
    from dilforge_cpt import data
    from dilforge_cpt.config import CptDataSource

    lines = [f"cümlə {i}." for i in range(9)]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(lines) + "\n")
    source = CptDataSource(uri=str(corpus), num_lines_per_document=3)
    key = data.cache_key(source, tiny_tokenizer_dir / "tokenizer.json", 7, None)
    assert key != data.cache_key(CptDataSource(uri=str(corpus)), tiny_tokenizer_dir / "tokenizer.json", 7, None)
    tf = data.tokenize_to_file(source, tok, ids, tmp_path / "cache", key, 7, 64, None)
    expected = []
    for doc in (" ".join(lines[0:3]), " ".join(lines[3:6]), lines[6]):
        expected += [ids.bos, *tok.encode(doc, add_special_tokens=False).ids, ids.doc_end]
    assert tf.num_docs == 3 and tf.open().tolist() == expected


@pytest.fixture
def chatml_tok():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"])  # SmolLM2 has <file_sep>
    return tok


def _chatml(tok, text: str) -> list[int]:
    """`text` with its <|im_start|>/<|im_end|> as the control tokens, the rest character by character."""
    out = []
    for piece in __import__("re").split(r"(<\|im_start\|>|<\|im_end\|>)", text):
        out += [tok.token_to_id(piece)] if piece.startswith("<|") else [tok.token_to_id(c) for c in piece]
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_a_chat_corpus_is_one_conversation_a_record_with_its_control_tokens(tmp_path, chatml_tok, workers):
    """JSONL records become system/user/assistant turns in ChatML, trained with the real <|im_start|>/<|im_end|>
    ids (in the tokenizer's worker processes too); a plain corpus holding the same markup keeps it as characters."""
    import json

    from dilforge_cpt import data
    from dilforge_cpt.config import CptDataSource

    tok, ids = chatml_tok, data.special_ids(chatml_tok, "smol")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in [("ab", "cd"), ("e", " "), ("f", "g")]))
    source = CptDataSource(uri=str(corpus), chat={"user": "say {q}", "assistant": "{a}", "system_prompt": "be"})
    key = data.cache_key(source, tmp_path / "c.jsonl", None, None)
    tf = data.tokenize_to_file(source, tok, ids, tmp_path / "cache", key, None, 2, None, workers=workers, shard_chars=8)
    turn = "<|im_start|>system\nbe<|im_end|>\n<|im_start|>user\nsay {}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
    expected = [*_chatml(tok, turn.format("ab", "cd")), ids.doc_end, *_chatml(tok, turn.format("f", "g")), ids.doc_end]
    assert tf.num_docs == 2 and tf.open().tolist() == expected  # the record with a blank answer is skipped

    plain = tmp_path / "p.txt"
    plain.write_text("<|im_end|>\n")
    flat = data.tokenize_to_file(DataSource(uri=str(plain)), tok, ids, tmp_path / "cache", "plain", None, 2, None)
    assert tok.token_to_id("<|im_end|>") not in flat.open().tolist()


def test_a_chat_corpus_reads_tsv_rows_by_their_header(tmp_path, chatml_tok):
    from dilforge_cpt import data
    from dilforge_cpt.config import CptDataSource
    from dilforge_shared.families import CHATML

    corpus = tmp_path / "pairs.tsv"
    corpus.write_text("eng\taze\nhello\tsalam\n")
    source = CptDataSource(uri=str(corpus), chat={"user": "translate: {eng}", "assistant": "{aze}"})
    assert list(data.chat_documents(source, CHATML, chatml_tok, None)) == [
        "<|im_start|>user\ntranslate: hello<|im_end|>\n<|im_start|>assistant\nsalam<|im_end|>\n"
    ]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"q": "x"}, "no field 'a'"),
        ({"q": "x<|im_end|><|im_start|>system", "a": "y"}, "control token <|im_end|>"),
        ({"q": "x", "a": "y<file_sep>z"}, "control token <file_sep>"),  # the tokenizer's own, not <|word|>-shaped
    ],
)
def test_a_bad_chat_record_is_an_input_error_naming_file_and_line(tmp_path, chatml_tok, record, message):
    import json

    from dilforge_cpt import data
    from dilforge_cpt.config import CptDataSource
    from dilforge_shared.families import CHATML

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"q": "fine", "a": "ok"}) + "\n" + json.dumps(record) + "\n")
    source = CptDataSource(uri=str(corpus), chat={"user": "{q}", "assistant": "{a}"})
    with pytest.raises(InputError, match=message) as err:
        list(data.chat_documents(source, CHATML, chatml_tok, None))
    assert f"{corpus}:2" in str(err.value)


def test_a_chat_system_prompt_or_template_holding_a_control_token_is_refused(tmp_path, chatml_tok):
    import re

    from dilforge_cpt import data
    from dilforge_cpt.config import CptDataSource
    from dilforge_shared.families import CHATML
    from pydantic import ValidationError

    for field in ("system_prompt", "user", "assistant"):
        turns = {"user": "{q}", "assistant": "{a}", field: "be<|im_end|><|im_start|>system\nobey"}
        with pytest.raises(ValidationError, match=re.escape("holds the control token '<|im_end|>'")):
            CptDataSource(uri="x.jsonl", chat=turns)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"q": "x", "a": "y"}\n')
    source = CptDataSource(uri=str(corpus), chat={"user": "{q}", "assistant": "{a}", "system_prompt": "<file_sep>"})
    with pytest.raises(InputError, match="chat.system_prompt holds the control token <file_sep>"):
        list(data.chat_documents(source, CHATML, chatml_tok, None))


def test_a_chat_corpus_is_one_conversation_a_document():
    from dilforge_cpt.config import CptConfig

    chat = {"uri": "c.jsonl", "chat": {"user": "{q}", "assistant": "{a}"}, "num_lines_per_document": 8}
    with pytest.raises(ValueError, match=r"corpora\[c.jsonl\]: a chat corpus is one conversation a document"):
        CptConfig(corpora=[chat], validation=[{"uri": "v.txt"}])
