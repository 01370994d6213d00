#!/usr/bin/env python
"""Bench: does the assistant answer Azerbaijani questions in Azerbaijani, end its turn, not loop, not parrot?

Each HF model folder (an SFT artifact's `merged/`, a CPT artifact, the imported base) answers eval's held-out
assistant prompts (services/eval/dilforge_eval/prompts/assistant.jsonl: Azerbaijani, English, and the Azerbaijani
ones typed without Azerbaijani letters) and the 40 of `bench/heldout_az_prompts.txt` (written for this bench, in
none of the project's data; as typed and without the letters), in its chat template with `--system-prompt` (default
none, as az-small serves; docs/sft.md names the one each recipe run used), greedy and batched, through the folder's
own generation_config.json (the published defaults `serve` and HF `generate` use; `--repetition-penalty` /
`--no-repeat-ngram-size` override them). Scored by eval's assistant measures
(`dilforge_eval.assistant.score`: in the prompt's language by lingua, ended the turn, looping, parroting).
Optionally the held-out BPB (X-WMT, first 10 kB, window 256 stride 128 as eval) of each model against `--bpb-base`,
and `--interpolate CPT BASE ALPHA OUT`: write alpha·CPT + (1-alpha)·base for every tensor the base has (new
vocabulary rows keep CPT's values) before measuring.

  OMP_NUM_THREADS=2 python bench/assistant_recipe.py <sft>/merged [...] [--bpb-base <model artifact>/data-*]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import hardware  # bench/hardware.py

HERE = Path(__file__).resolve().parent


def prompt_groups(bench_file: Path) -> dict[str, list]:
    """eval's groups (az, en, az-no-diacritics) and this bench's 40 prompts (bench-az, bench-az-no-diacritics)."""
    from dilforge_eval.assistant import AssistantPrompt, groups, load_prompts, plain_variant

    out = groups(load_prompts("builtin:assistant"))
    lines = bench_file.read_text(encoding="utf-8").splitlines()
    mine = [AssistantPrompt(f"bench-{i}", "az", t.strip()) for i, t in enumerate(lines) if t.strip()[:1] not in "#"]
    out["bench-az"] = mine
    out["bench-az-no-diacritics"] = plain_variant(mine)
    return out


def generate(
    model, tok, prompts: list[str], max_new_tokens: int, batch_size: int, overrides: dict, system: str | None
) -> list[tuple]:
    """(answer text, ended its turn) per prompt: greedy, left-padded batches, the folder's generation config."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tok.padding_side = "left"
    out = []
    for i in range(0, len(prompts), batch_size):
        texts = [
            tok.apply_chat_template(
                [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for p in prompts[i : i + batch_size]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **overrides)
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            ended = any(t in eos for t in row)
            cut = next((k for k, t in enumerate(row) if t in eos), len(row))
            out.append((tok.decode(row[:cut], skip_special_tokens=True).strip(), ended))
    return out


def interpolate(cpt: str, base: str, alpha: float, out: str) -> str:
    """alpha·CPT + (1-alpha)·base for every base tensor; rows past the base's vocabulary keep CPT's values."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    cpt_sd = load_file(str(next(Path(cpt).glob("*.safetensors"))))
    base_sd = load_file(str(next(Path(base).glob("*.safetensors"))))
    merged = {}
    for name, w in cpt_sd.items():
        b = base_sd.get(name)
        if b is None:
            merged[name] = w
            continue
        w = w.float().clone()
        rows = b.shape[0]
        w[:rows] = alpha * w[:rows] + (1 - alpha) * b.float()
        merged[name] = w.to(cpt_sd[name].dtype).contiguous()
    Path(out).mkdir(parents=True, exist_ok=True)
    for f in Path(cpt).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, Path(out) / f.name)
    save_file(merged, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    del torch
    return out


def first_bytes(path: Path, limit: int = 10_000) -> list[str]:
    docs, size = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            docs.append(line.strip())
            size += len(line.encode("utf-8"))
            if size >= limit:
                break
    return docs


def bpb(model, tok, docs: list[str]) -> float:
    from dilforge_eval.measures import bits_per_byte

    return bits_per_byte(model, tok, docs, window=256, stride=128, batch_size=8).bpb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="HF model folders")
    ap.add_argument("--prompts", type=Path, default=HERE / "heldout_az_prompts.txt")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the README's curl asks for 64")
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--repetition-penalty", type=float, default=None)
    ap.add_argument("--no-repeat-ngram-size", type=int, default=None)
    ap.add_argument("--interpolate", nargs=4, action="append", default=[], metavar=("CPT", "BASE", "ALPHA", "OUT"))
    ap.add_argument("--bpb-base", help="model folder the BPB ratios are against (the imported base)")
    ap.add_argument(
        "--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", HERE.parent.parent / "shared/data"))
    )
    ap.add_argument(
        "--groups",
        default="az,az-no-diacritics,bench-az",
        help="comma-separated prompt groups (az, en, az-no-diacritics, bench-az, bench-az-no-diacritics)",
    )
    ap.add_argument("--system-prompt", default=None, help="system turn before each prompt (default: none)")
    ap.add_argument("--show", type=int, default=3, help="answers printed per model")
    args = ap.parse_args()

    import torch
    from dilforge_eval.assistant import Answer, score
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(hardware.describe("transformers", "lingua-language-detector"))
    models = [*args.models, *(interpolate(c, b, float(a), o) for c, b, a, o in args.interpolate)]
    prompt_sets = {g: p for g, p in prompt_groups(args.prompts).items() if g in args.groups.split(",")}
    overrides = {
        k: v
        for k, v in {
            "repetition_penalty": args.repetition_penalty,
            "no_repeat_ngram_size": args.no_repeat_ngram_size,
        }.items()
        if v is not None
    }
    sets = {
        "az": first_bytes(args.data / "az/dev/xwmt_test.az-en.az.txt"),
        "en": first_bytes(args.data / "az/dev/xwmt_test.az-en.en.txt"),
    }
    base_bpb = {}
    if args.bpb_base:
        tok = AutoTokenizer.from_pretrained(args.bpb_base, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(args.bpb_base, dtype=torch.float32, trust_remote_code=False).eval()
        base_bpb = {k: bpb(model, tok, d) for k, d in sets.items()}
        print(f"base BPB X-WMT az {base_bpb['az']:.4f} en {base_bpb['en']:.4f}")
    measures = ("in_language", "ended_turn", "looping", "parroting")
    rows = []
    for path in models:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False).eval()
        gen_config = {
            k: getattr(model.generation_config, k, None) for k in ("repetition_penalty", "no_repeat_ngram_size")
        }
        print(f"\n{path}  generation config {gen_config} overrides {overrides}")
        for group, prompts in prompt_sets.items():
            answers = generate(
                model,
                tok,
                [p.prompt for p in prompts],
                args.max_new_tokens,
                args.batch_size,
                overrides,
                args.system_prompt,
            )
            figures = score(
                [Answer(p.prompt, a, p.language, e, p.reference) for p, (a, e) in zip(prompts, answers, strict=True)]
            )
            cells = " | ".join(f"{getattr(figures, m).value:.3f}" for m in measures)
            chrf = f"{figures.chrf.score:.1f}" if figures.chrf else "-"
            rows.append(f"{Path(path).name[:40]} | {group} | {figures.n} | {cells} | {chrf}")
            for p, (a, e) in list(zip(prompts, answers, strict=True))[: args.show]:
                print(f"  [{group}] {'ended' if e else 'limit'}  {p.prompt[:45]}  ->  {a[:90]!r}")
            sys.stdout.flush()
        if base_bpb:
            ratios = " / ".join(f"{bpb(model, tok, d) / base_bpb[k]:.3f}" for k, d in sets.items())
            rows.append(f"{Path(path).name[:40]} | BPB X-WMT az / en × base | {ratios}")
        print("\n".join(rows[-len(prompt_sets) - bool(base_bpb) :]))
    print("\nmodel | group | n | " + " | ".join(measures) + " | chrF++")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
