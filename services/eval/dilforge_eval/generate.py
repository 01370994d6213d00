"""Generations for a prompts file, and repetition measures (the stock model's failure mode in Azerbaijani
is repetitive, incoherent text, so the report measures repetition, not only shows samples)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from dilforge_shared.corpus import iter_records
from dilforge_shared.errors import InputError

from .morph import az_lower

_WORDS = re.compile(r"\w+")


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: Literal["completion", "chat"]
    prompt: str


BUILTIN = "builtin:"


def resolve_prompts_uri(uri: str) -> str:
    """`builtin:NAME` is a prompts file shipped inside this package, so it exists in every image and job."""
    if not uri.startswith(BUILTIN):
        return uri
    from importlib.resources import files
    name = uri.removeprefix(BUILTIN)
    path = files("dilforge_eval") / "prompts" / f"{name}.jsonl"
    if not path.is_file():
        shipped = sorted(p.name.removesuffix(".jsonl") for p in (files("dilforge_eval") / "prompts").iterdir())
        raise InputError(f"no built-in prompts {name!r}; built-in: {shipped}", path=uri)
    return str(path)


def load_prompts(uri: str, limit: int | None = None, endpoint_url: str | None = None) -> list[Prompt]:
    """JSONL {id, kind: completion|chat, prompt}; errors name the file and line."""
    uri = resolve_prompts_uri(uri)
    prompts, seen = [], set()
    for lineno, rec in iter_records(uri, endpoint_url):
        kind = rec.get("kind", "completion")
        if kind not in ("completion", "chat"):
            raise InputError(f"field 'kind' must be 'completion' or 'chat', got {kind!r}", path=uri, line=lineno)
        text = rec.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise InputError("field 'prompt' missing or empty", path=uri, line=lineno)
        pid = str(rec.get("id", f"line{lineno}"))
        if pid in seen:
            raise InputError(f"duplicate prompt id {pid!r}", path=uri, line=lineno)
        seen.add(pid)
        prompts.append(Prompt(pid, kind, text))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise InputError("prompts file holds no prompt", path=uri)
    return prompts


def words(text: str) -> list[str]:
    return _WORDS.findall(az_lower(text))


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(tokens: list[str], n: int) -> float | None:
    """Unique n-grams / all n-grams of one text (None if it has no n-gram)."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else None


def repeated_ngram_rate(tokens: list[str], n: int = 3) -> float | None:
    """Share of n-gram occurrences that repeat an n-gram seen earlier in the same text."""
    grams = ngrams(tokens, n)
    if not grams:
        return None
    return sum(c - 1 for c in Counter(grams).values()) / len(grams)


def repetition(text: str) -> dict[str, float | None]:
    toks = words(text)
    return {"num_words": len(toks), "distinct_1": distinct_n(toks, 1), "distinct_2": distinct_n(toks, 2),
            "repeated_3gram_rate": repeated_ngram_rate(toks, 3)}


def mean_repetition(rows: Iterable[dict]) -> dict[str, float | None]:
    rows = list(rows)
    out: dict[str, float | None] = {"num_generations": len(rows)}
    for key in ("num_words", "distinct_1", "distinct_2", "repeated_3gram_rate"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[key] = round(sum(vals) / len(vals), 4) if vals else None
    return out


def render_prompt(tokenizer, prompt: Prompt) -> tuple[str, bool]:
    """The model input text; chat prompts use the tokenizer's chat template when it has one."""
    if prompt.kind == "chat" and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return text, True
    bos = tokenizer.bos_token or ""
    return bos + prompt.prompt, False


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[Prompt], mode: str, max_new_tokens: int, temperature: float,
             top_p: float, repetition_penalty: float, seed: int) -> list[dict]:
    """One answer per prompt; sampled answers are seeded per prompt so reruns match."""
    device = next(model.parameters()).device
    stop = [t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>"),
                        tokenizer.convert_tokens_to_ids("<|end_of_text|>")} if isinstance(t, int) and t >= 0
            and t != tokenizer.unk_token_id]
    out = []
    for i, p in enumerate(prompts):
        text, templated = render_prompt(tokenizer, p)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": mode == "sampled",
                  "pad_token_id": tokenizer.pad_token_id, "eos_token_id": stop or None,
                  "repetition_penalty": repetition_penalty}
        if mode == "sampled":
            torch.manual_seed(seed + i)
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)[0, ids.shape[1]:]
        answer = tokenizer.decode(gen, skip_special_tokens=True)
        out.append({"prompt_id": p.id, "kind": p.kind, "mode": mode, "chat_template": templated,
                    "prompt": p.prompt, "output": answer, "num_new_tokens": int(gen.shape[0]), **repetition(answer)})
    return out
