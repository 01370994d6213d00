"""The report lists every model and text set it was given, embeds its plots, and renders in Chromium."""

from __future__ import annotations

import re

import os

import pytest
from dilforge_eval.render import chromium, dump_dom, screenshot
from dilforge_eval.report import write_report

MODELS = ["base", "cpt", "sft"]
SETS = ["flores", "legal", "wiki"]


def fake_metrics() -> dict:
    tm = {"tokens_per_word": 2.1, "bytes_per_token": 3.2, "share_words_3plus": 0.2, "num_tokens": 100, "num_words": 48,
          "num_bytes": 320, "num_texts": 5, "num_words_3plus": 10}
    morph = {"boundary_recall": 0.5, "inside_morpheme_rate": 0.3, "exact_segmentation_rate": 0.1, "num_words": 10,
             "num_gold_boundaries": 8}
    return {
        "models": {m: {"origin": f"origin-{m}"} for m in MODELS},
        "tokenizers": {"tokenizer": {"aliases": ["cpt", "sft"]}, "base": {"aliases": []}},
        "text_sets": {s: {"uri": f"/d/{s}", "num_docs": 3, "num_bytes": 300} for s in SETS},
        "bpb": {m: {s: {"bpb": (1.0 + i / 10) * (1.0 + j / 10)} for j, s in enumerate(SETS)} for i, m in enumerate(MODELS)},
        "tokenizer_metrics": {t: {s: tm for s in SETS} for t in ("tokenizer", "base")},
        "parity": {"base": {"flores": {"tokens_az": 150, "tokens_en": 100, "parity": 1.5, "num_pairs": 3}}},
        "morph": {"base": {"seg.tsv": morph}},
        "generation": {m: {"greedy": {"num_generations": 2, "num_words": 10.0, "distinct_1": 0.5, "distinct_2": 0.6,
                                      "repeated_3gram_rate": 0.2}} for m in MODELS},
        "vocab_sweep": {"selected": 2000, "rows": [{"vocab_size": v, "sets": {"heldout": {"tokens_per_word": 3 - v / 2000}}}
                                                   for v in (1000, 2000, 4000)], "base": None},
        "curves": {"cpt": {"loss": [[1, 5.0], [2, 4.0], [3, 3.5]]}, "sft": {"train_loss": [[1, 2.0], [2, 1.5]]}},
        "cost": {"cpt": {"seconds_train": 12.5}},
        "skipped": [],
    }


def generations() -> list[dict]:
    return [{"model": m, "mode": "greedy", "prompt_id": "p1", "kind": "chat", "prompt": "Salam <b>",
             "output": f"cavab {m} & <script>"} for m in MODELS]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    paths = write_report(fake_metrics(), generations(), out, "test report")
    return out, paths


def test_report_lists_every_model_and_text_set(report):
    _, paths = report
    html = paths["html"].read_text()
    md = paths["md"].read_text()
    for doc in (html, md):
        for name in MODELS + SETS:
            assert name in doc
    bpb_rows = re.findall(r"<tr><td>(base|cpt|sft)</td>", html)
    assert set(bpb_rows) == set(MODELS)
    assert "change vs base" in html and "+10.0% (mean)" in html   # cpt is 0.1 above base on each set
    assert "&lt;script&gt;" in html and "<script>" not in html      # generations are escaped


def test_report_is_self_contained_with_png_files(report):
    out, paths = report
    html = paths["html"].read_text()
    names = {"fertility_per_tokenizer.png", "fertility_per_vocab_size.png", "bpb_per_model.png",
             "morpheme_boundary_recall.png", "training_curves.png"}
    assert {p.name for p in (out / "plots").iterdir()} == names
    assert html.count("data:image/png;base64,") == len(names)
    assert not re.search(r"(src|href)=\"(?!data:)", html)   # no external resource
    for n in names:
        assert (out / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plots/{n}" in paths["md"].read_text()


def test_report_without_models_still_renders(tmp_path):
    m = {"tokenizer_metrics": fake_metrics()["tokenizer_metrics"], "text_sets": fake_metrics()["text_sets"]}
    paths = write_report(m, [], tmp_path, "tokenizers only")
    html = paths["html"].read_text()
    assert "Tokenizer efficiency" in html and "Bits per byte" not in html


@pytest.mark.skipif(chromium() is None and not os.environ.get("CI"),  # CI installs it: there, a missing one fails
                    reason="needs Debian package chromium (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(report, tmp_path):
    _, paths = report
    dom = dump_dom(paths["html"])
    assert "Bits per byte" in dom and all(m in dom for m in MODELS)
    png = screenshot(paths["html"], tmp_path / "shot.png", height=2500)
    from matplotlib.image import imread
    img = imread(str(png))
    assert img.shape[0] == 2500 and img.shape[1] == 1300
    assert img[..., :3].std() > 0.05     # not a blank page: text, tables and plots drew
