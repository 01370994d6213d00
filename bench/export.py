#!/usr/bin/env python
"""GGUF export parity (issue 34): does llama.cpp read and run the exported model as transformers does?

For each GGUF (`coordinator export`) against the HF folder it came from (an SFT artifact's merged/, or a CPT
artifact), on this machine's CPU, in one process:

- tokenization: llama.cpp's ids of every line of the eval sets (FLORES dev Azerbaijani and English, X-WMT
  test Azerbaijani and English) against the HF tokenizer's (no special tokens added); mismatching lines;
- next-token agreement: the top-1 next token of llama.cpp and of transformers at every position of held-out
  text (X-WMT, never trained on; `--num-windows` windows of `--window` HF tokens per language), and at the
  decisive positions only (transformers' first choice ahead of its second by >= 1 logit): where a quant flips a
  near-tie, the second figure shows it;
- file size, and generation tokens/s (greedy, `--new-tokens` tokens after one prompt) of llama.cpp and of
  transformers on the same threads;
- with `--chat`: a chat completion through llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`)
  that must end with finish_reason "stop" at the end of the assistant's turn.

  python bench/export.py --hf MODEL_DIR --gguf a-f16.gguf --gguf a-q8_0.gguf --data ../shared/data [--chat]
      [--check f16=0.99,q8_0=0.97] [--json out.json]

`--check` makes it a test: exit 1 unless every line tokenizes identically and each named quant's agreement is
at least its bar (CI runs it on the README main job's SFT artifact: scripts/ci_export.sh).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hardware import describe  # noqa: E402

SETS = {
    "flores-dev-az": ("az/dev/flores200.dev.partial_from_sib200.tsv", "azj_Latn"),
    "flores-dev-en": ("az/dev/flores200.dev.partial_from_sib200.tsv", "eng_Latn"),
    "xwmt-az": ("az/dev/xwmt_test.az-en.az.txt", None),
    "xwmt-en": ("az/dev/xwmt_test.az-en.en.txt", None),
}
HELD_OUT = ("xwmt-az", "xwmt-en")


def lines_of(data: Path, name: str) -> list[str]:
    path, column = SETS[name]
    text = (data / path).read_text(encoding="utf-8")
    if column is None:
        return [line for line in text.splitlines() if line.strip()]
    return [row[column] for row in csv.DictReader(text.splitlines(), delimiter="\t") if row[column].strip()]


def quant_of(path: Path) -> str:
    return path.stem.rsplit("-", 1)[-1]


def load_llama(path: Path, n_ctx: int, logits_all: bool = False, vocab_only: bool = False):
    from llama_cpp import Llama

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        logits_all=logits_all,
        vocab_only=vocab_only,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def tokenization(gguf: Path, tokenizer, data: Path) -> dict:
    """Lines whose llama.cpp ids differ from the HF tokenizer's, per set (and the first one, to read)."""
    llm = load_llama(gguf, 512, vocab_only=True)
    out = {}
    for name in SETS:
        lines = lines_of(data, name)
        bad = [
            line
            for line in lines
            if llm.tokenize(line.encode(), add_bos=False, special=False)
            != tokenizer(line, add_special_tokens=False)["input_ids"]
        ]
        out[name] = {"lines": len(lines), "mismatched": len(bad), "first_mismatch": bad[0] if bad else None}
    return out


