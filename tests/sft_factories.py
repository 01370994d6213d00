"""A SmolLM2-like ChatML tokenizer and the ChatML loss mask of the shared SFT conversation.

The tokenizer is a small byte-level BPE trained on Azerbaijani Wikipedia lines with SmolLM2's
specials (`<|endoftext|>` id 0, `<|im_start|>`, `<|im_end|>`), SmolLM2's own chat template (no
{% generation %} markers, a default system prompt) and, like SmolLM2, `<|im_end|>` as eos and pad.
"""

from __future__ import annotations

from pathlib import Path

from factories import wiki_lines

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# SFT_CONVERSATION (factories) under the ChatML family template: (text, in the loss?). Role lines and the
# "\n" after each <|im_end|> are masked; assistant content and its <|im_end|> are trained.
CHATML_EXPECTED_MASK = [
    ("<|im_start|>", 0),
    ("system\nSən köməkçisən.", 0),
    ("<|im_end|>", 0),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("user\nSalam!", 0),
    ("<|im_end|>", 0),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("assistant\n", 0),
    ("Salam, necə kömək edim?", 1),
    ("<|im_end|>", 1),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("user\nBakı haradadır?", 0),
    ("<|im_end|>", 0),
    ("\n", 0),
    ("<|im_start|>", 0),
    ("assistant\n", 0),
    ("Bakı Azərbaycanın paytaxtıdır.", 1),
    ("<|im_end|>", 1),
    ("\n", 0),
]


def build_chatml_tokenizer(
    out_dir: Path, vocab_size: int = 512, num_lines: int = 3000, lines: list[str] | None = None
) -> Path:
    """`lines`: training text (default: the first num_lines of Azerbaijani Wikipedia from the shared data)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines if lines is not None else wiki_lines(num_lines), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = SMOLLM2_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return out_dir
