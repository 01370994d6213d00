"""Generations for a prompts file, and repetition measures (the stock model's failure mode in Azerbaijani
is repetitive, incoherent text, so the report measures repetition, not only shows samples)."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from dilforge_shared.errors import InputError
from dilforge_shared.families import GENERATION_CONFIG_FILE, Family, detect_family
from dilforge_shared.serving import stop_token_ids

from .assistant import ngrams, prompt_records, repeated_ngram_rate, words
from .config import GenerationSettings

log = logging.getLogger("dilforge.eval")


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: Literal["completion", "chat"]
    prompt: str


def load_prompts(uri: str, limit: int | None = None, endpoint_url: str | None = None) -> list[Prompt]:
    """JSONL {id, kind: completion|chat, prompt}, the first `limit` of them; errors name the file and line."""
    prompts = []
    for path, lineno, rec, pid, text in prompt_records(uri, endpoint_url):
        kind = rec.get("kind", "completion")
        if kind not in ("completion", "chat"):
            raise InputError(f"field 'kind' must be 'completion' or 'chat', got {kind!r}", path=path, line=lineno)
        prompts.append(Prompt(pid, kind, text))
        if limit and len(prompts) >= limit:
            break
    return prompts


def distinct_n(tokens: list[str], n: int) -> float | None:
    """Unique n-grams / all n-grams of one text (None if it has no n-gram)."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else None


def repetition(text: str) -> dict[str, float | None]:
    toks = words(text)
    return {
        "num_words": len(toks),
        "distinct_1": distinct_n(toks, 1),
        "distinct_2": distinct_n(toks, 2),
        "repeated_3gram_rate": repeated_ngram_rate(toks, 3),
    }


def mean_repetition(rows: Iterable[dict]) -> dict[str, float | None]:
    rows = list(rows)
    out: dict[str, float | None] = {"num_generations": len(rows)}
    for key in ("num_words", "distinct_1", "distinct_2", "repeated_3gram_rate"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = round(sum(vals) / len(vals), 4) if vals else None
    return out


def model_family(tokenizer, source: str) -> Family | None:
    """The tokenizer's family (stop tokens, fallback chat template); None for a tokenizer of no known family."""
    try:
        return detect_family(tokenizer.get_vocab(), source)
    except InputError as exc:
        log.warning("%s: generation stops on the EOS token only", exc)
        return None


def render_prompt(
    tokenizer, prompt: Prompt, family: Family | None = None, system_prompt: str | None = None
) -> tuple[str, bool]:
    """The model input text, and whether a chat template made it. A chat prompt goes through the tokenizer's chat
    template (`load_model` gives one of a known family's), as a server renders it (`serving_template`, with the
    system message a server inserts); a completion prompt is the family's BOS (none for ChatML) + text."""
    from dilforge_shared.serving import serving_template

    template = tokenizer.chat_template
    if prompt.kind == "chat" and template:
        messages = [{"role": "user", "content": prompt.prompt}]
        template = serving_template(template, system_prompt)
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template
        ), True
    # the family's BOS, not the tokenizer's: SmolLM2 names <|im_start|> as bos_token, but ChatML documents have none
    bos = (family.bos if family else tokenizer.bos_token) or ""
    return bos + prompt.prompt, False


def generate_kwargs(settings: GenerationSettings, mode: str, pad_id: int | None, stop: list[int]) -> dict:
    """The arguments of `model.generate` for one decoding mode (greedy ignores temperature/top_p)."""
    sampled = mode == "sampled"
    return {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": sampled,
        "pad_token_id": pad_id,
        "eos_token_id": stop or None,
        "repetition_penalty": settings.repetition_penalty,
        "no_repeat_ngram_size": settings.no_repeat_ngram_size,
        "temperature": settings.temperature if sampled else None,
        "top_p": settings.top_p if sampled else None,
        "top_k": 0 if sampled else None,
    }


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: list[Prompt],
    mode: str,
    settings: GenerationSettings,
    seed: int,
    source: str = "model",
    progress=None,
) -> list[dict]:
    """One answer per prompt; sampled answers are seeded per prompt so reruns match."""
    device = next(model.parameters()).device
    family = model_family(tokenizer, source)
    stop = stop_token_ids(tokenizer, family)
    out = []
    for i, p in enumerate(prompts):
        text, templated = render_prompt(tokenizer, p, family)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        if mode == "sampled":
            torch.manual_seed(seed + i)
        kwargs = generate_kwargs(settings, mode, tokenizer.pad_token_id, stop)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)[0, ids.shape[1] :]
        answer = tokenizer.decode(gen, skip_special_tokens=True)
        row = {"prompt_id": p.id, "kind": p.kind, "mode": mode, "chat_template": templated, "prompt": p.prompt}
        out.append({**row, "output": answer, "num_new_tokens": int(gen.shape[0]), **repetition(answer)})
        if progress is not None:
            progress.update(1)
    return out


def published_generation_config(model, folders: Iterable):
    """The generation defaults a consumer of the model gets: the loaded model's (its weights folder's), updated by
    the generation_config.json of each of `folders` that has one, in order (the weights', then an adapter's)."""
    gen = copy.deepcopy(model.generation_config)
    for folder in folders:
        if folder is not None and (folder / GENERATION_CONFIG_FILE).is_file():
            gen.update(**json.loads((folder / GENERATION_CONFIG_FILE).read_text(encoding="utf-8")))
    return gen


@torch.inference_mode()
def answer_batched(
    model,
    tokenizer,
    prompts: list[str],
    gen_config,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    system_prompt: str | None = None,
    source: str = "model",
    progress=None,
) -> list[tuple[str, bool, int]]:
    """(answer, ended the turn, new tokens) per prompt, in the prompts' order: one left-padded `generate` call per
    batch with the published generation config (only max_new_tokens set); ended = a stop token (the config's eos
    ids, else the tokenizer's EOS) came before the limit. Batches hold prompts of similar length (longest first), so
    left padding adds few positions to compute. Sampled configs are seeded per batch, so reruns match."""
    device = next(model.parameters()).device
    family = model_family(tokenizer, source)
    gen = copy.deepcopy(gen_config)
    gen.max_new_tokens = max_new_tokens
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    stops = {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    texts = [
        render_prompt(tokenizer, Prompt(str(i), "chat", p), family, system_prompt)[0] for i, p in enumerate(prompts)
    ]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    out: list[tuple[str, bool, int]] = [("", False, 0)] * len(texts)
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            batch_texts = [texts[i] for i in batch]
            enc = tokenizer(batch_texts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
            torch.manual_seed(seed + start)
            ids = model.generate(**enc, generation_config=gen)[:, enc["input_ids"].shape[1] :].tolist()
            for i, row in zip(batch, ids, strict=True):
                end = next((k for k, t in enumerate(row) if t in stops), None)
                kept = row if end is None else row[:end]
                out[i] = (tokenizer.decode(kept, skip_special_tokens=True).strip(), end is not None, len(kept))
            if progress is not None:
                progress.update(len(batch))
    finally:
        tokenizer.padding_side = side
    return out
