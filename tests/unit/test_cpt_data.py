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
        expected += [ids.bos, *tok.encode(d, add_special_tokens=False).ids, ids.eos]
    assert out.tolist() == expected
    assert ids.eos == tok.token_to_id("<|end_of_text|>") and ids.bos == tok.token_to_id("<|begin_of_text|>")


def test_token_cache_is_reused(tmp_path, tok, ids, tiny_tokenizer_dir, monkeypatch):
    from dilforge_cpt import data as D
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"cümlə nömrə {i} burada" for i in range(200)) + "\n")
    source = DataSource(uri=str(corpus))
    key = D.cache_key(source, tiny_tokenizer_dir / "tokenizer.json", None, None)
    tf = D.tokenize_to_file(source, tok, ids, tmp_path / "cache", key, None, 64, None)
    assert tf.num_docs == 200 and tf.num_tokens == tf.path.stat().st_size // 4
    monkeypatch.setattr(D, "pack_stream", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-tokenised")))
    again = D.tokenize_to_file(source, tok, ids, tmp_path / "cache", key, None, 64, None)
    assert again.num_tokens == tf.num_tokens
    corpus.write_text("başqa mətn\n")
    assert D.cache_key(source, tiny_tokenizer_dir / "tokenizer.json", None, None) != key  # content changes the key


def test_too_short_corpus_is_an_input_error(tmp_path):
    from dilforge_cpt.data import TokenFile, check_windows
    with pytest.raises(InputError, match="fewer than one training window of seq_len=64"):
        check_windows([TokenFile(tmp_path / "x", 40, 3, "tiny.txt")], 64)


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


def test_validation_windows_predict_each_token_once(tok, ids, tmp_path):
    from dilforge_cpt.data import build_validation, validation_batches
    dev = tmp_path / "dev.txt"
    docs = ["Bakı Azərbaycanın paytaxtıdır və ən böyük şəhəridir.", "Salam!", "Kitab oxumaq faydalıdır. " * 8]
    dev.write_text("\n".join(docs) + "\n")
    val = build_validation([DataSource(uri=str(dev))], tok, ids, seq_len=16, max_docs=10, endpoint_url=None)
    assert val.num_bytes == sum(len(d.encode()) for d in docs)
    expected_targets = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
    assert val.num_tokens == expected_targets
    for world in (1, 2):
        batches = [validation_batches(val, 2, r, world) for r in range(world)]
        assert len({len(b) for b in batches}) == 1  # same number of forwards on every rank
        labelled = sum(int((y != -100).sum()) for rank in batches for _, y in rank)
        assert labelled == expected_targets
