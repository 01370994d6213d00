"""Tokenizer metrics and morpheme alignment on hand-checked strings and hand-made segmentations."""

from __future__ import annotations

import pytest
from dilforge_eval import morph as eval_morph
from dilforge_eval.config import MorphResources
from dilforge_eval.measures import morph_metrics, parity_metrics, tokenizer_metrics
from tokenizers import Regex, Tokenizer, models, pre_tokenizers


def char_tokenizer(text: str) -> Tokenizer:
    """Every non-space character is one token (a vocabulary built from `text`)."""
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(sorted(set(text) - {" "}))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    return tok


def suffix_tokenizer(words: list[str], suffix: str) -> Tokenizer:
    """Whole words, except that `suffix` is split off as its own token."""
    pieces = {p for w in words for p in w.split(suffix) if p} | {suffix}
    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0, **{p: i + 1 for i, p in enumerate(sorted(pieces))}}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(suffix, behavior="isolated")]
    )
    return tok


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: every UTF-8 byte is a token (a two-byte letter is split)."""
    from factories import llama3_bpe

    return llama3_bpe(["x"], 256)


def test_fertility_bytes_per_token_and_3plus_on_hand_checked_strings():
    text_a, text_b = "kitab ev", "əl su"
    tok = char_tokenizer(text_a + text_b)
    m = tokenizer_metrics({"chars": tok}, {"s": [text_a, text_b]})["chars"]["s"].model_dump()
    # tokens: 5 + 2 + 2 + 2 = 11; words: 4; bytes: 8 + 6 (ə is two bytes); only "kitab" has 3+ tokens
    assert (m["num_tokens"], m["num_words"], m["num_bytes"], m["num_words_3plus"]) == (11, 4, 14, 1)
    assert m["tokens_per_word"] == pytest.approx(11 / 4, abs=1e-4)
    assert m["bytes_per_token"] == pytest.approx(14 / 11, abs=1e-4)
    assert m["share_words_3plus"] == pytest.approx(0.25)


def test_parity_is_az_tokens_over_en_tokens():
    tok = char_tokenizer("ev house kitab book")
    p = parity_metrics({"c": tok}, {"pairs": [("ev", "house"), ("kitab", "book")]})["c"]["pairs"].model_dump()
    assert (p["tokens_az"], p["tokens_en"], p["num_pairs"]) == (7, 9, 2)
    assert p["parity"] == pytest.approx(7 / 9, abs=1e-4)


def test_alignment_perfect_when_tokens_follow_morphemes():
    words = [
        eval_morph.from_segments("kitablar", ["kitab", "lar"]),
        eval_morph.from_segments("evlər", ["ev", "lər"]),
    ]
    tok = suffix_tokenizer(["kitablar"], "lar")
    s = eval_morph.figures(eval_morph.alignment(tok, words[:1])).model_dump()
    assert s["boundary_recall"] == 1.0 and s["inside_morpheme_rate"] == 0.0 and s["exact_segmentation_rate"] == 1.0
    # evlər is one unknown token for this vocabulary: a missed boundary, no token boundary at all
    s = eval_morph.figures(eval_morph.alignment(tok, words[1:])).model_dump()
    assert s["boundary_recall"] == 0.0 and s["inside_morpheme_rate"] is None and s["exact_segmentation_rate"] == 0.0


def test_alignment_character_tokens_hit_every_boundary_but_mostly_inside_morphemes():
    word = eval_morph.from_segments("kitablar", ["kitab", "lar"])
    s = eval_morph.figures(eval_morph.alignment(char_tokenizer("kitablar"), [word])).model_dump()
    # 7 internal token boundaries; 1 is the gold one, the other 6 fall inside kitab or lar
    assert (s["num_gold_hit"], s["num_token_boundaries_decidable"], s["num_token_boundaries_inside"]) == (1, 7, 6)
    assert s["boundary_recall"] == 1.0 and s["inside_morpheme_rate"] == pytest.approx(6 / 7, abs=1e-4)


def test_alignment_counts_a_split_inside_a_two_byte_letter_as_inside_a_morpheme():
    tok = byte_tokenizer()
    assert eval_morph.token_byte_boundaries(tok, "əl") == [1, 2]  # ə = C9 99: a boundary between its two bytes
    s = eval_morph.figures(eval_morph.alignment(tok, [eval_morph.from_segments("əl", ["əl"])])).model_dump()
    assert s["num_token_boundaries_inside"] == 2 and s["inside_morpheme_rate"] == 1.0


def test_alignment_ignores_token_boundaries_in_unknown_suffix_regions():
    # lemma/form: stem known, suffix "lara" (two morphemes, split unknown)
    gw = eval_morph.from_lemma("açarlara", "açar")
    assert gw.boundaries == (4,) and gw.known == ((0, 4),)
    s = eval_morph.figures(eval_morph.alignment(char_tokenizer("açarlara"), [gw])).model_dump()
    # char boundaries at 1..7: 1,2,3 inside the stem; 4 gold; 5,6,7 undecidable
    assert (s["num_token_boundaries_decidable"], s["num_token_boundaries_inside"], s["num_gold_hit"]) == (4, 3, 1)
    assert s["exact_segmentation_rate"] is None


def test_morph_metrics_has_per_source_and_overall_rows():
    gold = {
        "a": [eval_morph.from_segments("evlər", ["ev", "lər"])],
        "b": [eval_morph.from_segments("ev", ["ev"])],
    }
    out = morph_metrics({"c": char_tokenizer("evlər")}, gold)["c"]
    assert set(out) == {"a", "b", "all"}
    assert out["all"].num_words == 2 and out["all"].num_gold_boundaries == 1


@pytest.mark.parametrize(
    "lemma,form,boundary",
    [
        ("kitab", "kitablar", 5),
        ("çiçək", "çiçəyi", 5),
        ("ayaq", "ayağı", 4),
        ("kitab", "kitab", 5),
        ("İş", "işlər", 2),
        ("ağız", "ağzı", None),
        ("ev", "at", None),
    ],
)
def test_stem_boundary_with_alternations(lemma, form, boundary):
    assert eval_morph.stem_boundary(lemma, form) == boundary


def test_from_lemma_uses_gloss_morpheme_count():
    assert eval_morph.from_lemma("yoldaşı", "yoldaş", num_morphemes=2).known == ((0, 6), (6, 7))
    assert eval_morph.from_lemma("yoldaşına", "yoldaş", num_morphemes=3).known == ((0, 6),)
    assert eval_morph.from_lemma("aç", "aç", num_morphemes=1).known == ((0, 2),)
    assert eval_morph.from_lemma("aç", "aç", num_morphemes=3) is None
    assert eval_morph.from_lemma("yazdı", "yaz", num_morphemes=1) is None


def test_loaders_read_hand_made_resources(tmp_path):
    seg = tmp_path / "seg.tsv"
    seg.write_text("word\tsegmentation\ttags\nkitab\tkitab\t\nkitablar\tkitab+lar\tPl\nuşağı\tuşaq+ı\tAcc\n")
    words = eval_morph.load_segmented(str(seg))
    assert [(w.word, w.boundaries) for w in words] == [("kitab", ()), ("kitablar", (5,))]  # uşaq+ı does not spell uşağı
    lf = tmp_path / "lf.tsv"
    lf.write_text("lemma\tform\tpos\nev\tevlər\tN\nev\tev\tN\nal\tgözəl alma\tN\n")
    assert [(w.word, w.boundaries) for w in eval_morph.load_lemma_forms(str(lf))] == [("evlər", (2,)), ("ev", ())]
    um = tmp_path / "um.tsv"
    um.write_text("açar\taçarlara\tN;DAT;PL\n")
    assert eval_morph.load_lemma_forms(str(um))[0].boundaries == (4,)
    conllu = tmp_path / "x.conllu"
    conllu.write_text(
        "# sent_id = 1\n# text = Qız yoldaşına yazdı.\n# glossing = girl friend-POSS.3SG-DAT write-PST\n"
        "1\tQız\tqız\tNOUN\t_\t_\t0\troot\t_\t_\n2\tyoldaşına\tyoldaş\tNOUN\t_\t_\t1\tobl\t_\t_\n"
        "3\tyazdı\tyaz\tVERB\t_\t_\t1\tx\t_\tSpaceAfter=No\n4\t.\t.\tPUNCT\t_\t_\t3\tpunct\t_\t_\n"
    )
    got = {w.word: (w.boundaries, w.known) for w in eval_morph.load_conllu(str(conllu))}
    assert got == {"Qız": ((), ((0, 3),)), "yoldaşına": ((6,), ((0, 6),)), "yazdı": ((3,), ((0, 3), (3, 5)))}


def test_loader_errors_name_file_and_line(tmp_path):
    from dilforge_shared.errors import InputError

    bad = tmp_path / "bad.tsv"
    bad.write_text("word\tsegmentation\nkitab\n")
    with pytest.raises(InputError, match=r"bad.tsv:2: expected word<TAB>segmentation"):
        eval_morph.load_segmented(str(bad))


def test_load_gold_samples_with_seed(data_root):
    resources = MorphResources(lemma_forms=[str(data_root / "az/morph/unimorph_aze.tsv")], num_words_per_source=50)
    a, b = eval_morph.load_gold(resources, seed=1), eval_morph.load_gold(resources, seed=1)
    assert [w.word for w in a["unimorph_aze.tsv"]] == [w.word for w in b["unimorph_aze.tsv"]]
    assert len(a["unimorph_aze.tsv"]) == 50


def test_morphology_resources_read_from_s3_like_local_files(tmp_path, s3_server, s3_bucket, data_root):
    """Morphology files go through the shared corpus readers, so s3:// URIs (SageMaker inputs) work."""
    client = s3_server.client()
    bucket = s3_bucket.removeprefix("s3://")
    local = {
        "segmented": str(data_root / "az/morph/az-lang-nlp_golden_morph.tsv"),
        "lemma_forms": str(data_root / "az/morph/unimorph_aze.tsv"),
        "conllu": str(data_root / "az/morph/ud_az_tuecl-ud-test.conllu"),
    }
    remote = {}
    for kind, path in local.items():
        key = f"morph/{path.rsplit('/', 1)[-1]}"
        client.upload_file(path, bucket, key)
        remote[kind] = f"{s3_bucket}/{key}"

    def resources(files: dict) -> MorphResources:
        return MorphResources(**{k: [v] for k, v in files.items()}, num_words_per_source=200)

    from_local = eval_morph.load_gold(resources(local), seed=3)
    from_s3 = eval_morph.load_gold(resources(remote), seed=3, endpoint_url=s3_server.endpoint_url)
    assert (
        list(from_s3)
        == list(from_local)
        == ["az-lang-nlp_golden_morph.tsv", "unimorph_aze.tsv", "ud_az_tuecl-ud-test.conllu"]
    )
    assert from_s3 == from_local and all(len(v) == 200 for v in from_s3.values())
    from dilforge_shared.errors import InputError

    with pytest.raises(InputError, match="morph/missing.tsv"):
        eval_morph.load_segmented(f"{s3_bucket}/morph/missing.tsv", s3_server.endpoint_url)
