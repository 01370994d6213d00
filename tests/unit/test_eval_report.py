"""The report lists every model and text set it was given, leads with the per-language headline, shows upstream
step-0 and tokenizer-strategy figures, embeds its plots, and renders in Chromium."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import metrics_samples
import pytest
from dilforge_cpt.metrics import CptMetrics
from dilforge_eval import compare
from dilforge_eval.metrics import BpbFigures
from dilforge_eval.report import write_report
from dilforge_tokenizer.metrics import TokenizerMetrics

_spec = importlib.util.spec_from_file_location(
    "render_report", Path(__file__).resolve().parents[2] / "scripts" / "render_report.py"
)
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)

MODELS = ["base", "cpt", "sft"]
SETS = ["flores", "legal", "wiki", "flores-en"]
LANGS = {"flores": "az", "legal": "az", "wiki": "az", "flores-en": "en"}
# cpt: az sets 20 % lower than base, English 50 % higher; sft: az 25 % lower, English 40 % higher
BPB = {
    "base": {"flores": 3.0, "legal": 2.0, "wiki": 2.5, "flores-en": 1.0},
    "cpt": {"flores": 2.4, "legal": 1.6, "wiki": 2.0, "flores-en": 1.5},
    "sft": {"flores": 2.25, "legal": 1.5, "wiki": 1.875, "flores-en": 1.4},
}


def step0_bpb(published: dict):
    """eval's step-0 section of a published CPT metrics dict."""
    return compare.step0_bpb(compare.CptRead.model_validate(published).transplant)


def tokenizer_comparison(published: dict):
    """eval's strategies section of a published tokenizer metrics dict."""
    return compare.tokenizer_comparison(compare.TokenizerRead.model_validate(published), published["comparison"])


def fake_metrics():
    """Every section the report shows, validated as the stage validates it (EvalMetrics)."""
    tm = {
        "tokens_per_word": 2.1,
        "bytes_per_token": 3.2,
        "share_words_3plus": 0.2,
        "num_tokens": 100,
        "num_words": 48,
        "num_bytes": 320,
        "num_texts": 5,
        "num_words_3plus": 10,
    }
    morph = {
        "boundary_recall": 0.5,
        "inside_morpheme_rate": 0.3,
        "exact_segmentation_rate": 0.1,
        "num_words": 10,
        "num_gold_boundaries": 8,
        "num_gold_hit": 4,
        "num_token_boundaries_decidable": 10,
        "num_token_boundaries_inside": 3,
        "num_words_exact": 1,
        "num_words_fully_known": 10,
    }
    m = {
        "models": {m: metrics_samples.eval_model(f"origin-{m}") for m in MODELS},
        "tokenizers": {
            "tokenizer": {"origin": "artifact t1", "vocab_size": 4000, "aliases": ["cpt", "sft"]},
            "base": {"origin": "artifact m1", "vocab_size": 2048, "aliases": []},
        },
        "text_sets": {s: {"uri": f"/d/{s}", "language": LANGS[s], "num_docs": 3, "num_bytes": 300} for s in SETS},
        "bpb": {m: {s: metrics_samples.bpb_figures(v) for s, v in sets.items()} for m, sets in BPB.items()},
        "tokenizer_metrics": {t: {s: tm for s in SETS} for t in ("tokenizer", "base")},
        "parity": {"base": {"flores": {"tokens_az": 150, "tokens_en": 100, "parity": 1.5, "num_pairs": 3}}},
        "morph": {"base": {"seg.tsv": morph}},
        "generation": {
            m: {
                "greedy": {
                    "num_generations": 2,
                    "num_words": 10.0,
                    "distinct_1": 0.5,
                    "distinct_2": 0.6,
                    "repeated_3gram_rate": 0.2,
                }
            }
            for m in MODELS
        },
        "vocab_sweep": {
            "selected": 2000,
            "rows": [
                {"vocab_size": v, "sets": {"heldout": metrics_samples.set_figures(3 - v / 2000)}}
                for v in (1000, 2000, 4000)
            ],
            "base": None,
        },
        "curves": {"cpt": {"loss": [[1, 5.0], [2, 4.0], [3, 3.5]]}, "sft": {"train_loss": [[1, 2.0], [2, 1.5]]}},
        "cost": {"cpt": {"seconds_train": 12.5}},
        "skipped": [],
        "seconds": {"total": 1.0},
        "transplant": step0_bpb(
            CptMetrics.model_validate(
                metrics_samples.sample(
                    "cpt",
                    transplant={
                        **metrics_samples.sample("cpt")["transplant"],
                        "step0_leakage": {
                            "offset": {
                                "en": {
                                    "bpb_base_model": 1.25,
                                    "bpb_extended": 1.30,
                                    "extended_vs_base": 1.04,
                                    "bpb_base_tokenization": 1.26,
                                    "base_tokenization_vs_base": 1.008,
                                }
                            }
                        },
                    },
                )
            ).model_dump()
        ),
        "tokenizer_comparison": tokenizer_comparison(
            TokenizerMetrics.model_validate(
                metrics_samples.sample(
                    "tokenizer",
                    comparison=[
                        {
                            "strategy": s,
                            "vocab_size": v,
                            "num_new_tokens": n,
                            "selected": s == "extend",
                            "dead_new_tokens_frac": d,
                            "languages": {
                                "az": {"tokens_per_word": az, "bytes_per_token": 4.0, "frac_words_3plus": 0.1},
                                "en": {"tokens_per_word": en, "bytes_per_token": 4.5, "frac_words_3plus": 0.05},
                            },
                        }
                        for s, v, n, d, az, en in (
                            ("base", 49152, 0, None, 3.44, 1.24),
                            ("extend", 75000, 25848, 0.017, 1.53, 1.22),
                            ("replace", 50000, 50000, 0.0, 1.48, 2.45),
                        )
                    ],
                    dead_tokens={"num_new_dead": 439, "per_corpus": {"wiki": {"frac_vocab_used": 0.61}}},
                )
            ).model_dump()
        ),
    }
    bpb = {model: {s: BpbFigures(**f) for s, f in sets.items()} for model, sets in m["bpb"].items()}
    changes = compare.bpb_changes(bpb, "base", LANGS)
    m.update(bpb_change=changes, headline=compare.headline(changes, "base", LANGS, "az"))
    return metrics_samples.eval_metrics(**m)


