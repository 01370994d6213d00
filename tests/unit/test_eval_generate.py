"""Repetition measures on hand-checked texts, prompts file parsing, and seeded generation."""

from __future__ import annotations

import itertools
import json

import pytest
from dilforge_eval import generate as eval_generate
from dilforge_eval.config import GenerationSettings
from dilforge_shared.errors import InputError


def test_repetition_measures_hand_checked():
    r = eval_generate.repetition("a b a b a b")
    # 1-grams: 6, unique 2; 2-grams: 5, unique 2; 3-grams: aba bab aba bab → 2 of 4 repeat an earlier one
    assert r == {
        "num_words": 6,
        "distinct_1": pytest.approx(2 / 6),
        "distinct_2": pytest.approx(2 / 5),
        "repeated_3gram_rate": pytest.approx(0.5),
    }
    r = eval_generate.repetition("Bakı gözəl şəhərdir, BAKI isə paytaxtdır")
    assert r["distinct_1"] == pytest.approx(5 / 6)  # "Bakı" and "BAKI" (az lower-casing) are one word
    assert r["repeated_3gram_rate"] == 0.0
    assert eval_generate.repetition("tək")["distinct_2"] is None


def test_mean_repetition_skips_missing_values():
    rows = [eval_generate.repetition("a a a a"), eval_generate.repetition("b")]
    m = eval_generate.mean_repetition(rows)
    assert m["num_generations"] == 2 and m["distinct_1"] == pytest.approx((0.25 + 1) / 2)
    assert m["repeated_3gram_rate"] == pytest.approx(0.5)  # only the first has 3-grams: aaa aaa → 1 of 2


def test_load_prompts_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(
        json.dumps({"id": "a", "kind": "chat", "prompt": "Salam"}) + "\n\n" + json.dumps({"prompt": "Bakı"}) + "\n"
    )
    prompts = eval_generate.load_prompts(str(p))
    assert [(x.id, x.kind) for x in prompts] == [("a", "chat"), ("line3", "completion")]
    assert len(eval_generate.load_prompts(str(p), limit=1)) == 1
    p.write_text(json.dumps({"id": "a", "kind": "poem", "prompt": "x"}) + "\n")
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'kind'"):
        eval_generate.load_prompts(str(p))
    p.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"id": "a", "prompt": "y"}) + "\n")
    with pytest.raises(InputError, match=r"p.jsonl:2: duplicate prompt id"):
        eval_generate.load_prompts(str(p))


def test_builtin_prompts_are_valid():
    prompts = eval_generate.load_prompts("builtin:az-generation")
    assert {p.kind for p in prompts} == {"completion", "chat"} and len(prompts) >= 10
    with pytest.raises(InputError, match="no built-in prompts 'nope'"):
        eval_generate.load_prompts("builtin:nope")


def test_generation_is_reproducible_and_uses_chat_template(tiny_llama_dir):
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    prompts = [eval_generate.Prompt("c", "completion", "Bakı"), eval_generate.Prompt("q", "chat", "Salam")]
    text, templated = eval_generate.render_prompt(tok, prompts[1])
    assert (
        templated and "<|start_header_id|>assistant<|end_header_id|>" in text and text.startswith("<|begin_of_text|>")
    )
    runs = [
        eval_generate.generate(
            model, tok, prompts, mode, GenerationSettings(max_new_tokens=6, temperature=1.0, top_p=1.0), seed=3
        )
        for mode in ("greedy", "sampled", "sampled")
    ]
    assert all(r["num_new_tokens"] <= 6 for run in runs for r in run)
    assert [r["output"] for r in runs[1]] == [r["output"] for r in runs[2]]
    assert runs[0][1]["chat_template"] is True and runs[0][0]["chat_template"] is False


class _FakeTokenizer:
    """Just enough of a transformers tokenizer for the stop-token rules."""

    def __init__(self, vocab: dict[str, int], eos: int | None):
        self.vocab, self.eos_token_id, self.unk_token_id = vocab, eos, None

    def get_vocab(self):
        return dict(self.vocab)

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)


