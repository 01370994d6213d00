"""Records → conversations ({"role", "content"} lists), with counted rules for everything that is not a clean
chat: every rule that changes or drops data adds to a named counter in the manifest."""

from __future__ import annotations

import logging
import random
import unicodedata
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from dilforge_shared.corpus import iter_located_records, iter_located_texts
from dilforge_shared.errors import InputError
from dilforge_shared.specials import control_token_in, special_token_in, special_token_pattern, special_tokens

from .config import SftConfig, SftDataSource

log = logging.getLogger("dilforge.sft.data")

ROLES = ("system", "user", "assistant")
Conversation = list[dict[str, str]]
Example = dict[str, list[int]]  # a tokenised conversation: input_ids and assistant_masks, as TRL's SFTTrainer takes
MAX_EXAMPLES = 10


@dataclass
class DataCounts:
    """Counters of one split; every rule that touches the data has one."""

    num_records: int = 0
    num_conversations: int = 0
    num_bad_records: int = 0
    num_unknown_role_messages: int = 0
    num_empty_assistant_turns: int = 0
    num_dropped_empty_assistant: int = 0
    num_system_prompts_added: int = 0
    num_long_truncated: int = 0
    num_long_dropped: int = 0
    num_long_dropped_no_assistant_left: int = 0
    num_tokens: int = 0
    num_assistant_tokens: int = 0
    bad_record_examples: list[str] = field(default_factory=list)
    num_user_turns_folded: int = 0
    answer_languages: dict[str, int] = field(default_factory=dict)  # language of the last answer -> conversations

    def skip_bad(self, reason: str) -> None:
        """Count a skipped bad record, keep its first reasons as examples, and log it."""
        self.num_bad_records += 1
        if len(self.bad_record_examples) < MAX_EXAMPLES:
            self.bad_record_examples.append(reason)
        log.warning("skipping %s", reason)


class BadRecord(Exception):
    """A record that cannot become a conversation; the reader adds file and line."""


def _checked_text(text: str, where: str) -> str:
    """NFC text, refused when it holds a control token: trained on, `<|im_end|>` inside a reply teaches the model
    to end turns (or forge them) where the data never meant to."""
    token = control_token_in(text)
    if token is not None:
        raise BadRecord(f"{where} contains the control token {token!r}; remove it from the data")
    return unicodedata.normalize("NFC", text)


def _optional_str(record: dict, name: str | None) -> str | None:
    if name is None or (value := record.get(name)) is None:
        return None
    if not isinstance(value, str):
        raise BadRecord(f"field {name!r} must be a string, got {type(value).__name__}")
    return _checked_text(value, f"field {name!r}")


def _required_str(record: dict, name: str) -> str:
    if name not in record:
        raise BadRecord(f"field {name!r} is missing (fields: {sorted(record)})")
    if (value := _optional_str(record, name)) is None:
        raise BadRecord(f"field {name!r} is null")
    return value


