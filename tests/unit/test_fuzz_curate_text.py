"""Fuzz properties of curated text (budget: tests/fuzzing.py): a contact in any Azerbaijani form, digit script
and spacing leaves none of its digits behind; control-token strings never survive normalising, however they are
nested or spaced; plain numbers are never touched."""

from __future__ import annotations

import re
import unicodedata

from dilforge_curate.config import RedactConfig
from dilforge_curate.steps import ContactRedactor, Normaliser
from dilforge_shared import CONTROL_TOKEN
from fuzzing import FUZZ
from hypothesis import given
from hypothesis import strategies as st

REDACT = ContactRedactor(RedactConfig())
SCRIPTS = ("0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "０１２３４５６７８９", "०१२३४५६७८९")
SEPARATORS = (" ", "-", ".", "\u00a0", "\u202f", "\u200d", "\u200b", "", " - ", "–", "/")
CODES = ("10", "12", "50", "51", "55", "60", "70", "77", "99")
AZ_LETTERS = "abcçdeəfgğhxıijkqlmnoöprsştuüvyz"


def _ascii_digits(text: str) -> str:
    return "".join(str(unicodedata.decimal(c)) if unicodedata.category(c) == "Nd" else c for c in text)


@st.composite
def az_phone(draw) -> tuple[str, str]:
    """(the number as written, its 9 national digits)."""
    code, rest = draw(st.sampled_from(CODES)), draw(st.text("0123456789", min_size=7, max_size=7))
    groups = draw(
        st.sampled_from(
            [
                ["+994", code, rest[:3], rest[3:5], rest[5:]],
                ["994", code, rest[:3], rest[3:5], rest[5:]],
                ["0" + code, rest[:3], rest[3:5], rest[5:]],
                ["0", code, rest[:3], rest[3:5], rest[5:]],
                ["(0" + code + ")", rest[:3], rest[3:5], rest[5:]],
                [code, rest[:3], rest[3:5], rest[5:]],
                ["+994", code, *rest],
                ["+994" + code + rest],
            ]
        )
    )
    sep = draw(st.sampled_from(SEPARATORS if groups[0] != code else [" ", "-", "\u00a0", "\u200d"]))
    script = draw(st.sampled_from(SCRIPTS))
    written = sep.join(groups).translate(str.maketrans("0123456789+", script + draw(st.sampled_from("+＋"))))
    return written, code + rest


# frames with other numbers just before the phone, in the same run of digit groups (fewer than 7 digits, so none
# of the phone's own digits can come from the frame)
FRAMES = ["Zəng edin: {} və ya yazın.", "Tel {}", "{}", "Əlaqə ({}), hər gün", "Tel. 1) {} 2) -", "Otaq 12 {}"]
FRAMES += ["saat 14:00 {}", "Qiymət 250 {} manat"]


@given(az_phone(), st.sampled_from(FRAMES))
@FUZZ
def test_an_azerbaijani_phone_in_any_form_leaves_no_digits(phone, frame):
    written, digits = phone
    out = REDACT.format(frame.format(written))
    assert "<PHONE>" in out and digits[2:] not in re.sub(r"\D", "", _ascii_digits(out)), (written, out)


@given(
    st.text(AZ_LETTERS + "0123456789", min_size=1, max_size=12),
    st.text(AZ_LETTERS, min_size=1, max_size=12),
    st.sampled_from(["az", "com", "info", "рф"]),
    st.booleans(),
    st.sampled_from(["", "-a", "-ya", "-dan", "-ə", "'a"]),  # an Azerbaijani case ending after the address
)
@FUZZ
def test_a_unicode_e_mail_is_replaced(local, domain, tld, quoted, ending):
    address = (f'"{local} {local}"' if quoted else local) + f"@{domain}.{tld}"
    out = REDACT.format(f"Yazın: {address}{ending}, cavab verəcəyik.")
    assert out == f"Yazın: <EMAIL>{ending}, cavab verəcəyik.", (address, out)


@given(st.integers(0, 10**8), st.sampled_from([" ", "\u00a0", ""]))
@FUZZ
def test_sums_stay(amount, sep):
    sum_text = f"{amount:,}".replace(",", sep)
    text = f"Büdcə {sum_text} manat, {amount % 2000 + 1000}-ci il."
    assert REDACT.format(text) == text


TOKENS = ("<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>")


@given(st.lists(st.tuples(st.sampled_from(TOKENS), st.integers(0, 60)), min_size=1, max_size=6), st.booleans())
@FUZZ
def test_control_tokens_never_survive_normalising(insertions, whitespace):
    text = "Bakı Azərbaycanın paytaxtıdır və Xəzər dənizinin sahilində yerləşir."
    for token, at in insertions:  # nested into each other as well: a later one may split an earlier one
        at = at % (len(text) + 1)
        text = text[:at] + token + text[at:]
    out = Normaliser(fix_encoding=True, unicode_form="NFKC", whitespace=whitespace).format(text)
    assert CONTROL_TOKEN.search(out) is None, out