def test_stop_tokens_come_from_the_family():
    chatml = _FakeTokenizer({"<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 0, "a": 5}, eos=2)
    chatml.unk_token_id = 0  # as in SmolLM2: the unk token is the document end
    family = eval_generate.model_family(chatml, "smol")
    assert family.name == "chatml" and eval_generate.stop_token_ids(chatml, family) == [
        2,
        0,
    ]  # end of turn, end of document
    llama = _FakeTokenizer(
        {
            "<|begin_of_text|>": 10,
            "<|start_header_id|>": 11,
            "<|end_header_id|>": 12,
            "<|eot_id|>": 13,
            "<|end_of_text|>": 14,
        },
        eos=14,
    )
    assert eval_generate.stop_token_ids(llama, eval_generate.model_family(llama, "l3")) == [13, 14]
    chatml.bos_token, chatml.chat_template = "<|im_start|>", None  # SmolLM2 names a bos_token; ChatML has none
    assert eval_generate.render_prompt(chatml, eval_generate.Prompt("c", "completion", "Bakı"), family) == (
        "Bakı",
        False,
    )
    other = _FakeTokenizer({"</s>": 2, "a": 3}, eos=2)
    assert eval_generate.model_family(other, "x") is None and eval_generate.stop_token_ids(other, None) == [
        2
    ]  # unknown family: EOS only


def test_repetition_options_reach_generate(tiny_llama_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    seen = []
    real = model.generate

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    settings = GenerationSettings(max_new_tokens=4, repetition_penalty=1.3, no_repeat_ngram_size=3)
    eval_generate.generate(model, tok, [eval_generate.Prompt("c", "completion", "Bakı")], "greedy", settings, seed=0)
    (kw,) = seen
    assert kw["repetition_penalty"] == 1.3 and kw["no_repeat_ngram_size"] == 3
    assert kw["eos_token_id"] == [tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")]


def test_no_repeat_ngram_size_removes_repeated_ngrams(tiny_llama_dir):
    """A random tiny model loops under greedy decoding; with no_repeat_ngram_size=2 no token bigram repeats."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir), trust_remote_code=False)
    prompt = [eval_generate.Prompt("c", "completion", "Bakı")]

    def bigram_repeats(settings) -> int:
        ids = tok(eval_generate.render_prompt(tok, prompt[0])[0], add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                **eval_generate.generate_kwargs(settings, "greedy", tok.pad_token_id, []),
            )[0].tolist()
        grams = list(itertools.pairwise(out))
        return len(grams) - len(set(grams))

    assert bigram_repeats(GenerationSettings(max_new_tokens=40)) > 0  # the failure mode is there
    assert bigram_repeats(GenerationSettings(max_new_tokens=40, no_repeat_ngram_size=2)) == 0


def test_a_tokenizer_without_a_chat_template_gets_its_familys(tiny_llama_dir, tmp_path):
    """load_model gives it the family's template: the chat prompts, assistant answers and chat tasks render with it."""
    import shutil

    from dilforge_eval.resolve import EvalModel, load_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").unlink()
    _, tok = load_model(EvalModel(folder, None, folder, "", label="m"), "cpu", None)
    text, templated = eval_generate.render_prompt(tok, eval_generate.Prompt("q", "chat", "Salam"))
    assert templated and text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSalam<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_answer_batched_matches_one_by_one_and_reads_the_published_config(tiny_llama_dir, tmp_path):
    """Left padding changes no greedy answer; the stop flag is a stop token, not the limit; the generation config
    in the model folder (what serve and HF generate read) is the one used."""
    import json as json_mod
    import shutil

    from dilforge_eval.resolve import EvalModel, load_model
    from transformers import GenerationConfig

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    model, tok = load_model(EvalModel(folder, None, folder, "", label="m"), "cpu", None)
    prompts = ["Salam", "Azərbaycanın paytaxtı haradır? Bir cümlə ilə cavab ver.", "Bakı"]
    # the random tiny model likes newlines and special tokens, which answers drop: suppressed, so answers have text
    special = sorted(tok.added_tokens_decoder) + tok("\n\n\n", add_special_tokens=False)["input_ids"]
    greedy = GenerationConfig(do_sample=False, eos_token_id=tok.eos_token_id, suppress_tokens=special)
    tok.padding_side = "right"
    batched = eval_generate.answer_batched(model, tok, prompts, greedy, 7, 3, seed=0)
    single = [eval_generate.answer_batched(model, tok, [p], greedy, 7, 1, seed=0)[0] for p in prompts]
    assert batched == single and len({a for a, _, _ in batched}) >= 2  # answers depend on the prompt
    assert tok.padding_side == "right"  # restored for the tokenizer's other users
    assert all(not ended and n == 7 for _, ended, n in batched)  # a random tiny model never stops in 7 tokens
    # every token id is a stop: each answer ends at once, empty, having ended its turn
    stop_all = GenerationConfig(do_sample=False, eos_token_id=list(range(len(tok))))
    assert eval_generate.answer_batched(model, tok, prompts, stop_all, 7, 2, seed=0) == [("", True, 0)] * 3
    assert eval_generate.answer_batched(model, tok, prompts, greedy, 7, 2, seed=0) == single  # back in order

    # batches hold prompts of similar length: the two long prompts together, the two short ones together
    mixed = ["Bakı", prompts[1], "Salam", prompts[1] + " Qısa yaz."]
    widths = []
    generate = model.generate

    def recording(**kwargs):
        widths.append(kwargs["input_ids"].shape)
        return generate(**kwargs)

    model.generate = recording
    by_one = [eval_generate.answer_batched(model, tok, [p], greedy, 7, 1, seed=0)[0] for p in mixed]
    lengths = [shape[1] for shape in widths]
    widths.clear()
    assert eval_generate.answer_batched(model, tok, mixed, greedy, 7, 2, seed=0) == by_one
    assert [shape[1] for shape in widths] == [lengths[3], max(lengths[0], lengths[2])]
    del model.generate
    (folder / "generation_config.json").write_text(json_mod.dumps({"eos_token_id": 5, "repetition_penalty": 1.3}))
    adapter = tmp_path / "adapter"  # an SFT adapter's file holds only what SFT sets: the weights' config keeps the rest
    adapter.mkdir()
    (adapter / "generation_config.json").write_text(json_mod.dumps({"no_repeat_ngram_size": 4}))
    published = eval_generate.published_generation_config(model, (folder, None, adapter))
    assert published.repetition_penalty == 1.3 and published.eos_token_id == 5 and published.no_repeat_ngram_size == 4
    assert model.generation_config.no_repeat_ngram_size != 4  # the model's own config is left as loaded
