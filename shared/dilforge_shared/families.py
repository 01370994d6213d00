"""Tokenizer families: the special tokens and chat template a base model's family uses (a new tokenizer keeps
them, or the base model's knowledge of them is lost). Every stage asks this module, never a hard-coded token."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InputError

LLAMA3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.index0 == 0 %}{{- bos_token }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# ChatML as SmolLM2/Qwen write it, {% generation %} around what the assistant says (content and <|im_end|>) for
# the assistant-only loss; no default system prompt (that is a model's choice: SFT's `system_prompt`).
CHATML_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    """Special tokens of one tokenizer family, by string (ids differ between tokenizers): bos / doc_end frame a
    pre-training document (bos None: none); eot ends an assistant turn; pad is never trained on; extra_stops are
    other tokens its instruct models stop on; turn_starts begin a document or turn (the server stops on them)."""

    name: str
    bos: str | None
    doc_end: str
    eot: str
    pad: str
    chat_template: str
    markers: tuple[str, ...]  # tokens whose presence identifies the family
    extra_stops: tuple[str, ...] = ()
    turn_starts: tuple[str, ...] = ()

    @property
    def specials(self) -> list[str]:  # the family's named special tokens, in a stable order, deduplicated
        return list(dict.fromkeys(t for t in (self.bos, self.doc_end, self.eot, self.pad, *self.markers) if t))

    @property
    def stop_tokens(self) -> list[str]:  # the end of a turn (or the family's other message ends) or of a document
        return list(dict.fromkeys([self.eot, *self.extra_stops, self.doc_end]))


LLAMA3 = Family(
    name="llama3",
    bos="<|begin_of_text|>",
    doc_end="<|end_of_text|>",
    eot="<|eot_id|>",
    pad="<|finetune_right_pad_id|>",
    chat_template=LLAMA3_CHAT_TEMPLATE,
    markers=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    extra_stops=("<|eom_id|>",),
    turn_starts=("<|begin_of_text|>", "<|start_header_id|>"),
)
CHATML = Family(
    name="chatml",
    bos=None,
    doc_end="<|endoftext|>",
    eot="<|im_end|>",
    pad="<|endoftext|>",
    chat_template=CHATML_CHAT_TEMPLATE,
    markers=("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
    turn_starts=("<|im_start|>",),
)
FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA3, CHATML)}


def detect_family(tokens: Iterable[str], source: str) -> Family:
    """The family whose marker tokens are all in `tokens` (a vocabulary or its added tokens); InputError naming
    `source` when none matches, rather than training with the wrong separators."""
    vocab = set(tokens)
    if family := next((f for f in FAMILIES.values() if vocab.issuperset(f.markers)), None):
        return family
    raise InputError(
        "tokenizer follows no known family (Llama 3: <|begin_of_text|>/<|eot_id|>; ChatML: "
        "<|im_start|>/<|im_end|>/<|endoftext|>); its special tokens cannot be mapped",
        path=source,
    )


GENERATION_CONFIG_FILE = "generation_config.json"
