"""The tokenizer stage through the coordinator (real entrypoint subprocess): replace, extend, base, S3."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
from pathlib import Path

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.cli import app
from dilforge_coordinator.integrity import recompute_artifact_id
from dilforge_shared.corpus import iter_texts
from dilforge_shared.store import fetch
from tokenizers import Tokenizer
from typer.testing import CliRunner

FLORES = "az/dev/flores200.dev.partial_from_sib200.tsv"


def coordinator(*args: str, workdir: Path):
    os.environ["DILFORGE_WORKDIR"] = str(workdir)
    return CliRunner().invoke(app, list(args))


def run_all(root: Path, section: dict, store: dict | None = None):
    cfg = {"run_id": "tok-it", "store": store or {"uri": str(root / "store")}, "tokenizer": section}
    (root / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return coordinator("run-all", "--config", str(root / "p.yaml"), workdir=root / "work")


def artifact_of(result):
    assert result.exit_code == 0, result.output
    printed = [line for line in result.output.splitlines() if line.startswith("[tokenizer] artifact: ")]
    assert printed, f"no artifact line in the command's output: {result.output[-3000:]!r}"
    return fetch(printed[-1].split("artifact: ")[1])


def flores(data_root: Path) -> dict:
    return {"uri": str(data_root / FLORES), "text_field": "azj_Latn", "name": "flores_dev"}


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory, data_root) -> dict[str, str]:
    """The same Azerbaijani text as .txt, .txt.gz and .jsonl (text in field 'content')."""
    root = tmp_path_factory.mktemp("corpus")
    legal = list(itertools.islice(iter_texts(str(data_root / "az/train/az_legal_codes.part03.txt")), 1500))
    tatoeba = list(iter_texts(str(data_root / "az/train/tatoeba_aze_sentences.txt")))[:1500]
    with gzip.open(root / "legal.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(legal) + "\n")
    (root / "tatoeba.jsonl").write_text(
        "".join(json.dumps({"id": i, "content": t}, ensure_ascii=False) + "\n" for i, t in enumerate(tatoeba)),
        encoding="utf-8",
    )
    return {
        "wiki": str(data_root / "az/train/azwiki_sentences_cv_extractor.txt"),
        "gz": str(root / "legal.txt.gz"),
        "jsonl": str(root / "tatoeba.jsonl"),
    }


def corpora(mixed_corpus) -> list[dict]:
    return [
        {"uri": mixed_corpus["wiki"], "name": "wiki", "weight": 2},
        {"uri": mixed_corpus["gz"], "name": "legal"},
        {"uri": mixed_corpus["jsonl"], "text_field": "content", "name": "tatoeba"},
    ]


@pytest.fixture(scope="module")
def replace_run(tmp_path_factory, data_root, mixed_corpus, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("replace")
    section = {
        "strategy": "replace",
        "corpora": corpora(mixed_corpus),
        "validation": [flores(data_root)],
        "base_tokenizer": str(tiny_tokenizer_dir),
        "vocab_sizes": [600, 900],
        "max_lines": 4500,
        "selection": "largest",
        "validation_fraction": 0.05,
    }
    return artifact_of(run_all(root, section))


def test_replace_publishes_a_loadable_llama3_tokenizer(replace_run):
    from transformers import AutoTokenizer

    art = replace_run
    names = {f.path for f in art.manifest.files}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "metrics.json", "sweep.md"} <= names
    raw = Tokenizer.from_file(str(art.path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(art.path), trust_remote_code=False)
    text = "Azərbaycan Respublikasının paytaxtı Bakı şəhəridir."
    assert hf(text)["input_ids"] == raw.encode(text).ids
    assert len(hf) == 900 + 256 and hf.bos_token_id == 900 and hf.eos_token == "<|eot_id|>"
    assert hf.convert_tokens_to_ids("<|eot_id|>") == 909 and hf.pad_token == "<|finetune_right_pad_id|>"
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "Salam"}, {"role": "assistant", "content": "Salam!"}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert chat["input_ids"][0] == 900 and sum(chat["assistant_masks"]) > 0


def test_replace_manifest_has_the_sweep_table_and_base_figures(replace_run, tiny_tokenizer_dir):
    m = replace_run.manifest.metrics
    assert m["strategy"] == "replace" and m["selected_vocab_size"] == 900
    assert [r["vocab_size"] for r in m["sweep"]] == [600, 900]
    for row in m["sweep"]:
        assert set(row["sets"]) == {"heldout", "flores_dev"}
        for stats in row["sets"].values():
            assert stats["tokens_per_word"] > 1 and stats["bytes_per_token"] > 1 and 0 < stats["share_words_3plus"] < 1
    small, big = (r["sets"]["flores_dev"]["tokens_per_word"] for r in m["sweep"])
    assert big < small  # a larger vocabulary splits less
    assert m["sweep"][0]["sets"]["flores_dev"]["num_texts"] == 510  # every FLORES dev sentence of the file
    assert set(m["base"]["sets"]) == {"heldout", "flores_dev"} and m["base"]["uri"] == str(tiny_tokenizer_dir)
    sources = m["corpus"]["sources"]
    assert set(sources) == {"wiki", "legal", "tatoeba"} and m["corpus"]["total"]["lines_read"] == 4500
    assert sources["wiki"]["lines_fed"] == 2 * sources["wiki"]["lines_trained"]
    assert m["corpus"]["heldout_lines_measured"] == m["sweep"][0]["sets"]["heldout"]["num_texts"] > 100
    table = re.sub(r" *\| *", " | ", (replace_run.path / "sweep.md").read_text())  # one space around each cell
    assert "| 900 (selected) | flores_dev |" in table and "base tokens/word" in table
    refs = {r.name: r for r in replace_run.manifest.inputs}
    assert recompute_artifact_id(replace_run.manifest) == replace_run.manifest.artifact_id
    assert {f"model:{tiny_tokenizer_dir}", "data:wiki", "data:legal", "data:tatoeba", "data:flores_dev"} <= set(refs)


def test_extend_keeps_every_base_id(tmp_path, data_root, mixed_corpus, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    section = {
        "strategy": "extend",
        "base_tokenizer": str(tiny_tokenizer_dir),
        "corpora": corpora(mixed_corpus)[1:],
        "validation": [flores(data_root)],
        "num_new_tokens": [150, 300],
        "selection": "largest",
    }
    art = artifact_of(run_all(tmp_path, section))
    base = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir), trust_remote_code=False)
    ext = AutoTokenizer.from_pretrained(str(art.path), trust_remote_code=False)
    base_vocab, ext_vocab = base.get_vocab(), ext.get_vocab()
    assert all(ext_vocab[t] == i for t, i in base_vocab.items())
    m = art.manifest.metrics
    added = m["sweep"][-1]["num_added_tokens"]
    assert added == 300 and len(ext) == len(base) + added
    assert sorted(set(ext_vocab.values()) - set(base_vocab.values())) == list(range(len(base), len(base) + added))
    assert (ext.bos_token_id, ext.eos_token_id, ext.pad_token_id) == (
        base.bos_token_id,
        base.eos_token_id,
        base.pad_token_id,
    )
    assert ext.chat_template == base.chat_template
    row = m["sweep"][-1]["sets"]["flores_dev"]
    assert row["tokens_per_word"] < m["base"]["sets"]["flores_dev"]["tokens_per_word"]
    # digit_tokens: as_base (default): the legal codes are full of article numbers, yet no new token holds a
    # digit and numbers encode exactly as the base encodes them
    assert not [t for t in set(ext_vocab) - set(base_vocab) if any(ch.isdigit() for ch in t)]
    numbers = "Maddə 19.2-ci, 2015-ci il, 1905 manat"
    assert ext.encode(numbers, add_special_tokens=False) != base.encode(numbers, add_special_tokens=False)
    assert [t for t in ext.tokenize(numbers) if any(c.isdigit() for c in t)] == [
        t for t in base.tokenize(numbers) if any(c.isdigit() for c in t)
    ]


def test_extend_learns_from_a_word_frequency_list(tmp_path, data_root, tiny_tokenizer_dir):
    """A word only the frequency list holds, frequent there, ends up one token; the list is reported as a source."""
    (tmp_path / "freq.txt").write_text("qarabağlılarımızdan 400\nsalam 7\n", encoding="utf-8")
    section = {
        "strategy": "extend",
        "base_tokenizer": str(tiny_tokenizer_dir),
        "num_new_tokens": [300],
        "corpora": [
            {"uri": str(data_root / "az/train/udhr_azj_latn.txt"), "name": "udhr"},
            {"uri": str(tmp_path / "freq.txt"), "format": "word_counts", "name": "freq"},
        ],
    }
    art = artifact_of(run_all(tmp_path, section))
    word = "Bu qarabağlılarımızdan"
    base = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    ext = Tokenizer.from_file(str(art.path / "tokenizer.json"))
    assert len(base.encode(word, add_special_tokens=False).ids) > 5
    assert (
        len(ext.encode(word, add_special_tokens=False).ids) == len(ext.encode("Bu", add_special_tokens=False).ids) + 1
    )
    freq = art.manifest.metrics["corpus"]["sources"]["freq"]
    assert (freq["lines_read"], freq["lines_heldout"], freq["lines_fed"]) == (2, 0, 407)
    assert ext.decode(ext.encode(word, add_special_tokens=False).ids) == word
    # replace alone streams the corpus into its trainer: the list's words (read last) reach it too
    section = {"strategy": "replace", "vocab_sizes": [1200], "corpora": section["corpora"]}
    (tmp_path / "replace").mkdir()
    rep = artifact_of(run_all(tmp_path / "replace", section))
    tok = Tokenizer.from_file(str(rep.path / "tokenizer.json"))
    assert len(tok.encode(" qarabağlılarımızdan", add_special_tokens=False).ids) == 1
    assert rep.manifest.metrics["corpus"]["sources"]["freq"]["lines_fed"] == 407


def test_base_measures_and_republishes_the_base_unchanged(tmp_path, data_root, mixed_corpus, tiny_tokenizer_dir):
    section = {
        "strategy": "base",
        "base_tokenizer": str(tiny_tokenizer_dir),
        "corpora": corpora(mixed_corpus)[:1],
        "validation": [flores(data_root)],
        "num_validation_lines": 50,
    }
    art = artifact_of(run_all(tmp_path, section))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (art.path / name).read_bytes() == (tiny_tokenizer_dir / name).read_bytes()
    m = art.manifest.metrics
    assert m["sweep"] == [] and m["selected_vocab_size"] is None
    assert m["base"]["sets"]["heldout"]["num_texts"] == 50
    assert m["base"]["sets"]["flores_dev"]["num_texts"] == 510
    assert m["corpus"]["total"]["lines_read"] == 51380  # the whole corpus: the dead-token audit reads it
    assert m["comparison"][0]["strategy"] == "base" and m["comparison"][0]["selected"]
    assert m["dead_tokens"]["dead_new_tokens_frac"] is None and 0 < m["dead_tokens"]["vocab_used_frac"]["train"] <= 1


@pytest.mark.slow
def test_corpus_and_base_tokenizer_from_s3(tmp_path, s3_server, s3_bucket, data_root, tiny_tokenizer_dir):
    client = s3_server.client()
    bucket = s3_bucket.removeprefix("s3://")
    lines = list(itertools.islice(iter_texts(str(data_root / "az/train/azwiki_sentences_cv_extractor.txt")), 2000))
    client.put_object(
        Bucket=bucket,
        Key="corpus/wiki.jsonl",
        Body="".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines).encode(),
    )
    for f in tiny_tokenizer_dir.iterdir():
        client.upload_file(str(f), bucket, f"tok/{f.name}")
    section = {
        "strategy": "extend",
        "base_tokenizer": f"{s3_bucket}/tok",
        "num_new_tokens": [200],
        "corpora": [{"uri": f"{s3_bucket}/corpus/wiki.jsonl"}],
    }
    art = artifact_of(
        run_all(tmp_path, section, {"uri": f"{s3_bucket}/store", "s3_endpoint_url": s3_server.endpoint_url})
    )
    assert art.uri.startswith(s3_bucket)
    m = art.manifest.metrics
    assert m["corpus"]["total"]["lines_read"] == 2000 and m["sweep"][0]["num_added_tokens"] > 0
    assert Tokenizer.from_file(str(art.path / "tokenizer.json")).get_vocab_size() > 768


def test_replace_output_is_golden_for_its_code_version(replace_run):
    """The tokenizer stage's code version is bumped whenever what it publishes for this run changes (tests/golden.py)."""
    import golden

    m = replace_run.manifest.metrics
    golden.check(
        "tokenizer",
        {
            "files": sorted(f.path for f in replace_run.manifest.files),
            "tokenizer.json": golden.file_digest(replace_run.path / "tokenizer.json"),
            "selected_vocab_size": m["selected_vocab_size"],
            "flores_tokens_per_word": [r["sets"]["flores_dev"]["tokens_per_word"] for r in m["sweep"]],
            "heldout_tokens_per_word": [r["sets"]["heldout"]["tokens_per_word"] for r in m["sweep"]],
        },
    )
