"""extend/replace over a real ChatML base (SmolLM2's tokenizer) arriving as the upstream `model` artifact,
through the real entrypoint: ids kept, family specials and training chat template, the comparison contract.

SmolLM2's folder comes from the `smollm2_dir` fixture (tests/conftest.py: imported through the project's own
recipe and cached); only its tokenizer files are used here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.backends.local import write_inputs
from dilforge_shared.contract import OPT_ML_ENV, OptMl
from dilforge_shared.corpus import iter_texts
from dilforge_shared.families import CHATML_CHAT_TEMPLATE
from dilforge_shared.manifest import Manifest, current_producer
from dilforge_shared.store import fetch, publish
from dilforge_tokenizer import candidates as stage_candidates
from dilforge_tokenizer.base import Base, load
from dilforge_tokenizer.config import TokenizerConfig

pytestmark = pytest.mark.slow

FLORES = "az/dev/flores200.dev.partial_from_sib200.tsv"
ROW_KEYS = {"strategy", "vocab_size", "num_new_tokens", "selected", "languages", "dead_new_tokens_frac"}
FIGURES = {"tokens_per_word", "bytes_per_token", "frac_words_3plus"}


def languages(data_root: Path) -> list[dict]:
    return [
        {"uri": str(data_root / FLORES), "text_field": "azj_Latn", "name": "az"},
        {"uri": str(data_root / FLORES), "text_field": "eng_Latn", "name": "en"},
    ]


@pytest.fixture(scope="module")
def model_artifact(tmp_path_factory, smollm2_dir) -> str:
    """A `model` artifact (HF folder under model/) holding SmolLM2's config and tokenizer files."""
    root = tmp_path_factory.mktemp("model")
    hf = root / "files" / "model"
    hf.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copyfile(smollm2_dir / name, hf / name)
    uri = str(root / "store/artifacts/model/smollm2")
    manifest = Manifest(
        code_version="test",
        kind="model",
        artifact_id="smollm2",
        run_id="t",
        stage="cpt",
        producer=current_producer("dilforge-shared"),
        config={},
        data_dir="x",
        files=[],
    )
    publish(uri, root / "files", manifest)
    return uri


def entrypoint(root: Path, config: dict, inputs: dict | None = None) -> tuple[int, str, str]:
    opt = OptMl(root / "optml")
    artifact = str(root / "store/artifacts/tokenizer/out")
    write_inputs(
        opt,
        {
            "stage_config": json.dumps(config),
            "artifact_uri": artifact,
            "run_id": "fam",
            "inputs": json.dumps(inputs or {}),
        },
    )
    proc = subprocess.run(
        [sys.executable, "-m", "dilforge_tokenizer", "train"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, OPT_ML_ENV: str(opt.root)},
        timeout=900,
    )
    failure = opt.failure_file.read_text() if opt.failure_file.exists() else ""
    return proc.returncode, failure or proc.stderr[-3000:], artifact


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory, data_root, model_artifact):
    root = tmp_path_factory.mktemp("chatml")
    config = {
        "strategy": "extend",
        "compare_with": ["base", "replace"],
        "corpora": [
            {"uri": str(data_root / "az/train/azwiki_sentences_cv_extractor.txt")},
            {"uri": str(data_root / "az/train/az_legal_codes.part02.txt")},
        ],
        "validation": languages(data_root),
        "num_new_tokens": [300, 600],
        "vocab_sizes": [1500],
        "selection": "largest",
        "selection_set": "az",
        "retain_set": "en",
        "retain_tolerance": 0.01,
        "prune_dead": True,
        "max_lines": 4000,
    }
    rc, failure, uri = entrypoint(root, config, {"model": model_artifact})
    assert rc == 0, failure
    return fetch(uri)


