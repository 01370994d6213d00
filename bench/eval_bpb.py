"""Bench: BPB evaluation throughput (bytes/s) against a bare batched forward loop on the same model.

The baseline is what anyone would write first: cut the token stream into non-overlapping windows,
run `model(input_ids).logits` on batches of them and sum the cross-entropy over all positions.
dilforge's `bits_per_byte` is measured with the same window and batch at stride = window - 1 (same
work as the baseline, plus scoring the first token of each window) and at the default stride =
window / 2 (every token after the first window sees >= window/2 tokens of context; about 2x the work).

    python bench/eval_bpb.py                         # small random Llama on CPU, a few seconds per run
    python bench/eval_bpb.py --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --vocab 128256 --window 2048 \
        --bytes 2000000 --device cuda               # Llama-3.2-1B shape on a GPU
Needs the Azerbaijani data (DILFORGE_DATA, default ../shared/data) for text and the tokenizer.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import hardware  # bench/hardware.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # factories.llama3_bpe: BPE trained on text


def baseline_bytes_per_s(model, ids: list[int], num_bytes: int, window: int, batch_size: int) -> tuple[float, float]:
    """Bare loop: non-overlapping windows, full logits, cross-entropy over every position."""
    import torch
    from torch.nn import functional

    device = next(model.parameters()).device
    start = time.perf_counter()
    t = torch.tensor(ids)
    chunks = [t[i : i + window] for i in range(0, len(t) - 1, window - 1)]  # overlap 1 so every token is a target
    nll = 0.0
    with torch.inference_mode():
        for i in range(0, len(chunks), batch_size):
            group = chunks[i : i + batch_size]
            width = max(len(c) for c in group)
            batch = torch.zeros((len(group), width), dtype=torch.long)
            labels = torch.full((len(group), width), -100, dtype=torch.long)
            for r, c in enumerate(group):
                batch[r, : len(c)] = c
                labels[r, : len(c)] = c
            batch, labels = batch.to(device), labels.to(device)
            logits = model(input_ids=batch).logits
            nll += functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
            ).item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return num_bytes / seconds, nll / 0.6931471805599453 / num_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000, help="BPE size trained for the bench (tokenizer = model vocab)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bytes", type=int, default=150_000, help="UTF-8 bytes of text scored per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from dilforge_eval import measures as eval_bpb
    from dilforge_shared.corpus import iter_texts
    from dilforge_shared.families import LLAMA3
    from factories import llama3_bpe
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    data = Path(os.environ.get("DILFORGE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    print(hardware.describe("transformers"))
    wiki = list(itertools.islice(iter_texts(str(data / "az/train/azwiki_sentences_cv_extractor.txt")), 20000))
    raw = llama3_bpe(wiki, args.vocab)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=LLAMA3.bos, eos_token=LLAMA3.eot, pad_token=LLAMA3.pad
    )
    docs, size = [], 0
    for text in itertools.cycle(iter_texts(str(data / "az/train/az_legal_codes.part01.txt"))):
        if size >= args.bytes:
            break
        docs.append(text)
        size += len(text.encode()) + 1
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.window),
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=args.device, dtype=dtype).eval()
    stream = eval_bpb.encode_stream(tok, docs)  # family-framed stream (dilforge_shared.bpb)
    ids, num_bytes = stream.ids, stream.num_bytes
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, vocab {len(tok)}, {params / 1e6:.1f} M params, {dtype}; "
        f"text: {num_bytes} bytes, {len(ids) - 1} tokens; window {args.window}, batch {args.batch_size}"
    )

    def ours(stride: int) -> tuple[float, float]:
        res = eval_bpb.bits_per_byte(model, tok, docs, args.window, stride, args.batch_size)
        return res.num_bytes / res.seconds, res.bpb

    runs = {
        "baseline (bare forward, non-overlapping)": lambda: baseline_bytes_per_s(
            model, ids, num_bytes, args.window, args.batch_size
        ),
        f"bits_per_byte stride {args.window - 1}": lambda: ours(args.window - 1),
        f"bits_per_byte stride {args.window // 2} (default)": lambda: ours(args.window // 2),
    }
    for fn in runs.values():  # warm-up
        fn()
    results = {}
    for name, fn in runs.items():
        best = max((fn() for _ in range(args.repeats)), key=lambda r: r[0])
        results[name] = best
    base = next(iter(results.values()))[0]
    print(f"| run | bytes/s (best of {args.repeats}) | vs baseline | BPB |")
    print("|---|---:|---:|---:|")
    for name, (bps, bpb) in results.items():
        print(f"| {name} | {bps:,.0f} | {bps / base:.2f}x | {bpb:.4f} |")


if __name__ == "__main__":
    sys.exit(main())