def generations() -> list[dict]:
    return [
        {
            "model": m,
            "mode": "greedy",
            "prompt_id": "p1",
            "kind": "chat",
            "prompt": "Salam <b>",
            "output": f"cavab {m} & <script>\nA | B",
        }
        for m in MODELS
    ]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    paths = write_report(fake_metrics(), generations(), out, "test report")
    return out, paths


def markdown(path: Path) -> str:
    """The Markdown with one space either side of each cell (tabulate pads columns to their width)."""
    return re.sub(r" *\| *", " | ", path.read_text())


def test_report_lists_every_model_and_text_set(report):
    _, paths = report
    html = paths["html"].read_text()
    md = markdown(paths["md"])
    for doc in (html, md):
        for name in MODELS + SETS:
            assert name in doc
    bpb_rows = re.findall(r"<tr><td>(base|cpt|sft) *</td><td>(flores|legal|wiki|flores-en) *</td>", html)
    assert set(bpb_rows) == {(m, s) for m in MODELS for s in SETS}  # one row per model and set
    assert "change vs base" in html and "(mean)" not in html and "(mean)" not in md
    assert '<span class="better">-20.0%</span>' in html and '<span class="worse">+50.0%</span>' in html
    assert "&lt;script&gt;" in html and "<script>" not in html  # generations are escaped
    assert "| cavab base & <script> ⏎ A \\| B" in paths["md"].read_text()  # one Markdown row, one cell


def test_headline_comes_first_with_gain_and_retention_per_set(report):
    _, paths = report
    html = paths["html"].read_text()
    md = markdown(paths["md"])
    assert html.index("<h2>Headline</h2>") < html.index("<h2>Bits per byte</h2>")
    assert "Azerbaijani gain: BPB vs base on flores" in html and "English retention: BPB vs base on flores-en" in html
    row = re.search(r"<tr><td>cpt *</td>(.*?)</tr>", html).group(1)
    assert re.findall(r'<td style="text-align: right;"><span class="(\w+)">(.*?)</span>', row) == [
        ("better", "3.000 → 2.400 (-20.0%)"),
        ("worse", "1.000 → 1.500 (+50.0%)"),
    ]
    assert "| sft | 3.000 → 2.250 (-25.0%) | 1.000 → 1.400 (+40.0%) |" in md


def test_step0_and_tokenizer_strategies_are_shown(report):
    _, paths = report
    md = markdown(paths["md"])
    assert "| mean_of_pieces (trained) | 2.8100 |" in md and "| random | 5.2700 |" in md
    assert (
        "| strategy | vocab size | new tokens | selected | az tokens/word | az bytes/token | az words in 3+ tokens "
        "| en tokens/word | en bytes/token | en words in 3+ tokens | dead new tokens |"
    ) in md
    assert "| extend | 75000 | 25848 | yes | 1.530 | 4.000 | 10.0% | 1.220 | 4.500 | 5.0% | 1.7% |" in md
    assert "| per_corpus.wiki.frac_vocab_used | 0.6100 |" in md
    assert "| offset | en | 1.2500 | 1.3000 | 1.0400 | 1.2600 | 1.0080 |" in md  # the step-0 leakage table


def test_report_is_self_contained_with_png_files(report):
    out, paths = report
    html = paths["html"].read_text()
    names = {
        "fertility_per_tokenizer.png",
        "fertility_per_vocab_size.png",
        "bpb_per_model.png",
        "morpheme_boundary_recall.png",
        "training_curves.png",
    }
    assert {p.name for p in (out / "plots").iterdir()} == names
    assert html.count("data:image/png;base64,") == len(names)
    assert not re.search(r"(src|href)=\"(?!data:)", html)  # no external resource
    for n in names:
        assert (out / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plots/{n}" in paths["md"].read_text()


def test_report_without_models_still_renders(tmp_path):
    full = fake_metrics()
    m = metrics_samples.eval_metrics(
        models={},
        bpb={},
        generation={},
        tokenizer_metrics=full.model_dump()["tokenizer_metrics"],
        text_sets=full.model_dump()["text_sets"],
    )
    paths = write_report(m, [], tmp_path, "tokenizers only")
    html = paths["html"].read_text()
    assert "Tokenizer efficiency" in html and "Bits per byte" not in html and "Headline" not in html


@pytest.mark.skipif(
    render.chromium() is None and not os.environ.get("CI"),  # CI installs it: there, a missing one fails
    reason="needs Debian package chromium (apt-get install -y chromium)",
)
def test_report_renders_in_headless_chromium(report, tmp_path):
    _, paths = report
    dom = render.dump_dom(paths["html"])
    assert "Bits per byte" in dom and all(m in dom for m in MODELS)
    png = render.screenshot(paths["html"], tmp_path / "shot.png", height=2500)
    from matplotlib.image import imread

    img = imread(str(png))
    assert img.shape[0] == 2500 and img.shape[1] == 1300
    assert img[..., :3].std() > 0.05  # not a blank page: text, tables and plots drew