def test_extend_of_a_chatml_base_keeps_ids_and_follows_its_family(chatml_run, smollm2_dir):
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(str(smollm2_dir), trust_remote_code=False)
    ext = AutoTokenizer.from_pretrained(str(chatml_run.path), trust_remote_code=False)
    base_vocab, ext_vocab = base.get_vocab(), ext.get_vocab()
    assert all(ext_vocab[t] == i for t, i in base_vocab.items())
    m = chatml_run.manifest.metrics
    added = len(ext) - len(base)
    assert 0 < added <= 600 and m["dead_tokens"]["num_new_tokens"] >= added
    assert sorted(set(ext_vocab.values()) - set(base_vocab.values())) == list(range(len(base), len(ext)))
    assert (ext.bos_token, ext.eos_token, ext.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    assert ext.chat_template == CHATML_CHAT_TEMPLATE and m["family"] == "chatml"
    chat = ext.apply_chat_template(
        [{"role": "user", "content": "Salam"}, {"role": "assistant", "content": "Necəsən?"}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    masked = [i for i, keep in zip(chat["input_ids"], chat["assistant_masks"], strict=False) if keep]
    assert ext.decode(masked) == "Necəsən?<|im_end|>"
    text = "Azərbaycan Respublikasının paytaxtı Bakı şəhəridir."
    assert len(ext(text)["input_ids"]) < len(base(text)["input_ids"])
    assert {i.name for i in chatml_run.manifest.inputs} >= {"model"}


def test_manifest_compares_every_strategy_on_both_languages(chatml_run):
    m = chatml_run.manifest.metrics
    rows = m["comparison"]
    assert [(r["strategy"], r["num_new_tokens"] > 0) for r in rows] == [
        ("base", False),
        ("extend", True),
        ("extend", True),
        ("replace", True),
    ]
    for row in rows:
        assert set(row) == ROW_KEYS and set(row["languages"]) == {"az", "en"}
        assert all(set(figures) == FIGURES for figures in row["languages"].values())
    assert [r["selected"] for r in rows] == [False, False, True, False]
    base, ext300, ext600, rep = rows
    assert base["dead_new_tokens_frac"] is None and 0 <= ext600["dead_new_tokens_frac"] < 0.1
    assert (
        ext600["languages"]["az"]["tokens_per_word"]
        < ext300["languages"]["az"]["tokens_per_word"]
        < base["languages"]["az"]["tokens_per_word"]
    )
    # extend keeps English (the retain bound), replace trades it away
    assert ext600["languages"]["en"]["tokens_per_word"] <= base["languages"]["en"]["tokens_per_word"] * 1.01
    assert rep["languages"]["en"]["tokens_per_word"] > base["languages"]["en"]["tokens_per_word"]
    assert m["selection"]["retain_met"] is True
    assert set(m["languages"]) == {"az", "en"} and set(m["dead_tokens"]["vocab_used_frac"]) == {"train", "az", "en"}
    table = re.sub(r" *\| *", " | ", (chatml_run.path / "comparison.md").read_text())  # one space around each cell
    assert "| extend (selected) |" in table and "en tokens/word" in table


def test_every_strategy_round_trips_both_dev_sets(tmp_path, data_root, smollm2_dir, tiny_tokenizer_dir):
    """decode(encode(x)) == x on FLORES az and en for base, extend and replace, over a ChatML and a Llama 3 base."""
    texts = {
        lang: list(iter_texts(str(data_root / FLORES), text_field=field))
        for lang, field in (("az", "azj_Latn"), ("en", "eng_Latn"))
    }
    lines = Counter(list(iter_texts(str(data_root / "az/train/azwiki_sentences_cv_extractor.txt")))[:3000])
    for folder in (smollm2_dir, tiny_tokenizer_dir):
        tok, doc = load(folder, str(folder))
        from dilforge_shared.families import detect_family
        from dilforge_tokenizer import base as base_tok
        from dilforge_tokenizer import continued, llama3, pretokens

        family = detect_family(base_tok.vocab_tokens(doc), str(folder))
        base = Base(folder=folder, uri=str(folder), tok=tok, doc=doc, family=family)
        config = TokenizerConfig(
            strategy="extend", compare_with=["replace"], corpora=[{"uri": "x"}], num_new_tokens=[200], vocab_sizes=[800]
        )
        words = pretokens.of_lines(lines, tok)
        seg = continued.segment(words, doc)
        candidates = [
            stage_candidates.base_candidate(base),
            *stage_candidates.extend_candidates(config, seg, base, False),
            *stage_candidates.replace_candidates(
                config, pretokens.of_lines(lines, llama3.empty_bpe()), family, base, False
            ),
        ]
        assert [c.strategy for c in candidates] == ["base", "extend", "replace"]
        for cand in candidates:
            for lang, sents in texts.items():
                encodings = cand.tok.encode_batch(sents, add_special_tokens=False)
                assert [cand.tok.decode(e.ids, skip_special_tokens=False) for e in encodings] == sents, (
                    folder,
                    cand.strategy,
                    lang,
                )
        replace = candidates[-1].tok
        for special in family.specials:
            assert replace.token_to_id(special) is not None, (folder, special)
