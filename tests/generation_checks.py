"""Does stock `generate` end an answer at the family's end of turn? (no stopping criteria passed in)

A random tiny model never chooses to end its turn, so the check makes it: it decodes greedily once with
every stop disabled, picks the latest new token that is neither special nor seen before, and swaps that
token's output row (lm_head only; inputs unchanged) with the end-of-turn row. Up to that step the logits
are the same permutation of the same numbers, so the model now emits the end of turn exactly there. Stock
`generate`, reading only the folder's generation_config.json, must stop right after it; a folder whose
eos names only the end of text (the defect of issue 20) runs on.
"""

from __future__ import annotations

import copy
from pathlib import Path

PROMPT = [{"role": "user", "content": "Azərbaycanın paytaxtı haradır?"}]


def published_ids(folder: Path) -> dict:
    """bos/eos/pad of a folder's generation_config.json, read by transformers itself."""
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(str(folder))
    return {"bos_token_id": gen.bos_token_id, "eos_token_id": gen.eos_token_id, "pad_token_id": gen.pad_token_id}


def expected_ids(tok) -> dict:
    """What the family says, computed from the tokenizer's own vocabulary."""
    from dilforge_shared.families import detect_family

    family = detect_family(tok.get_vocab(), "test tokenizer")
    eos = [tok.convert_tokens_to_ids(t) for t in family.stop_tokens if t in tok.get_vocab()]
    return {
        "bos_token_id": tok.convert_tokens_to_ids(family.bos) if family.bos else None,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": tok.convert_tokens_to_ids(family.pad),
    }


def assert_stock_generate_stops_at_end_of_turn(model, tok, max_new_tokens: int = 10) -> list[int]:
    """`model` as loaded by stock from_pretrained (its generation_config from the folder). Returns the answer ids."""
    import torch
    from dilforge_shared.families import detect_family

    family = detect_family(tok.get_vocab(), "test tokenizer")
    eot = tok.convert_tokens_to_ids(family.eot)
    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    n = enc["input_ids"].shape[1]
    free_config = copy.deepcopy(model.generation_config)
    free_config.eos_token_id = None
    free_config.pad_token_id = eot
    free_config.max_new_tokens, free_config.do_sample = max_new_tokens, False
    with torch.no_grad():
        free = model.generate(**enc, generation_config=free_config)[0, n:].tolist()
    special = set(tok.all_special_ids) | {eot}
    if eot in free:  # a trained model may end its turn by itself: stock generate must stop right there
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)[0, n:].tolist()
        assert out == free[: free.index(eot) + 1], (out, free)
        return out
    k = [i for i, t in enumerate(free) if t not in special and t not in free[:i]][-1]
    assert not special & set(free[:k]), "the unconstrained answer already holds a special token"
    head = model.get_output_embeddings()
    weight = head.weight.detach().clone()
    weight[[free[k], eot]] = weight[[eot, free[k]]]
    head.weight = torch.nn.Parameter(weight)  # unties: the input embeddings stay as they were
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)[0, n:].tolist()
    assert out == free[:k] + [eot], (out, free, k)
    return out
