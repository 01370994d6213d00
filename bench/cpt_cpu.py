#!/usr/bin/env python
"""CPT stage on CPU against plain baselines, in the same process.

1. Training: tokens/s of the stage's real training loop (dilforge_cpt.stage.train: sampler, packed
   windows, phase logic, metrics, SIGTERM polling; logging every 10 steps, no eval/checkpoint inside
   the timed window) vs. a plain PyTorch loop (random windows, forward/backward, clip, AdamW) on the
   same tiny Llama, same batch and data. Goal ≥ 0.95×.
2. Tokenise + pack: documents/s of the stage's streamed tokenisation into the token cache (read,
   NFC, encode_batch, pack, write) vs. bare `Tokenizer.encode_batch` over the same documents already
   in memory. Goal ≥ 0.8×.

  OMP_NUM_THREADS=1 python bench/cpt_cpu.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import hardware  # bench/hardware.py
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # factories.llama3_bpe: BPE trained on text


def make_tokenizer(corpus: Path, out: Path, vocab: int) -> Path:
    from dilforge_shared.corpus import iter_texts
    from dilforge_shared.families import LLAMA3
    from dilforge_tokenizer import family_out
    from factories import llama3_bpe

    texts = list(itertools.islice(iter_texts(str(corpus)), 5000))
    family_out.write_folder(llama3_bpe(texts, vocab), out, LLAMA3)
    return out


def stage_ctx(root: Path, tok_dir: Path, config):
    from dilforge_shared.contract import OptMl, ResourceConfig, StageContext, StageRequest
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    uri = f"{root}/store/artifacts/tokenizer/bench"
    publish(
        uri,
        tok_dir,
        Manifest(
            code_version="test",
            kind="tokenizer",
            artifact_id="bench",
            run_id="bench",
            stage="tokenizer",
            producer=current_producer("bench"),
            config={},
            data_dir="pending",
            files=[],
        ),
    )
    req = StageRequest(
        config=config, artifact_uri=f"{root}/store/artifacts/cpt/bench", run_id="bench", inputs={"tokenizer": uri}
    )
    return StageContext(request=req, opt=OptMl(root / "opt_ml"), resources=ResourceConfig("algo-1", ["algo-1"]))


def plain_loop(config, vocab: int, tokens: np.ndarray, steps: int, warmup: int) -> float:
    """The baseline: what one would write by hand."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = config.scratch_model
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_hidden_layers=s.num_hidden_layers,
            num_attention_heads=s.num_attention_heads,
            num_key_value_heads=s.num_key_value_heads,
            tie_word_embeddings=True,
            use_cache=False,
        )
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.phase2.learning_rate, betas=(0.9, 0.95))
    L, B = config.seq_len, config.global_batch_size
    n_windows = len(tokens) // L
    rng = np.random.default_rng(0)
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        idx = rng.integers(0, n_windows, B)
        x = torch.from_numpy(np.stack([tokens[i * L : (i + 1) * L] for i in idx]).astype(np.int64))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
    return B * L * steps / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("DILFORGE_DATA", "../shared/data")))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--docs", type=int, default=20000, help="documents for the tokenisation benchmark")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.setdefault("DILFORGE_LOG_LEVEL", "WARNING")

    from dilforge_cpt import data, stage
    from dilforge_cpt.config import CptConfig
    from dilforge_shared.configs import DataSource
    from dilforge_shared.corpus import iter_texts

    print(f"# cpt_cpu  {hardware.describe('transformers')}")
    corpus = args.data / "az/train/azwiki_sentences_cv_extractor.txt"
    root = Path(tempfile.mkdtemp(prefix="cpt-bench-"))
    tok_dir = make_tokenizer(corpus, root / "tok", 2000)
    tok = data.load_tokenizer(tok_dir)
    ids = data.special_ids(tok, str(tok_dir))

    # ---- 2. tokenise + pack -----------------------------------------------------------------
    docs = list(itertools.islice(iter_texts(str(corpus)), args.docs))

    def bare_rate() -> float:
        t0 = time.perf_counter()
        for batch in data.batched(docs, 1000):
            tok.encode_batch(batch, add_special_tokens=False)
        return len(docs) / (time.perf_counter() - t0)

    bare_first = bare_rate()
    source = DataSource(uri=str(corpus))
    t0 = time.perf_counter()
    tf = data.tokenize_to_file(source, tok, ids, root / "cache", "bench", args.docs, 1000, None)
    ours = tf.num_docs / (time.perf_counter() - t0)
    bare = max(bare_first, bare_rate())  # the baseline's better of a run before and after ours
    print(
        f"tokenise+pack: stage {ours:,.0f} docs/s vs bare encode_batch {bare:,.0f} docs/s -> {ours / bare:.2f}x "
        f"(goal >= 0.8x; {tf.num_tokens:,} tokens)"
    )

    # ---- 1. training loop ---------------------------------------------------------------------
    log_every = 10
    config = CptConfig(
        scratch_model={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        corpora=[{"uri": str(corpus), "max_docs": args.docs}],
        validation=[{"uri": str(args.data / "az/dev/xwmt_test.az-en.az.txt")}],
        num_validation_docs=8,
        seq_len=args.seq_len,
        global_batch_size=args.batch,
        micro_batch_size=args.batch,
        phase1={"num_steps": 0},
        phase2={"num_steps": args.steps, "learning_rate": 1e-3},
        log_every=log_every,
        eval_every=10**6,
        checkpoint_every=10**6,
    )
    ctx = stage_ctx(root, tok_dir, config)
    arr = np.fromfile(tf.path, dtype=np.uint32)
    plain_before = plain_loop(config, tok.get_vocab_size(True), arr, args.steps - log_every, log_every)
    metrics = stage.train(config, ctx)
    timed = [h for h in metrics["history"] if h["step"] > log_every]  # the first interval is warmup
    tokens = len(timed) * log_every * args.batch * args.seq_len
    stage_tps = tokens / sum(log_every * args.batch * args.seq_len / h["tokens_per_s"] for h in timed)
    plain_after = plain_loop(config, tok.get_vocab_size(True), arr, args.steps - log_every, log_every)
    plain_tps = (plain_before + plain_after) / 2  # runs before and after the stage cancel machine-load drift
    print(
        f"training: stage {stage_tps:,.0f} tok/s vs plain PyTorch loop {plain_tps:,.0f} tok/s -> "
        f"{stage_tps / plain_tps:.2f}x (goal >= 0.95x; 2-layer 64-dim Llama, vocab {tok.get_vocab_size(True)}, "
        f"seq {args.seq_len}, batch {args.batch}, {args.steps - log_every} timed steps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
