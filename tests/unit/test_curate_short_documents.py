"""Clean text kept: the minimum length and the line-ending rule are visible choices (config, data card), lines
ending in a closing quote end a sentence, and language ID keeps Azerbaijani that lingua calls Turkish when the
call is close or the text is written in Azerbaijani's own letters, while Turkish stays out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from datatrove.data import Document
from dilforge_curate import report
from dilforge_curate.config import CurateConfig
from dilforge_curate.metrics import CurateMetrics
from dilforge_curate.steps import LinguaFilter

# written for this test: Turkish news sentences, one naming an Azerbaijani (Əliyev)
TURKISH = [
    "Cumhurbaşkanı bugün yaptığı açıklamada ekonomik büyümenin devam edeceğini söyledi.",
    "Milli takım dün akşam oynanan maçta rakibini iki golle mağlup etti.",
    "Bakü'deki toplantıya Əliyev ve Erdoğan katıldı; iki lider ortak bir bildiri imzaladı.",
]
AZ_SCHWA = "Mərkəzi Bank dünən faiz dərəcəsini dəyişmədən saxladı."
AZ_PLAIN = "Bu gün Bakıda yağış yağıb, hava soyuq olub"  # no ə: only the margin can keep it


def _lid(**kw):
    return LinguaFilter("az", CurateConfig(corpora=[{"uri": "x"}]).language_id.model_copy(update=kw))


def _fixed(lid: LinguaFilter, scores: dict[str, float]) -> LinguaFilter:
    """lid answering `scores` (lingua's confidence values, most likely first) for any text."""
    lid._build()
    values = [
        SimpleNamespace(language=lang, value=scores[code])
        for code in sorted(scores, key=scores.get, reverse=True)
        for lang in [next(v for v in _LANGS if v.iso_code_639_1.name.lower() == code)]
    ]
    lid._detector = SimpleNamespace(compute_language_confidence_values=lambda text: values)
    return lid


from lingua import Language  # noqa: E402

_LANGS = list(Language.all())


@pytest.mark.parametrize(
    ("text", "scores", "kept"),
    [
        (AZ_PLAIN, {"tr": 0.55, "az": 0.45}, True),  # within the margin of its relative
        (AZ_PLAIN, {"tr": 0.75, "az": 0.25}, False),
        (AZ_SCHWA, {"tr": 1.0, "az": 0.0}, True),  # its own letters
        (TURKISH[2], {"tr": 0.97, "az": 0.03}, False),  # one Azerbaijani name is not Azerbaijani text
        (AZ_SCHWA, {"en": 0.55, "az": 0.45}, False),  # English is no relative
    ],
)
def test_azerbaijani_that_lingua_calls_turkish_is_kept_when_close_or_in_its_own_letters(text, scores, kept):
    doc = Document(text=text, id="d")
    verdict = _fixed(_lid(), scores).filter(doc)
    assert (verdict is True) is kept
    assert doc.metadata["language"] == max(scores, key=scores.get)


def test_without_relatives_the_rule_is_lingua_s_score_alone():
    assert _fixed(_lid(relatives=[]), {"tr": 1.0, "az": 0.0}).filter(Document(text=AZ_SCHWA, id="d")) == (
        False,
        "language_tr",
    )


@pytest.mark.parametrize("text", TURKISH)
def test_turkish_stays_out(text):
    assert _lid().filter(Document(text=text, id="d")) == (False, "language_tr")


def test_line_endings_and_minimum_length_are_config_choices_with_reasons():
    from datatrove.pipeline.filters import FineWebQualityFilter
    from datatrove.utils.text import TERMINAL_PUNCTUATION
    from dilforge_curate.steps import WordSplitter

    q = CurateConfig(corpora=[{"uri": "x"}]).quality
    assert q.min_words == 20 and "Gopher and FineWeb use 50" in CurateConfig.model_fields["quality"].annotation.model_fields["min_words"].description  # fmt: skip
    quoted = "Nazir jurnalistlərə dedi: «Bu il yeni məktəblər tikiləcək və müəllimlərin maaşı artırılacaq.»"

    def lines(closers: str):
        step = FineWebQualityFilter(
            line_punct_thr=q.line_punct_thr, stop_chars=(*TERMINAL_PUNCTUATION, *closers), language=WordSplitter()
        )
        return step.filter(Document(text=quoted, id="d"))

    assert lines(q.line_end_closers) is True and lines("") == (False, "line_punct_ratio")


def test_the_data_card_shows_the_length_and_line_rules(tmp_path):
    config = CurateConfig(corpora=[{"uri": "web.jsonl", "name": "web"}], quality={"min_words": 35})
    metrics = CurateMetrics(
        language="az", documents_read=10, chars_read=100, documents_kept=5, chars_kept=50, words_kept=9, steps=[],
        repairs={"encoding_repaired": 0, "unicode_normalised": 0, "whitespace_normalised": 0}, redacted={},
        per_source={"web": {"read": 10, "kept": 5}}, num_shards=1, seconds={},
    )  # fmt: skip
    report.write(tmp_path, config, metrics)
    card = (tmp_path / "README.md").read_text()
    assert "documents of 35 to 100,000 words are kept (quality.min_words" in card
    assert "Gopher's and FineWeb's minimum is 50" in card
    assert "at least 18.8% of a document's lines must end a sentence (quality.line_punct_thr" in card
    assert "or within 0.2 of tr" in card


# a clean news paragraph with a date, a rate and a decimal, as news pages write them
NUMBERS = (
    "Bakı, 5 oktyabr 2023. Azərbaycan Respublikasının Mərkəzi Bankı uçot dərəcəsini 9 faizdən 8,75 faizə endirib. "
    "Qərar bankın İdarə Heyətinin iclasında qəbul olunub və bu barədə rəsmi məlumat yayılıb."
)


def test_a_news_paragraph_with_dates_and_sums_has_enough_words_holding_a_letter():
    """The word splitter makes each comma and full stop a word; the letter share is over words, not punctuation."""
    from datatrove.pipeline.filters import GopherQualityFilter
    from dilforge_curate.steps import QualityFilter, WordSplitter

    q = CurateConfig(corpora=[{"uri": "x"}]).quality
    quality = QualityFilter(
        min_doc_words=q.min_words, max_doc_words=q.max_words, min_avg_word_length=q.min_avg_word_length,
        max_avg_word_length=q.max_avg_word_length, max_symbol_word_ratio=q.max_symbol_word_ratio,
        max_non_alpha_words_ratio=q.max_non_alpha_words_ratio, min_stop_words=q.min_stop_words,
        stop_words=q.stop_words, language=WordSplitter(),
    )  # fmt: skip
    stock = GopherQualityFilter(
        max_non_alpha_words_ratio=q.max_non_alpha_words_ratio, min_stop_words=0, min_doc_words=0,
        language=WordSplitter(),
    )  # fmt: skip
    assert stock.filter(Document(NUMBERS, "d")) == (False, "gopher_below_alpha_threshold")  # what the stage did
    assert quality.filter(Document(NUMBERS, "d")) is True
    table = "Cədvəl və nəticələr bu il: " + " ".join(str(1000 + i * 37) for i in range(30))  # numbers, not prose
    assert quality.filter(Document(table, "d")) == (False, "gopher_below_alpha_threshold")
