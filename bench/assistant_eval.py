#!/usr/bin/env python
"""Bench: what the eval stage's assistant measures cost per model, batched against one prompt at a time.

Loads each HF model folder as the eval stage does (`dilforge_eval.resolve.load_model`), answers the shipped
held-out prompts (`builtin:assistant`, `--per-language` of each language plus the Azerbaijani ones without
diacritics) through the folder's generation_config.json with `max_new_tokens` and batches as eval.assistant
sets them (`dilforge_eval.generate.answer_batched`), and prints the seconds, the tokens generated and the
figures (`dilforge_eval.assistant.score`). `--unbatched N` also answers the first N prompts one at a time, so the
saving of batching is measured on the same machine, not assumed.

  OMP_NUM_THREADS=2 python bench/assistant_eval.py <model folder> [...] [--per-language 40] [--unbatched 16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import hardware  # bench/hardware.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path, help="HF model folders (config.json, weights, tokenizer).")
    parser.add_argument("--per-language", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--unbatched", type=int, default=0, help="Also answer the first N prompts one at a time.")
    args = parser.parse_args()

    from dilforge_eval import assistant as A
    from dilforge_eval import generate as G
    from dilforge_eval.resolve import EvalModel, load_model

    print(hardware.describe("transformers", "lingua-language-detector"))
    groups = A.groups(A.load_prompts("builtin:assistant", args.per_language))
    prompts = [p for ps in groups.values() for p in ps]
    print(
        f"{len(prompts)} prompts ({', '.join(f'{g} {len(p)}' for g, p in groups.items())}), "
        f"max_new_tokens {args.max_new_tokens}, batch {args.batch_size}"
    )
    for folder in args.models:
        model, tok = load_model(EvalModel(folder, None, folder, "", label=folder.name), "cpu", None)
        gen = G.published_generation_config(model, (folder,))
        t0, c0 = time.perf_counter(), time.process_time()
        answers = G.answer_batched(
            model, tok, [p.prompt for p in prompts], gen, args.max_new_tokens, args.batch_size, seed=0
        )
        batched_s, batched_cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(n for _, _, n in answers)
        print(
            f"\n{folder}: {batched_s:.1f} s batched, {batched_cpu:.1f} CPU s over all threads (a shared machine's "
            f"wall time inflates; CPU s / threads is the idle wall time) ({tokens} new tokens, "
            f"{batched_cpu / len(prompts):.2f} CPU s per prompt)"
        )
        if args.unbatched:
            subset = [p.prompt for p in prompts[: args.unbatched]]
            c0 = time.process_time()
            for text in subset:
                G.answer_batched(model, tok, [text], gen, args.max_new_tokens, 1, seed=0)
            one_cpu = (time.process_time() - c0) / len(subset)
            print(
                f"  one at a time: {one_cpu:.2f} CPU s per prompt on the first {len(subset)} "
                f"(batched {batched_cpu / len(prompts):.2f}): {one_cpu / (batched_cpu / len(prompts)):.1f}x"
            )
        start = 0
        for group, ps in groups.items():
            rows = answers[start : start + len(ps)]
            start += len(ps)
            f = A.score(
                [A.Answer(p.prompt, a, p.language, e, p.reference) for p, (a, e, _) in zip(ps, rows, strict=True)]
            )
            print(
                f"  {group:17s} n {f.n}: in language {f.in_language.value:.2f} [{f.in_language.low:.2f}-"
                f"{f.in_language.high:.2f}], ended the turn {f.ended_turn.value:.2f}, looping {f.looping.value:.2f}, "
                f"parroting {f.parroting.value:.2f}" + (f", chrF++ {f.chrf.score:.1f}" if f.chrf else "")
            )


if __name__ == "__main__":
    main()