def windows(tokenizer, data: Path, name: str, window: int, count: int) -> list[list[int]]:
    ids: list[int] = []
    for line in lines_of(data, name):
        ids += tokenizer(line + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= window * count:
            break
    return [ids[i * window : (i + 1) * window] for i in range(min(count, len(ids) // window))]


DECISIVE_MARGIN = 1.0  # logit gap (nats) between transformers' first and second choice


def hf_top1(model, wins: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' top-1 next token at every position, and its logit margin over the second choice."""
    import torch

    out = []
    with torch.no_grad():
        for w in wins:
            top2 = model(input_ids=torch.tensor([w])).logits[0].float().topk(2, dim=-1)
            out.append((top2.indices[:, 0].tolist(), (top2.values[:, 0] - top2.values[:, 1]).tolist()))
    return out


def agreement(gguf: Path, wins: list[list[int]], reference, window: int) -> tuple[float, float]:
    """(top-1 agreement at every position, at the decisive ones: transformers' margin >= DECISIVE_MARGIN)."""
    import numpy as np

    llm = load_llama(gguf, window + 8, logits_all=True)
    same = total = same_decisive = decisive = 0
    for w, (ref, margin) in zip(wins, reference, strict=True):
        llm.reset()
        llm.eval(w)
        hit = np.asarray(llm.scores[: len(w)]).argmax(-1) == np.asarray(ref)
        sure = np.asarray(margin) >= DECISIVE_MARGIN
        same, total = same + int(hit.sum()), total + len(w)
        same_decisive, decisive = same_decisive + int(hit[sure].sum()), decisive + int(sure.sum())
    return same / total, same_decisive / max(1, decisive)


def generation_speed(gguf: Path, model, tokenizer, new_tokens: int) -> dict:
    import torch

    prompt = "Azərbaycan Respublikasının paytaxtı"
    llm = load_llama(gguf, 512)
    t0 = time.perf_counter()
    done = llm.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, top_k=1)
    llama_s = time.perf_counter() - t0
    llama_tokens = done["usage"]["completion_tokens"]
    ids = tokenizer(prompt, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    hf_s = time.perf_counter() - t0
    hf_tokens = gen.shape[1] - ids["input_ids"].shape[1]
    return {
        "llama_cpp_tok_s": llama_tokens / llama_s,
        "transformers_tok_s": hf_tokens / hf_s,
        "llama_cpp_tokens": llama_tokens,
    }


def chat_through_server(gguf: Path, question: str) -> dict:
    """One chat completion through llama.cpp's OpenAI-compatible server, on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_ctx", "1024", "--verbose", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited {proc.returncode}: {proc.stdout.read()[-2000:]}")
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 128, "temperature": 0}
        request = urllib.request.Request(
            f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=300).read())
        choice = reply["choices"][0]
        return {"finish_reason": choice["finish_reason"], "content": choice["message"]["content"]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, type=Path, help="the HF folder the GGUFs were exported from")
    ap.add_argument("--gguf", action="append", required=True, type=Path, help="an exported file (repeatable)")
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--num-windows", type=int, default=8, help="windows of held-out text per language")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="also one chat completion through llama_cpp.server")
    ap.add_argument("--question", default="Azərbaycanın paytaxtı haradır?", help="the chat question (README's)")
    ap.add_argument("--check", default=None, help="quant=bar,...: fail below these top-1 agreements")
    ap.add_argument(
        "--decisive-bar", type=float, default=None, help="fail when any file's agreement at decisive positions is below"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(describe("transformers", "llama-cpp-python"), flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(args.hf), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(args.hf), dtype=torch.float32, trust_remote_code=False).eval()
    wins = {name: windows(tokenizer, args.data, name, args.window, args.num_windows) for name in HELD_OUT}
    reference = {name: hf_top1(model, w) for name, w in wins.items()}
    results = {}
    for gguf in args.gguf:
        row = {"size_mb": gguf.stat().st_size / 1e6, "tokenization": tokenization(gguf, tokenizer, args.data)}
        both = {n: agreement(gguf, wins[n], reference[n], args.window) for n in HELD_OUT}
        row["top1_agreement"] = {n: v[0] for n, v in both.items()}
        row["top1_agreement_decisive"] = {n: v[1] for n, v in both.items()}
        row["speed"] = generation_speed(gguf, model, tokenizer, args.new_tokens)
        if args.chat:
            row["chat"] = chat_through_server(gguf, args.question)
        results[quant_of(gguf)] = row
        mismatched = sum(s["mismatched"] for s in row["tokenization"].values())
        lines = sum(s["lines"] for s in row["tokenization"].values())
        print(
            f"{gguf.name}: {row['size_mb']:.1f} MB; tokenization {lines - mismatched}/{lines} lines identical; "
            f"top-1 agreement {', '.join(f'{n} {v:.4f}' for n, v in row['top1_agreement'].items())} "
            f"(decisive positions {', '.join(f'{v:.4f}' for v in row['top1_agreement_decisive'].values())}); "
            f"generation {row['speed']['llama_cpp_tok_s']:.1f} tok/s llama.cpp vs "
            f"{row['speed']['transformers_tok_s']:.1f} transformers"
            + (
                f"; chat finish_reason {row['chat']['finish_reason']!r}: {row['chat']['content'][:80]!r}"
                if args.chat
                else ""
            ),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"header": describe(), "results": results}, indent=1))
    failures = []
    for quant, row in results.items():
        failures += [
            f"{quant}: {n}: {s['mismatched']} of {s['lines']} lines tokenize differently (first: {s['first_mismatch']!r})"
            for n, s in row["tokenization"].items()
            if s["mismatched"]
        ]
        if args.chat and row["chat"]["finish_reason"] != "stop":
            failures.append(f"{quant}: the chat answer ended with {row['chat']['finish_reason']!r}, not 'stop'")
    for item in filter(None, (args.check or "").split(",")):
        quant, bar = item.split("=")
        if quant in results:
            worst = min(results[quant]["top1_agreement"].values())
            if worst < float(bar):
                failures.append(f"{quant}: top-1 agreement {worst:.4f} < {bar}")
    if args.decisive_bar is not None:
        failures += [
            f"{quant}: top-1 agreement at decisive positions {min(row['top1_agreement_decisive'].values()):.4f} "
            f"< {args.decisive_bar}"
            for quant, row in results.items()
            if min(row["top1_agreement_decisive"].values()) < args.decisive_bar
        ]
    for failure in failures:
        print("FAIL", failure, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
