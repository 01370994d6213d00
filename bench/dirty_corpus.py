"""A dirty web-like corpus with known answers, built from held-out text the pipeline never trains on.

Clean Azerbaijani documents come from the dev sets (FLORES-200 dev paragraphs and X-WMT news sentences, which no
stage trains on); the English sides of the same sets give English documents. Then, labelled per line:

- exact duplicates (1-3 extra copies) and near duplicates (whitespace/case/punctuation changes, a footer line,
  one word swapped, one sentence dropped) of some clean documents;
- clean documents stored mis-decoded (their UTF-8 bytes read as cp1252, as a wrongly configured crawler does);
- clean documents carrying contact details (Azerbaijani and international phone numbers, e-mail addresses, card
  numbers);
- junk: navigation boilerplate, symbol spam, keyword spam, tiny documents.

    python bench/dirty_corpus.py --data ../shared/data --out /tmp/dirty      # web.jsonl + labels.json

`score()` checks a curated output against the labels (used by tests/integration/test_curate.py and bench/curate.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
from pathlib import Path

CONTACTS = (  # (what a line says, the details it carries)
    ("Ətraflı məlumat üçün {p} nömrəsinə zəng edin və ya {e} ünvanına yazın.", ("+994 50 123 45 67", "info@xeber.az")),
    ("Qaynar xətt: {p}, e-poçt: {e}.", ("(012) 493-12-34", "qaynar.xett@azercell.com")),
    ("Müraciət üçün {p} və {e} ünvanından istifadə edin.", ("050-321-76-54", "muraciet@gov.az")),
    ("Bizimlə əlaqə: {p} (WhatsApp), {e}", ("+994(55)2223344", "satis-2024@mail.ru")),
    ("Türkiyə ofisi: {p}, Moskva ofisi: {e}.", ("+90 532 123 45 67", "+7 495 123-45-67")),
    ("Ödənişi {p} nömrəli karta köçürün və qəbzi {e} ünvanına göndərin.", ("4169 7388 1234 5670", "odenis@bank.az")),
    ("Sifariş üçün zəng: {p}; faks: {e}", ("0551234567", "+994 12 598 41 00")),
    ("Kart: {p}, əlaqə nömrəsi {e}.", ("5522-0412-3456-7891", "994 70 765 43 21")),
)
NAV = ("Ana səhifə", "Xəbərlər", "Siyasət", "İqtisadiyyat", "İdman", "Mədəniyyət", "Haqqımızda", "Əlaqə", "Reklam",
       "Arxiv", "Video", "Foto", "Daxil ol", "Qeydiyyat", "Axtarış", "Bütün hüquqlar qorunur © 2024")  # fmt: skip
SPAM_WORDS = ("ucuz", "kredit", "endirim", "pulsuz", "qazan", "bonus", "kazino", "sürətli")
SYMBOLS = ("★", "#", "$", "%", "&", "@@", "!!!", "***", "|", "~~", "+++", "###", "...")
TINY = ("Salam!", "Təşəkkürlər.", "Bəli", "Ətraflı", "Oxu", "Paylaş | Şərh yaz", "Davamı...", "Yüklə", "Səhifə 2",
        "Ok")  # fmt: skip


def _detok(sentence: str) -> str:
    """X-WMT is pre-tokenised ('söylədi .'): join punctuation back."""
    s = re.sub(r" ([,.!?:;%)])", r"\1", sentence.strip())
    s = re.sub(r"([(]) ", r"\1", s)
    return re.sub(r'" (.*?) "', r'"\1"', s)


def _dev_documents(data: Path) -> tuple[list[str], list[str]]:
    """(Azerbaijani documents, English documents) of about 100 words, as web pages are: FLORES dev, 5 paragraphs
    a document (one per line); X-WMT, 10 sentences a document in two paragraphs."""
    az, en = [], []
    with open(data / "az/dev/flores200.dev.partial_from_sib200.tsv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    for i in range(0, len(rows) - 4, 5):
        az.append("\n".join(r["azj_Latn"] for r in rows[i : i + 5]))
        en.append("\n".join(r["eng_Latn"] for r in rows[i : i + 5]))
    xaz = (data / "az/dev/xwmt_test.az-en.az.txt").read_text(encoding="utf-8").splitlines()
    xen = (data / "az/dev/xwmt_test.az-en.en.txt").read_text(encoding="utf-8").splitlines()
    for i in range(0, len(xaz) - 9, 10):
        for side, out in ((xaz, az), (xen, en)):
            s = [_detok(x) for x in side[i : i + 10]]
            out.append(" ".join(s[:5]) + "\n" + " ".join(s[5:]))
    return az, en


def mis_decode(text: str) -> str:
    """UTF-8 bytes read as cp1252, bytes cp1252 leaves undefined passed through as Latin-1 (what browsers do)."""
    out = []
    for b in text.encode("utf-8"):
        try:
            out.append(bytes([b]).decode("cp1252"))
        except UnicodeDecodeError:
            out.append(chr(b))
    return "".join(out)


def _near(text: str, rng: random.Random, how: int) -> str:
    if how == 0:  # whitespace, case and punctuation
        return text.replace(". ", ".  ").replace(",", " ,").lower()
    if how == 1:  # a footer
        return text + "\nMənbə: xeberler.az"
    if how == 2:  # one word swapped
        words = text.split(" ")
        i = rng.randrange(1, len(words) - 1)
        words[i] = rng.choice(("bu", "həmin", "yeni", "böyük"))
        return " ".join(words)
    sentences = re.split(r"(?<=[.!?]) ", text)  # one sentence dropped
    if len(sentences) > 4:
        del sentences[rng.randrange(1, len(sentences) - 1)]
    return " ".join(sentences)


def _junk(kind: str, rng: random.Random) -> str:
    if kind == "boilerplate":
        return "\n".join(rng.sample(NAV, 12))
    if kind == "symbols":
        return " ".join(rng.choice(SYMBOLS) if rng.random() < 0.7 else rng.choice(SPAM_WORDS) for _ in range(80))
    if kind == "spam":
        phrase = " ".join(rng.sample(SPAM_WORDS, 3))
        return " ".join([phrase] * 25) + " " + rng.choice(TINY)
    return rng.choice(TINY)


def build(data: Path, out: Path, seed: int = 0) -> dict:
    """Write out/web.jsonl and out/labels.json; returns the labels: per line {kind, group, original?, contacts?}."""
    rng = random.Random(seed)
    az, en = _dev_documents(data)
    rng.shuffle(az)
    rng.shuffle(en)
    docs: list[tuple[str, dict]] = []
    for i, text in enumerate(az):  # 160 documents
        label = {"kind": "clean", "group": f"c{i}", "original": text}
        if i < 15:  # stored mis-decoded: must come back repaired
            docs.append((mis_decode(text), {**label, "kind": "mojibake"}))
            continue
        if 15 <= i < 15 + len(CONTACTS) * 3:
            template, details = CONTACTS[(i - 15) % len(CONTACTS)]
            line = template.format(p=details[0], e=details[1])
            docs.append((text + "\n" + line, {**label, "kind": "contact", "contacts": list(details)}))
            continue
        docs.append((text, label))
        if 40 <= i < 65:  # exact duplicates
            docs += [(text, {**label, "kind": "exact_dup"}) for _ in range(rng.randint(1, 3))]
        elif 65 <= i < 100:  # near duplicates
            docs += [(_near(text, rng, (i + k) % 4), {**label, "kind": "near_dup"}) for k in range(rng.randint(1, 2))]
    docs += [(text, {"kind": "english", "group": f"e{i}"}) for i, text in enumerate(en[:60])]
    for kind in ("boilerplate", "symbols", "spam", "tiny"):
        docs += [(_junk(kind, rng), {"kind": "junk", "junk": kind, "group": f"j-{kind}{i}"}) for i in range(20)]
    rng.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "web.jsonl", "w", encoding="utf-8") as f:
        for text, _ in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    labels = {str(i): label for i, (_, label) in enumerate(docs)}
    (out / "labels.json").write_text(json.dumps(labels, ensure_ascii=False), encoding="utf-8")
    return labels


MOJIBAKE = re.compile("É™|Ä±|Ã¶|Ã¼|Ã§|Ã‡|Ã–|Ãœ|Å\u0178|ÅŸ|Ä\u0178|ÄŸ|Ä°|Æ")


def score(records: list[dict], labels: dict, source: str = "web") -> dict:
    """Check a curated output (records with `text` and `id` '<source>:<line>') against the labels."""
    kept_lines = [int(r["id"].split(":", 1)[1]) for r in records if r["id"].startswith(f"{source}:")]
    kept = {str(i) for i in kept_lines}
    groups: dict[str, list[str]] = {}
    for line, label in labels.items():
        groups.setdefault(label["group"], []).append(line)

    def kept_in(group: str) -> int:
        return sum(line in kept for line in groups[group])

    clean_groups = sorted({lab["group"] for lab in labels.values() if lab["group"].startswith("c")})
    exact = sorted({lab["group"] for lab in labels.values() if lab["kind"] == "exact_dup"})
    near = sorted({lab["group"] for lab in labels.values() if lab["kind"] == "near_dup"})
    english = [line for line, lab in labels.items() if lab["kind"] == "english"]
    junk = [line for line, lab in labels.items() if lab["kind"] == "junk"]
    by_line = {str(i): r["text"] for i, r in zip(kept_lines, records, strict=True)}
    contacts = [c for lab in labels.values() if lab["kind"] == "contact" for c in lab["contacts"]]
    digits = {re.sub(r"\D", "", c) for c in contacts if "@" not in c}
    leaks = [c for c in contacts if any(c in t for t in by_line.values())]
    leaks += [d for d in digits if any(d in re.sub(r"\D", "", t) for t in by_line.values())]
    mojibake = [line for line, lab in labels.items() if lab["kind"] == "mojibake" and line in kept]
    return {
        "clean_kept": sum(kept_in(g) > 0 for g in clean_groups) / len(clean_groups),
        "exact_groups_single": sum(kept_in(g) == 1 for g in exact) / len(exact),
        "near_groups_single": sum(kept_in(g) == 1 for g in near) / len(near),
        "english_removed": sum(line not in kept for line in english) / len(english),
        "junk_removed": sum(line not in kept for line in junk) / len(junk),
        "mis_decoded_left": sum(bool(MOJIBAKE.search(t)) for t in by_line.values()),
        "mojibake_repaired": sum(by_line[line] == labels[line]["original"] for line in mojibake)
        / max(len(mojibake), 1),
        "contact_leaks": sorted(set(leaks)),
        "documents_kept": len(kept),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the shared data folder (../shared/data)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    labels = build(args.data, args.out, args.seed)
    kinds: dict[str, int] = {}
    for lab in labels.values():
        kinds[lab["kind"]] = kinds.get(lab["kind"], 0) + 1
    print(f"{args.out / 'web.jsonl'}: {len(labels)} documents {kinds}")


if __name__ == "__main__":
    main()
