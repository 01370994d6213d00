#!/usr/bin/env python
"""Bench: does the served assistant end its turn? Greedy answers of HF models to six Azerbaijani questions.

Each model folder (an SFT artifact's `merged/`) answers each question in its chat template with the az-small
system prompt, greedy, at most `--max-new-tokens` tokens (the README's curl asks for 64): an answer that produces
one of the model's end-of-turn ids (generation_config `eos_token_id`) ended its turn, one that hits the limit did
not. Prints each answer's start, and the count per model, so two SFT settings compare in one command.

  OMP_NUM_THREADS=2 python bench/turn_end.py <sft artifact>/data-*/merged [<another>/merged ...]
"""

from __future__ import annotations

import argparse

import hardware  # bench/hardware.py

SYSTEM = "Sən Azərbaycan dilində cavab verən faydalı köməkçisən."  # configs/az-small.yaml sft.system_prompt
QUESTIONS = [
    "Azərbaycanın paytaxtı haradır?",  # the README's curl
    "Bakı haqqında qısa məlumat ver.",
    "Salam, necəsən?",
    "Xəzər dənizi haradadır?",
    "Azərbaycan dilində neçə hərf var?",
    "Novruz bayramı nədir?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="HF model folders (an SFT artifact's merged/)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(hardware.describe("transformers"))
    for path in args.models:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False).eval()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        ended = 0
        print(f"\n{path}")
        for question in QUESTIONS:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            new = out[0, ids["input_ids"].shape[1] :].tolist()
            stopped = any(t in eos for t in new)
            ended += stopped
            answer = tok.decode(new, skip_special_tokens=True)
            print(f"  {'ended' if stopped else 'limit'}  {question}  ->  {answer[:80]!r}")
        print(f"ended its turn: {ended} / {len(QUESTIONS)}")


if __name__ == "__main__":
    main()
