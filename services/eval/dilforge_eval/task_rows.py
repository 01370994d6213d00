"""The downstream tasks' rows: read from the JSONL, TSV or CSV files (or S3 objects) the eval config names and
checked field by field, so a missing column, an unknown label or an empty file is a one-line error naming the
file, the line and the field before any model is loaded."""

from __future__ import annotations

import csv
import json
from typing import Any

from dilforge_shared.corpus import iter_located_texts, iter_records
from dilforge_shared.errors import InputError

from .config import SIB_LABELS


def read_rows(uri: str, endpoint_url: str | None = None) -> list[tuple[int, dict]]:
    """(line, record) of a JSONL, TSV or CSV file (header row names the columns); a file without one is an error."""
    name = uri.lower()
    if name.endswith((".jsonl", ".json")):
        return _nonempty(list(iter_records(uri, endpoint_url)), uri)
    if not name.endswith((".tsv", ".csv")):
        raise InputError("task file must be .jsonl, .tsv or .csv", path=uri)
    delimiter = "\t" if name.endswith(".tsv") else ","
    # TSV cells never quote (a `"` is text); CSV cells may, and a quoted cell may span lines, so the file is parsed
    # as one stream and a record is named by the line it starts on.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    lines = (f"{line}\n" for _, _, line in iter_located_texts(uri, "txt", endpoint_url=endpoint_url, skip_empty=False))
    reader = csv.reader(lines, delimiter=delimiter, quoting=quoting, strict=True)
    rows, header, start = [], None, 1
    try:
        for cells in reader:
            lineno, start = start, reader.line_num + 1
            if not any(cell.strip() for cell in cells):
                continue
            if header is None:
                header = [cells[0].removeprefix("\ufeff"), *cells[1:]]  # a byte-order mark is not part of the name
                continue
            if len(cells) != len(header):
                raise InputError(f"{len(cells)} columns, the header has {len(header)}", path=uri, line=lineno)
            rows.append((lineno, dict(zip(header, cells, strict=False))))
    except csv.Error as exc:
        raise InputError(f"not valid {name.rsplit('.', 1)[-1].upper()}: {exc}", path=uri, line=start) from None
    return _nonempty(rows, uri)


def need(rec: dict, key: str, uri: str, lineno: int, kind: type | tuple[type, ...] = str) -> Any:
    """A field of a row, of the right type and not empty; else a one-line error naming file, line and field."""
    if key not in rec:
        raise InputError(f"field {key!r} missing (fields: {sorted(rec)})", path=uri, line=lineno)
    value = rec[key]
    if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, str | list) and not value):
        kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise InputError(f"field {key!r} is {value!r}: not a non-empty {kinds}", path=uri, line=lineno)
    return value


def _nonempty(rows: list, uri: str) -> list:
    if not rows:
        raise InputError("task file holds no rows", path=uri)
    return rows


def sib_rows(cfg, endpoint: str | None) -> dict[str, dict[str, list[dict]]]:
    """language -> split -> [{text, label, topic}] from the SIB-200 file."""
    out: dict[str, dict[str, list[dict]]] = {lang: {"train": [], "test": []} for lang in cfg.languages}
    for lineno, rec in read_rows(cfg.uri, endpoint):
        split = need(rec, cfg.split_field, cfg.uri, lineno)
        topic = need(rec, cfg.label_field, cfg.uri, lineno)
        if topic not in SIB_LABELS:
            raise InputError(
                f"field {cfg.label_field!r}: unknown label {topic!r} (SIB-200 labels: {', '.join(SIB_LABELS)})",
                path=cfg.uri,
                line=lineno,
            )
        for lang, column in cfg.languages.items():
            text = need(rec, column, cfg.uri, lineno)
            if split in ("train", "test"):
                out[lang][split].append({"text": text, "label": SIB_LABELS.index(topic), "topic": topic})
    for splits in out.values():
        if not splits["test"]:
            raise InputError(f"field {cfg.split_field!r}: no row of split 'test' to score", path=cfg.uri)
        if max(cfg.num_fewshot) > len(splits["train"]):
            raise InputError(
                f"field {cfg.split_field!r}: {len(splits['train'])} 'train' rows, fewer than "
                f"num_fewshot {max(cfg.num_fewshot)}",
                path=cfg.uri,
            )
        splits["test"] = splits["test"][: cfg.max_examples]
    return out


def instruction_rows(cfg, endpoint: str | None) -> list[dict]:
    rows = read_rows(cfg.uri, endpoint)[: cfg.max_examples]
    fields = {"instruction": cfg.instruction_field, "response": cfg.response_field}
    return [{k: need(rec, field, cfg.uri, n) for k, field in fields.items()} for n, rec in rows]


def mc_rows(uri: str, layout: str, endpoint: str | None) -> list[dict]:
    """Rows of a Belebele- or TUMLU-layout file, checked; TUMLU `choices` may be a JSON list in a TSV cell."""
    out = []
    for n, rec in read_rows(uri, endpoint):
        if layout == "belebele":
            keys = ("flores_passage", "question", "mc_answer1", "mc_answer2", "mc_answer3", "mc_answer4")
            row = {k: need(rec, k, uri, n) for k in keys}
            answer = str(need(rec, "correct_answer_num", uri, n, (str, int))).strip()
            if answer not in ("1", "2", "3", "4"):
                raise InputError(f"field 'correct_answer_num': unknown label {answer!r} (1-4)", path=uri, line=n)
            row["correct_answer_num"] = answer
        else:
            choices = rec.get("choices")
            if isinstance(choices, str):
                try:
                    choices = json.loads(choices)
                except ValueError:
                    raise InputError("field 'choices': not a JSON list", path=uri, line=n) from None
            if not (
                isinstance(choices, list) and 2 <= len(choices) <= 5 and all(isinstance(c, str) and c for c in choices)
            ):
                raise InputError("field 'choices' missing or not a list of 2-5 strings", path=uri, line=n)
            answer = need(rec, "answer", uri, n).strip()
            letters = "ABCDE"[: len(choices)]
            if answer not in letters:
                raise InputError(
                    f"field 'answer': unknown label {answer!r} (one of {', '.join(letters)})", path=uri, line=n
                )
            row = {"question": need(rec, "question", uri, n), "choices": choices, "answer": answer}
        out.append(row)
    return out
