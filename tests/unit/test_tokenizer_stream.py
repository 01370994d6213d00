"""The one-pass corpus stream: held-out split, dedup, upsampling, interleaving, errors."""

from __future__ import annotations

import pytest
from dilforge_shared.configs import DataSource
from dilforge_shared.errors import InputError
from dilforge_tokenizer import pretokens
from dilforge_tokenizer.config import CorpusSource
from dilforge_tokenizer.stream import CorpusStream
from tokenizers import Tokenizer, models, pre_tokenizers


def write(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return str(path)


def test_heldout_lines_are_never_trained_and_split_is_by_content(tmp_path):
    lines = [f"cümlə nömrə {i}" for i in range(2000)]
    src = [DataSource(uri=write(tmp_path / "a.txt", lines))]
    s1 = CorpusStream(src, validation_fraction=0.1, num_validation_lines=10_000, progress=False)
    trained = list(s1.lines())
    assert 120 < len(s1.heldout) < 280  # ~10 %
    assert not set(trained) & set(s1.heldout)
    assert len(trained) + len(s1.heldout) == 2000
    # reversed order, same split: it depends on the text, not the position
    s2 = CorpusStream(
        [DataSource(uri=write(tmp_path / "b.txt", lines[::-1]))],
        validation_fraction=0.1,
        num_validation_lines=10_000,
        progress=False,
    )
    list(s2.lines())
    assert set(s2.heldout) == set(s1.heldout)
    s3 = CorpusStream(src, seed=1, validation_fraction=0.1, num_validation_lines=10_000, progress=False)
    list(s3.lines())
    assert set(s3.heldout) != set(s1.heldout)


def test_heldout_cap_dedup_and_weights(tmp_path):
    a = write(tmp_path / "a.txt", ["x"] * 5 + [f"a{i}" for i in range(100)])
    b = write(tmp_path / "b.txt", [f"b{i}" for i in range(100)])
    s = CorpusStream(
        [DataSource(uri=a, name="a"), DataSource(uri=b, name="b", weight=2.5)],
        dedup=True,
        validation_fraction=0.05,
        num_validation_lines=3,
        progress=False,
    )
    trained = list(s.lines())
    assert len(s.heldout) <= 3
    assert s.stats["a"].lines_duplicate == 4 and trained.count("x") <= 1
    b_stats = s.stats["b"]
    assert 2 * b_stats.lines_trained <= b_stats.lines_fed <= 3 * b_stats.lines_trained
    assert sum(1 for t in trained if t.startswith("b")) == b_stats.lines_fed
    assert s.summary()["total"]["lines_read"] == 205


def test_sources_are_interleaved_so_max_lines_sees_each(tmp_path):
    a = write(tmp_path / "a.txt", [f"a{i}" for i in range(50)])
    b = write(tmp_path / "b.txt", [f"b{i}" for i in range(50)])
    s = CorpusStream([DataSource(uri=a), DataSource(uri=b)], max_lines=20, validation_fraction=0.01, progress=False)
    out = list(s.lines())
    assert s.summary()["total"]["lines_read"] == 20
    assert sum(t.startswith("a") for t in out) >= 9 and sum(t.startswith("b") for t in out) >= 9


def test_batches_hold_every_line_once_beside_the_heldout_slice(tmp_path):
    a = write(tmp_path / "a.txt", [f"line {i}" for i in range(3000)])
    s = CorpusStream([DataSource(uri=a)], validation_fraction=0.02, progress=False)
    batches = list(s.batches(min_lines=1000))
    assert len(batches) == 3 and all(len(b) >= 1000 for b in batches[:-1]) and batches[-1]
    assert sum(map(len, batches)) + len(s.heldout) == 3000
    assert [t for b in batches for t in b] == list(
        CorpusStream([DataSource(uri=a)], validation_fraction=0.02, progress=False).lines()
    )  # same lines, same order


def test_empty_source_is_an_error_naming_it(tmp_path):
    empty = write(tmp_path / "empty.txt", ["", "   "])
    full = write(tmp_path / "full.txt", ["salam"] * 10)
    s = CorpusStream([DataSource(uri=full), DataSource(uri=empty)], progress=False)
    with pytest.raises(InputError, match=r"empty\.txt: corpus is empty"):
        list(s.lines())


def test_non_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"salam\n\xff\xfe dunya\n")
    with pytest.raises(InputError, match=r"bad\.txt:2: not valid UTF-8"):
        list(CorpusStream([DataSource(uri=str(path))], progress=False).lines())
    # the same error, raised in the read-ahead thread, reaches whoever iterates batches()
    with pytest.raises(InputError, match=r"bad\.txt:2: not valid UTF-8"):
        list(CorpusStream([DataSource(uri=str(path))], progress=False).batches())


def test_parquet_and_gzip_sources(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": [1, 2, 3], "body": ["birinci cümlə", "ikinci cümlə", "üçüncü cümlə"]}), tmp_path / "c.parquet"
    )
    with gzip.open(tmp_path / "d.txt.gz", "wt", encoding="utf-8") as f:
        f.write("dördüncü\nbeşinci\n")
    s = CorpusStream(
        [DataSource(uri=str(tmp_path / "c.parquet"), text_field="body"), DataSource(uri=str(tmp_path / "d.txt.gz"))],
        validation_fraction=0.001,
        progress=False,
    )
    assert sorted(s.lines()) == sorted(["birinci cümlə", "ikinci cümlə", "üçüncü cümlə", "dördüncü", "beşinci"])


