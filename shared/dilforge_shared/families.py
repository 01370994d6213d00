"""Tokenizer families: which special tokens and chat template a base model's family uses.

A new tokenizer must follow its base model's conventions, or the base model's knowledge of its own
special tokens (document ends, turn ends) is lost: Llama 3.x uses `<|begin_of_text|>` /
`<|end_of_text|>` / `<|eot_id|>` and header tokens; SmolLM2, Qwen and many others use ChatML
(`<|im_start|>` / `<|im_end|>`, documents separated by `<|endoftext|>`). Every stage asks this
module, never a hard-coded token name. Pure Python (no tokenizers/torch import): the coordinator
and the tests use it as is.
"""

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

# ChatML as SmolLM2/Qwen write it, with TRL's {% generation %} markers around what the assistant says
# (its content and <|im_end|>), so `assistant_only_loss` masks everything else. No default system
# prompt: that is a model's choice, not the family's (SFT configs set `system_prompt`).
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
    """Special tokens of one tokenizer family, by string (ids differ between tokenizers).

    bos: prepended to every document in pre-training (None: the family uses none).
    doc_end: appended to every document in pre-training (packing separator).
    eot: ends an assistant turn (SFT loss covers it; generation stops on it).
    pad: padding for batches (never trained on).
    """
    name: str
    bos: str | None
    doc_end: str
    eot: str
    pad: str
    chat_template: str
    markers: tuple[str, ...]  # tokens whose presence identifies the family

    @property
    def specials(self) -> list[str]:
        """The family's named special tokens, in a stable order, deduplicated."""
        out: list[str] = []
        for t in (self.bos, self.doc_end, self.eot, self.pad, *self.markers):
            if t is not None and t not in out:
                out.append(t)
        return out

    @property
    def stop_tokens(self) -> list[str]:
        """Generation ends on either the end of a turn or the end of a document."""
        return list(dict.fromkeys([self.eot, self.doc_end]))


LLAMA3 = Family(name="llama3", bos="<|begin_of_text|>", doc_end="<|end_of_text|>", eot="<|eot_id|>",
                pad="<|finetune_right_pad_id|>", chat_template=LLAMA3_CHAT_TEMPLATE,
                markers=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
CHATML = Family(name="chatml", bos=None, doc_end="<|endoftext|>", eot="<|im_end|>", pad="<|endoftext|>",
                chat_template=CHATML_CHAT_TEMPLATE, markers=("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA3, CHATML)}


def detect_family(tokens: Iterable[str], source: str) -> Family:
    """The family whose marker tokens are all in `tokens` (a vocabulary or its added tokens).

    Raises InputError naming `source` when no known family matches, so a user learns at once that
    the base model's conventions are unknown rather than training with the wrong separators.
    """
    vocab = set(tokens)
    for family in FAMILIES.values():
        if all(m in vocab for m in family.markers):
            return family
    raise InputError("tokenizer follows no known family (Llama 3: <|begin_of_text|>/<|eot_id|>; ChatML: "
                     "<|im_start|>/<|im_end|>/<|endoftext|>); its special tokens cannot be mapped", path=source)
