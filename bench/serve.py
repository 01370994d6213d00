"""Serving bench: time to first token and tokens/s of `coordinator serve`'s server (transformers serve behind the
request guard) at concurrency 1, 4 and 8, against transformers `generate` on the same prompts, same model,
same greedy decoding, in the same run.

The model is the served folder itself (dilforge_serve.prepare: the SFT artifact's merged weights and the
serving chat template with the SFT system prompt), so both sides apply the same template and stop on the same
tokens. The baseline is what a hand-rolled endpoint does: `generate` per request, one after another (c = 1:
TTFT and tokens/s of one request; c = 4/8: the same requests queued, plus one *batched* `generate` of all c,
left-padded). The server gets c concurrent streamed requests from the `openai` client. TTFT is the time from the
round's start to a request's first streamed content (so a queued request counts its wait); tokens are counted by re-tokenising each answer (both sides), tokens/s is all answers'
tokens over the wall time of the round. Server and baseline use the same torch thread count.

    OMP_NUM_THREADS=2 python bench/serve.py --artifact .dilforge/store/artifacts/sft/<id> [--max-tokens 48]
    (default artifact: the az-small run's SFT artifact in .dilforge/store)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import hardware  # bench/hardware.py

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Azərbaycanın paytaxtı haradır?",
    "Bakı haqqında qısa məlumat ver.",
    "Xəzər dənizi nədir?",
    "Azərbaycan dilində üç meyvə adı yaz.",
    "Novruz bayramı necə qeyd olunur?",
    "Gəncə hansı ölkədədir?",
    "Çay necə dəmlənir?",
    "Kitab oxumağın faydaları nələrdir?",
]


def default_artifact() -> str:
    from dilforge_coordinator.records import run_artifact

    return run_artifact("az-small", str(ROOT / ".dilforge/store"), "sft")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats(rows: list[dict], wall: float) -> dict:
    return {
        "ttft_s": statistics.median(r["ttft"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
        "tokens_per_s": sum(r["tokens"] for r in rows) / wall,
        "wall_s": wall,
    }


# ---- baseline: transformers generate in this process ----------------------------------------------------


def generate_one(model, tok, prompt: str, max_tokens: int, t0: float | None = None) -> dict:
    """One request; TTFT counted from `t0` (the round's start: a queued request waits for the ones before it)."""
    import torch
    from transformers import TextIteratorStreamer

    enc = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter() if t0 is None else t0
    first = None
    out: dict = {}

    def run():
        with torch.no_grad():
            out["ids"] = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, streamer=streamer)

    worker = threading.Thread(target=run)
    worker.start()
    text = ""
    for piece in streamer:
        if piece and first is None:
            first = time.perf_counter() - start
        text += piece
    worker.join()
    return {
        "ttft": first if first is not None else time.perf_counter() - start,
        "text": text,
        "tokens": len(tok(text, add_special_tokens=False)["input_ids"]),
    }


def generate_batch(model, tok, prompts: list[str], max_tokens: int) -> dict:
    import torch

    tok.padding_side = "left"
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
    wall = time.perf_counter() - start
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return {"tokens": sum(len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers), "wall_s": wall}


# ---- the server -------------------------------------------------------------------------------------------


def start_server(artifact: str, port: int, workdir: Path, threads: int, cb: bool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log = open(workdir / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    (workdir / "served").mkdir(exist_ok=True)  # the server makes its own private folder inside
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dilforge_serve",
            artifact,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--workdir",
            str(workdir / "served"),
            "--log-level",
            "warning",
            *(["--continuous-batching"] if cb else []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {(workdir / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("server did not come up")


def server_one(client, model_id: str, tok, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    text = ""
    for chunk in client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    ):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            if first is None:
                first = time.perf_counter() - start
            text += piece
    return {
        "ttft": first if first is not None else time.perf_counter() - start,
        "text": text,
        "tokens": len(tok(text, add_special_tokens=False)["input_ids"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default=None, help="SFT artifact URI (default: the az-small run's)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument(
        "--continuous-batching",
        action="store_true",
        help="also a server with transformers' continuous batching (GPU; it hung on CPU)",
    )
    args = p.parse_args(argv)
    import openai
    import torch
    from dilforge_serve.prepare import prepare, resolve_served_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    artifact = args.artifact or default_artifact()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    spec = resolve_served_model(artifact)
    folder = prepare(spec, work / "baseline")
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=False).eval()
    print(hardware.describe("transformers", "fastapi", "uvicorn", "openai"))
    print(
        f"model {spec.description}; served as {spec.model_id}; greedy, max_tokens {args.max_tokens}; "
        f"torch threads {args.threads} (server and generate)"
    )
    generate_one(model, tok, PROMPTS[0], 4)  # warm-up

    baseline = {}
    for c in args.concurrency:
        prompts = PROMPTS[:c]
        start = time.perf_counter()
        rows = [generate_one(model, tok, q, args.max_tokens, start) for q in prompts]
        baseline[c] = {**stats(rows, time.perf_counter() - start), "answers": [r["text"] for r in rows]}
        if c > 1:
            baseline[c]["batched"] = generate_batch(model, tok, prompts, args.max_tokens)
    del model

    servers = {"server": False, **({"server, continuous batching": True} if args.continuous_batching else {})}
    # (continuous batching is for GPUs: on this CPU its first request did not finish in 10 minutes)
    served: dict[str, dict] = {}
    for label, cb in servers.items():
        port = free_port()
        proc = start_server(artifact, port, work, args.threads, cb)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
            server_one(client, spec.model_id, tok, PROMPTS[0], 4)  # warm-up
            served[label] = {}
            for c in args.concurrency:
                prompts = PROMPTS[:c]
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(c) as pool:
                    rows = list(
                        pool.map(lambda q, cl=client: server_one(cl, spec.model_id, tok, q, args.max_tokens), prompts)
                    )
                served[label][c] = {**stats(rows, time.perf_counter() - start), "answers": [r["text"] for r in rows]}
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    print(
        "\n| server | concurrency | TTFT median (s) | generate TTFT median (s) | tok/s | generate tok/s "
        "(one by one) | ratio | batched generate tok/s | same answers as generate |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, rounds in served.items():
        for c in args.concurrency:
            s, g = rounds[c], baseline[c]
            batched = f"{g['batched']['tokens'] / g['batched']['wall_s']:.1f}" if "batched" in g else "—"
            # a model that answers nothing (az-tiny) generates zero tokens: no ratio, not a crash
            ratio = f"{s['tokens_per_s'] / g['tokens_per_s']:.2f}x" if g["tokens_per_s"] else "n/a (0 tokens)"
            print(
                f"| {label} | {c} | {s['ttft_s']:.3f} | {g['ttft_s']:.3f} | {s['tokens_per_s']:.1f} | "
                f"{g['tokens_per_s']:.1f} | {ratio} | {batched} | "
                f"{sum(a == b for a, b in zip(s['answers'], g['answers'], strict=False))}/{c} |"
            )
    print(f"\nanswer to {PROMPTS[0]!r}: {served['server'][1]['answers'][0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