def test_word_counts_feed_each_word_after_a_space_count_times_weight_never_held_out(tmp_path):
    freq = tmp_path / "freq.txt"
    freq.write_text("\ufeffkitab 3\nkitablar\t10\n\n  Ev 1 \r\n", encoding="utf-8")  # BOM, tab, CRLF, spaces
    text = write(tmp_path / "a.txt", [f"cümlə {i}" for i in range(200)])
    s = CorpusStream(
        [
            CorpusSource(uri=str(freq), format="word_counts", name="freq", weight=2),  # read after the text
            CorpusSource(uri=text, name="text"),
        ],
        validation_fraction=0.4,
        num_validation_lines=10_000,
        dedup=True,
        progress=False,
    )
    trained = list(s.lines())
    assert all(t.startswith("cümlə") for t in trained)  # the list's words are counted, not repeated in the stream
    assert s.fed_words == {" kitab": 6, " kitablar": 20, " Ev": 2}  # dedup leaves counts alone
    st = s.stats["freq"]
    assert (st.lines_read, st.lines_heldout, st.lines_trained, st.lines_fed) == (3, 0, 3, 28)
    assert st.bytes_fed == 6 * len(" kitab") + 20 * len(" kitablar") + 2 * len(" Ev")
    assert all(h.startswith("cümlə") for h in s.heldout) and s.heldout  # only text lines are held out


def test_word_count_fractions_are_seeded_and_unbiased(tmp_path):
    freq = write(tmp_path / "freq.txt", [f"söz{i} 3" for i in range(2000)])

    def fed(seed):
        s = CorpusStream([CorpusSource(uri=freq, format="word_counts", weight=0.5)], seed=seed, progress=False)
        list(s.lines())
        return s.fed_words

    once = fed(0)
    assert once == fed(0) and once != fed(1)
    assert set(once.values()) <= {1, 2}  # 3 x 0.5 = 1.5: one or two, never more
    assert 2800 < sum(once.values()) < 3200  # expected 3000


def test_max_lines_cuts_the_text_but_word_lists_are_read_whole(tmp_path):
    text = write(tmp_path / "a.txt", [f"cümlə {i}" for i in range(500)])
    freq = write(tmp_path / "freq.txt", [f"söz{i} 2" for i in range(300)])
    s = CorpusStream(
        [CorpusSource(uri=text), CorpusSource(uri=freq, format="word_counts", name="freq")],
        max_lines=50,
        validation_fraction=0.01,
        progress=False,
    )
    splitter = Tokenizer(models.BPE())
    splitter.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # text lines and the list's words, each word counted as often as it was fed
    counts = pretokens.count(s, {"plain": splitter}, max_words=10**6, num_workers=1).words["plain"]
    assert s.stats["a.txt"].lines_read == 50 and s.stats["freq"].lines_read == 300
    assert sum(n for t, n in counts.items() if t.startswith("söz")) == 600 and counts["söz7"] == 2
    assert counts["cümlə"] == 50 - len(s.heldout)


@pytest.mark.parametrize(
    "line",
    ["kitablar", "kitab 0", "kitab -2", "kitab 2.5", "12", "kitab ٣", "1\tkitab\t12", "word count", "new york 3"],
)
def test_bad_word_count_line_names_file_and_line(tmp_path, line):
    freq = write(tmp_path / "freq.txt", ["kitab 3", line])
    with pytest.raises(InputError, match=r"freq\.txt:2: expected 'WORD COUNT'"):
        list(CorpusStream([CorpusSource(uri=freq, format="word_counts")], progress=False).lines())


def test_word_counts_are_a_tokenizer_corpus_format_only():
    from dilforge_cpt.config import CptConfig
    from dilforge_tokenizer.config import TokenizerConfig
    from pydantic import ValidationError

    TokenizerConfig(corpora=[{"uri": "freq.txt", "format": "word_counts"}])
    with pytest.raises(ValidationError, match=r"corpora\.0\.format"):
        CptConfig(corpora=[{"uri": "freq.txt", "format": "word_counts"}], base_model="m")


def test_usual_casing_prefers_the_texts_form_lowercase_or_capitalised_turkic_aware():
    from collections import Counter

    from dilforge_tokenizer.stream import usual_casing

    best = usual_casing(Counter({"Rusiya": 5, "rusiya": 1, "RUSİYA": 10, "İraq": 3, "bu": 50, "Bu": 5, "Iğdır": 2}))
    assert best["rusiya"] == "Rusiya"  # ALL-CAPS headings never win
    assert best["iraq"] == "İraq" and best["ığdır"] == "Iğdır"  # İ -> i and I -> ı
    assert best["bu"] == "bu"


def test_recase_feeds_a_lowercased_lists_words_as_the_text_writes_them(tmp_path):
    # "Burada" only ever starts a sentence: capitalised by position, so it stays "burada"
    text = write(
        tmp_path / "a.txt",
        ["Burada Rusiya böyük ölkədir.", "Burada, sabah İraq. Burada Rusiya!", "«Burada» dedi: rusiya"],
    )
    freq = write(tmp_path / "freq.txt", ["rusiya 3", "iraq 1", "bakı 2", "burada 1"])

    def fed(recase):
        s = CorpusStream(
            [
                CorpusSource(uri=freq, format="word_counts", recase=recase, name="freq"),
                CorpusSource(uri=text, name="text"),
            ],
            validation_fraction=0.001,
            progress=False,
        )
        list(s.lines())
        return s.fed_words, s.stats["freq"].words_recased

    assert fed(True) == ({" Rusiya": 3, " İraq": 1, " bakı": 2, " burada": 1}, 2)
    assert fed(False) == ({" rusiya": 3, " iraq": 1, " bakı": 2, " burada": 1}, 0)


def test_recase_is_for_word_lists_only():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="recase applies to word_counts lists only"):
        CorpusSource(uri="a.txt", recase=True)
