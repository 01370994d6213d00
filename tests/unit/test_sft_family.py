"""SFT follows the tokenizer's family (ChatML here; Llama 3 in test_sft_mask), picks an attention kernel
that keeps packed documents apart, and turns activation checkpointing on only when memory needs it."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import itertools

from dilforge_sft.config import SftConfig
from dilforge_shared.errors import ConfigError, InputError
from factories import SFT_CONVERSATION, build_tiny_llama, sft_expected_tokens, tiny_llama_config
from sft_factories import CHATML_EXPECTED_MASK, build_chatml_tokenizer


@pytest.fixture(scope="module")
def chatml_llama_dir(tmp_path_factory, data_root):
    root = tmp_path_factory.mktemp("chatml")
    return build_tiny_llama(root / "model", build_chatml_tokenizer(root / "tokenizer"))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    late = [{"role": "user", "content": " ".join(["Azərbaycan"] * 30)}, {"role": "assistant", "content": "Bəli."}]
    path.write_text("\n".join(json.dumps({"messages": m}, ensure_ascii=False) for m in (SFT_CONVERSATION, late)) + "\n")
    return str(path)


def sft_config(path: str, **overrides) -> SftConfig:
    section = {
        "train": [{"uri": path}],
        "validation": [{"uri": path}],
        "max_length": 1024,
        "lora": {"r": 4},
        "num_steps": 1,
        "micro_batch_size": 2,
        "activation_checkpointing": False,
    }
    section.update(overrides)
    return SftConfig.model_validate(section)


def cpu_plan(config: SftConfig):
    from dilforge_sft import training
    from dilforge_shared.runtime_policy import DeviceFacts

    return training.decide_runtime(config, facts=DeviceFacts(cuda=False))


def trainer_for(model_dir, path, tmp_path, **overrides):
    import torch

    torch.set_num_threads(1)
    from dilforge_sft import stage, training

    config = sft_config(path, **overrides)
    tok, family, _ = stage.load_tokenizer(model_dir)
    train, val, _, _ = stage.prepare_data(config, tok, None)
    plan = cpu_plan(config)
    return (
        training.build_trainer(config, training.load_model(model_dir, plan), tok, train, val, tmp_path, plan),
        tok,
        family,
    )


# ---- family ------------------------------------------------------------------------------------------


def test_chatml_tokenizer_gets_family_template_and_pad(chatml_llama_dir):
    from dilforge_sft import stage

    tok, family, source = stage.load_tokenizer(chatml_llama_dir)
    assert family.name == "chatml" and source == "family:chatml"
    assert family.eot == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"  # not SmolLM2's <|im_end|>: pad is never the token the loss teaches
    # SmolLM2's default system prompt is gone: the family template injects none
    text = tok.apply_chat_template([{"role": "user", "content": "Salam"}], tokenize=False)
    assert text == "<|im_start|>user\nSalam<|im_end|>\n"


def test_chatml_label_mask_equals_hand_written_mask(chatml_llama_dir, chat_file, tmp_path):
    trainer, tok, _ = trainer_for(chatml_llama_dir, chat_file, tmp_path)
    ids, labels = sft_expected_tokens(tok, CHATML_EXPECTED_MASK)
    row = trainer.train_dataset[0]
    assert row["input_ids"] == ids
    assert row["labels"] == labels
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # of the five turn ends, only the two closing assistant turns are in the loss
    assert [lab == im_end for t, lab in zip(ids, labels, strict=False) if t == im_end] == [
        False,
        False,
        True,
        False,
        True,
    ]
    trained = tok.decode([t for t, lab in zip(ids, labels, strict=False) if lab != -100])
    assert trained == "Salam, necə kömək edim?<|im_end|>Bakı Azərbaycanın paytaxtıdır.<|im_end|>"


def test_tokenizer_of_unknown_family_is_refused_naming_the_folder(tmp_path, chatml_llama_dir):
    from dilforge_sft import stage
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "a": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<s>").save_pretrained(str(tmp_path))
    with pytest.raises(InputError, match="no known family") as err:
        stage.load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)


# ---- attention kernel --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "packing, device, flash, expected",
    [
        (False, "cuda", True, "sdpa"),
        (False, "cpu", False, "sdpa"),
        (True, "cpu", False, "sdpa"),
        (True, "cuda", False, "flex_attention"),
        (True, "cuda", True, "flash_attention_2"),
    ],
)
def test_attention_plan_auto(packing, device, flash, expected):
    from dilforge_sft.training import decide_runtime
    from dilforge_shared.runtime_policy import DeviceFacts

    facts = DeviceFacts(cuda=device == "cuda", bf16_supported=True, flash_attn=flash)
    plan = decide_runtime(sft_config("x.jsonl", packing=packing), facts=facts)
    assert plan.attention == expected and plan.attention_reason
    if packing and device == "cpu":
        assert "N^2" in plan.attention_reason  # the fallback says what it costs


def test_attention_plan_explicit_and_refused():
    from dilforge_sft.training import decide_runtime
    from dilforge_shared.runtime_policy import DeviceFacts

    gpu, cpu = DeviceFacts(cuda=True, bf16_supported=True), DeviceFacts(cuda=False)
    assert decide_runtime(sft_config("x.jsonl", attention="eager"), facts=gpu).attention == "eager"
    with pytest.raises(ConfigError, match="sft.attention"):
        decide_runtime(sft_config("x.jsonl", attention="flash_attention_2", packing=True), facts=cpu)
    with pytest.raises(ConfigError, match="flash-attn"):
        decide_runtime(sft_config("x.jsonl", attention="flash_attention_2"), facts=gpu)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_rows_do_not_attend_across_conversations(chatml_llama_dir, chat_file, tmp_path, implementation):
    """The trainer's own packed, padding-free batch gives each conversation the logits it gets alone."""
    import torch
    from transformers import AutoModelForCausalLM

    trainer, _tok, _ = trainer_for(chatml_llama_dir, chat_file, tmp_path, packing=True)
    assert len(trainer.train_dataset) == 1
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    model = AutoModelForCausalLM.from_pretrained(
        str(chatml_llama_dir), attn_implementation=implementation, trust_remote_code=False
    ).eval()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
        assert len(starts) == 3  # two conversations
        for begin, end in itertools.pairwise(starts):
            alone = model(input_ids=batch["input_ids"][:, begin:end], use_cache=False).logits[0]
            torch.testing.assert_close(packed[begin:end], alone, atol=1e-5, rtol=1e-5)
    # the same row read as one document differs: the boundary is what keeps them apart
    with torch.no_grad():
        joined = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    assert (joined[starts[1] :] - packed[starts[1] :]).abs().max().item() > 1e-3