def messages_from_record(record: dict, source: SftDataSource, config: SftConfig, counts: DataCounts) -> Conversation:
    """A `messages` record; unknown roles follow config.unknown_roles."""
    turns = record.get(source.messages_field)
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"field {source.messages_field!r} must be a non-empty list of {{role, content}}")
    out: Conversation = []
    for i, turn in enumerate(turns):
        where = f"{source.messages_field}[{i}]"
        if not isinstance(turn, dict):
            raise BadRecord(f"{where} is not an object")
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(role, str):
            raise BadRecord(f"{where}.role is missing or not a string")
        if not isinstance(content, str):
            raise BadRecord(f"{where}.content is missing or not a string")
        if role not in ROLES:
            if config.unknown_roles == "bad_record":
                raise BadRecord(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
            counts.num_unknown_role_messages += 1
            continue
        out.append({"role": role, "content": _checked_text(content, f"{where}.content")})
    return out


def instruction_from_record(record: dict, source: SftDataSource) -> Conversation:
    """An instruction/response record: user = instruction (+ blank line + input), assistant = response."""
    instruction = _required_str(record, source.instruction_field)
    if not instruction.strip():
        raise BadRecord(f"field {source.instruction_field!r} is empty")
    extra = _optional_str(record, source.input_field)
    if extra and extra.strip():
        instruction = f"{instruction}\n\n{extra}"
    response = _required_str(record, source.response_field)
    conv: Conversation = []
    system = _optional_str(record, source.system_field)
    if system and system.strip():
        conv.append({"role": "system", "content": system})
    conv += [{"role": "user", "content": instruction}, {"role": "assistant", "content": response}]
    return conv


def translation_from_row(cells: list[str], columns: dict[str, int], source: SftDataSource) -> Conversation:
    need = max(columns.values()) + 1
    if len(cells) < need:
        raise BadRecord(f"row has {len(cells)} columns, expected at least {need}")
    text = _checked_text(cells[columns["source"]], f"column {source.source_field!r}").strip()
    if not text:
        raise BadRecord(f"column {source.source_field!r} is empty")
    return [
        {"role": "user", "content": source.translation_prompt.replace("{source}", text)},
        {"role": "assistant", "content": _checked_text(cells[columns["target"]], f"column {source.target_field!r}")},
    ]


def apply_turn_rules(conv: Conversation, config: SftConfig, counts: DataCounts) -> Conversation | None:
    """Empty assistant turns, then the default system prompt. None = dropped (counted)."""
    empty = [i for i, m in enumerate(conv) if m["role"] == "assistant" and not m["content"].strip()]
    if empty:
        counts.num_empty_assistant_turns += len(empty)
        if config.empty_assistant_turns == "bad_record":
            raise BadRecord(f"assistant turn {empty[0]} is empty")
        if config.empty_assistant_turns == "drop_conversation":
            counts.num_dropped_empty_assistant += 1
            return None
        conv = drop_empty_turns(conv)
    if not any(m["role"] == "assistant" for m in conv):
        if empty:  # drop_turn left nothing to learn from
            counts.num_dropped_empty_assistant += 1
            return None
        raise BadRecord("no assistant turn: nothing to learn from")
    if config.system_prompt and conv[0]["role"] != "system":
        conv = [{"role": "system", "content": config.system_prompt}, *conv]
        counts.num_system_prompts_added += 1
    return conv


def drop_empty_turns(conv: Conversation) -> Conversation:
    """Remove each empty assistant turn together with the user turns it answered (back to the previous assistant)."""
    out: Conversation = []
    pending: Conversation = []
    for m in conv:
        if m["role"] == "assistant":
            if m["content"].strip():
                out += pending + [m]
            pending = []
        elif m["role"] == "system" and not out and not pending:
            out.append(m)
        else:
            pending.append(m)
    return out + pending


def _translation_rows(source: SftDataSource, endpoint_url: str | None) -> Iterator[tuple[str, int, list[str], dict]]:
    """(file, line, cells, columns) of a TSV with a header naming the source and target columns."""
    current_file, columns = None, {}
    for file, line, raw in iter_located_texts(source.uri, "txt", endpoint_url=endpoint_url, **source.bounds):
        if file != current_file:
            current_file, header = file, raw.split("\t")
            missing = [c for c in (source.source_field, source.target_field) if c not in header]
            if missing:
                raise InputError(
                    f"TSV header has no column(s) {missing} (columns: {header}); set source_field/target_field",
                    path=file,
                    line=line,
                )
            columns = {"source": header.index(source.source_field), "target": header.index(source.target_field)}
            continue
        yield file, line, raw.split("\t"), columns


def iter_conversations(
    source: SftDataSource, config: SftConfig, counts: DataCounts, endpoint_url: str | None = None
) -> Iterator[Conversation]:
    """Stream one source's conversations; a bad record fails with file:line or is skipped and counted.

    JSONL comes from the shared record reader (dilforge_shared.corpus.iter_located_records), which hands a line
    that is not a JSON object to `bad` under the same rule as a record that is not a conversation."""

    def bad(file: str, line: int, reason: object) -> None:
        if config.on_bad_record == "fail":
            raise InputError(
                f"bad {source.layout} record: {reason} (set on_bad_record: skip to skip and count such records)",
                path=file,
                line=line,
            )
        counts.skip_bad(f"{file}:{line}: {reason}")

    def bad_json(file: str, line: int, reason: str) -> None:
        counts.num_records += 1
        bad(file, line, reason)

    if source.layout == "translation":
        rows: Iterator[tuple] = _translation_rows(source, endpoint_url)
    else:
        rows = iter_located_records(source.uri, endpoint_url, on_bad=bad_json, **source.bounds)
    produced = 0
    for file, line, *item in rows:
        counts.num_records += 1
        try:
            if source.layout == "translation":
                conv = translation_from_row(*item, source)
            elif source.layout == "messages":
                conv = messages_from_record(item[0], source, config, counts)
            else:
                conv = instruction_from_record(item[0], source)
            conv = apply_turn_rules(conv, config, counts)
        except BadRecord as exc:
            bad(file, line, exc)
            continue
        if conv is None:
            continue
        counts.num_conversations += 1
        yield conv
        produced += 1
        if source.max_docs is not None and produced >= source.max_docs:
            return


def load_splits(
    config: SftConfig, endpoint_url: str | None = None
) -> tuple[list[Conversation], list[Conversation], DataCounts, DataCounts]:
    """Train and validation conversations; without validation sources, a seeded slice of train is held out."""
    train_counts, val_counts = DataCounts(), DataCounts()
    train = [c for s in config.train for c in iter_conversations(s, config, train_counts, endpoint_url)]
    if config.validation:
        val = [c for s in config.validation for c in iter_conversations(s, config, val_counts, endpoint_url)]
    else:
        if len(train) < 2:
            raise InputError(
                f"only {len(train)} usable training conversation(s): cannot hold out a validation split; "
                "add training data or give validation sets",
                path=config.train[0].uri,
            )
        order = list(range(len(train)))
        random.Random(config.seed).shuffle(order)
        n_val = max(1, round(config.validation_fraction * len(train)))
        held = set(order[:n_val])
        val = [c for i, c in enumerate(train) if i in held]
        train = [c for i, c in enumerate(train) if i not in held]
        val_counts.num_conversations = len(val)
        train_counts.num_conversations = len(train)
    if not train:
        raise InputError(
            "no usable training conversation (see the counted data rules in the log)", path=config.train[0].uri
        )
    if config.folded_user_share:
        train = fold_user_turns(train, config.folded_user_share, config.seed, train_counts)
    if not val:
        raise InputError("no usable validation conversation", path=config.validation[0].uri)
    return train, val, train_counts, val_counts


# Azerbaijani's own letters as typed on a keyboard without them
AZ_FOLD = str.maketrans("əƏıİşŞçÇğĞöÖüÜ", "eEiIsScCgGoOuU")


def fold_user_turns(convs: list[Conversation], share: float, seed: int, counts: DataCounts) -> list[Conversation]:
    """A seeded `share` of the conversations with their user turns folded to ASCII letters (`AZ_FOLD`), answers
    untouched: many customers type without the Azerbaijani letters and should get the same answer."""
    chosen = set(random.Random(seed).sample(range(len(convs)), round(share * len(convs))))
    out = []
    for i, conv in enumerate(convs):
        if i in chosen:
            conv = [{**m, "content": m["content"].translate(AZ_FOLD)} if m["role"] == "user" else m for m in conv]
            counts.num_user_turns_folded += sum(m["role"] == "user" for m in conv)
        out.append(conv)
    return out


def refuse_special_tokens(
    convs: list[Conversation], tokenizer, split: str, on_bad_record: str, counts: DataCounts, path: str
) -> list[Conversation]:
    """The conversations none of whose messages holds a special token of the base tokenizer. The families'
    `<|word|>` tokens were refused when the records were read (with file and line); these are the tokenizer's own
    (SmolLM2's `<repo_name>`, `<file_sep>`): the chat template's render parses them, so one in a reply would be
    trained on as its control id. `fail`: an InputError naming the conversation; `skip`: dropped, counted as bad."""
    pattern = special_token_pattern(special_tokens(tokenizer))
    if pattern is None:
        return convs
    kept = []
    for i, conv in enumerate(convs):
        found = next(
            ((j, m["role"], t) for j, m in enumerate(conv) if (t := special_token_in(m["content"], pattern))), None
        )
        if found is None:
            kept.append(conv)
            continue
        reason = (
            f"{split} conversation {i + 1}: messages[{found[0]}] ({found[1]}) contains the special token "
            f"{found[2]!r} of the base model's tokenizer, which would be trained on as its control id"
        )
        if on_bad_record == "fail":
            raise InputError(f"bad record: {reason}; remove it from the data (or set on_bad_record: skip)", path=path)
        counts.skip_bad(reason)
    return kept


def apply_length_rule(
    convs: list[Conversation], tokenizer, max_length: int, rule: str, counts: DataCounts
) -> list[Example]:
    """Tokenise each conversation once with the assistant mask (as SFTTrainer would) and count (with 'drop':
    remove) those over max_length; with 'truncate' one whose kept window has no assistant token is dropped here,
    counted, not silently inside TRL."""
    kept: list[Example] = []
    for conv in convs:
        enc = tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        window = mask
        if len(ids) > max_length:
            if rule == "drop":
                counts.num_long_dropped += 1
                continue
            window = mask[:max_length]
            if 1 not in window:
                counts.num_long_dropped_no_assistant_left += 1
                continue
            counts.num_long_truncated += 1
        counts.num_tokens += len(window)
        counts.num_assistant_tokens += sum(window)
        kept.append({"input_ids": ids, "assistant_masks": mask})
    counts.num_conversations = len(kept)
    return kept


# lingua chooses among the target language and these: the languages an Azerbaijani assistant's data is mixed with
ANSWER_LANGUAGE_CANDIDATES = ("en", "tr", "ru")


def count_answer_languages(convs: list[Conversation], target: str, counts: DataCounts) -> float:
    """Count the language of each conversation's last answer (lingua, offline, as curate uses it) into
    `counts.answer_languages`; return the share in `target`. An assistant trained mostly on answers in another
    language answers in it, whatever the question's language: the stage warns when this share is below half."""
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

    codes = sorted({target, *ANSWER_LANGUAGE_CANDIDATES})
    languages = [Language.from_iso_code_639_1(getattr(IsoCode639_1, c.upper())) for c in codes]
    detector = LanguageDetectorBuilder.from_languages(*languages).build()
    found: Counter[str] = Counter()
    for conv in convs:
        detected = detector.detect_language_of(next(m["content"] for m in reversed(conv) if m["role"] == "assistant"))
        found[detected.iso_code_639_1.name.lower() if detected is not None else "unknown"] += 1
    counts.answer_languages = dict(sorted(found.items()))
    return found[target] / len(convs) if convs else 0.0