# ---- activation checkpointing ------------------------------------------------------------------------


def test_activation_checkpointing_auto_follows_the_memory_estimate():
    from dilforge_sft.training import activation_checkpointing, decide_runtime
    from dilforge_shared.runtime_policy import DeviceFacts

    llama_1b = tiny_llama_config(
        128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    small = sft_config("x.jsonl", activation_checkpointing="auto", micro_batch_size=8, max_length=1024)
    large = sft_config(
        "x.jsonl", activation_checkpointing="auto", micro_batch_size=64, max_length=2048, global_batch_size=64
    )
    gpu = DeviceFacts(cuda=True, bf16_supported=True)
    plan = decide_runtime(small.model_copy(update={"liger": "off"}), "llama", facts=gpu)
    fused = decide_runtime(small, "llama", facts=gpu)
    assert plan.bf16 and not plan.liger and fused.liger
    gib = 2**30
    on, why = activation_checkpointing(small, llama_1b, plan, 141 * gib)
    assert on is False and "no recomputation" in why
    on, why = activation_checkpointing(large, llama_1b, plan, 24 * gib)
    assert on is True and "recompute" in why
    # the fused loss (Liger) never materialises the logits: the same run fits where the plain one does not
    assert activation_checkpointing(small, llama_1b, plan, 24 * gib)[0] is True
    assert activation_checkpointing(small, llama_1b, fused, 24 * gib)[0] is False
    on_config = sft_config("x.jsonl", activation_checkpointing="on")
    assert activation_checkpointing(on_config, llama_1b, plan, 141 * gib)[0] is True


@pytest.mark.parametrize("value, expected", [(True, "on"), (False, "off"), ("auto", "auto"), ("off", "off")])
def test_activation_checkpointing_accepts_yaml_booleans(value, expected):
    assert sft_config("x.jsonl", activation_checkpointing=value).activation_checkpointing == expected
    with pytest.raises(ValueError, match="activation_checkpointing"):
        sft_config("x.jsonl", activation_checkpointing="sometimes")
