"""Reliability numbers for docs/reliability.md: oversized inputs per stage, a frozen S3 endpoint, hashing cost.

    DILFORGE_DATA=../shared/data .venv/bin/python bench/reliability.py [--size-mb 200] [--skip-frozen]

1. A single-line file of --size-mb MB per stage, through `coordinator run <stage>`: exit code, the first
   error line, wall time, and the peak RSS of any process under a fresh wrapper (RUSAGE_CHILDREN).
2. `coordinator manifest show` against a loopback socket that accepts and never answers, with the default
   S3 timeouts and attempts: seconds until the one-line error.
3. What checking an artifact before reuse costs: `check_artifact` on a published 512 MiB artifact with
   sha256 (the default) and with the stamp fast path, as a ratio in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hardware import describe

WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:])\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def cli(tmp: Path, args: list[str], env_extra: dict | None = None) -> tuple[int, str, float, float]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DILFORGE_WORKDIR": str(tmp / "work"),
        "DILFORGE_CACHE": str(tmp / "cache"),
        "PYTHONWARNINGS": "ignore",
        **(env_extra or {}),
    }
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, sys.executable, "-m", "dilforge_coordinator.cli", *args],
        capture_output=True,
        env=env,
        timeout=900,
        check=False,
    )
    wall = time.monotonic() - start
    err = proc.stderr.decode(errors="replace")
    peak_mib = int(err.rsplit("PEAK_RSS_KB", 1)[1].split()[0]) / 1024 if "PEAK_RSS_KB" in err else float("nan")
    first = next((line for line in err.splitlines() if line.startswith("error:")), "")
    return proc.returncode, first, wall, peak_mib


def oversized(tmp: Path, size_mb: int) -> list[str]:
    import factories
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    tok_dir = factories.build_tokenizer(tmp / "tok")
    llama = factories.build_tiny_llama(tmp / "llama", tok_dir)
    block = ("söz " * 16384).encode()
    txt, jsonl = tmp / "one-line.txt", tmp / "one-line.jsonl"
    for path, head in ((txt, b""), (jsonl, b'{"messages": [{"role": "user", "content": "')):
        with open(path, "wb") as f:
            f.write(head)
            f.writelines(block for _ in range(size_mb * (1 << 20) // len(block)))
    tok_uri = f"{tmp}/store/artifacts/tokenizer/fixture"
    publish(
        tok_uri,
        tok_dir,
        Manifest(
            code_version="test",
            kind="tokenizer",
            artifact_id="fixture",
            run_id="f",
            stage="tokenizer",
            producer=current_producer("bench"),
            config={},
            data_dir="x",
            files=[],
        ),
    )
    tiny = factories.TINY_CPT_SECTION
    cases = {
        "tokenizer": ({"strategy": "replace", "corpora": [{"uri": str(txt)}], "vocab_sizes": [600]}, []),
        "cpt": ({**tiny, "corpora": [{"uri": str(txt)}]}, ["--input", f"tokenizer={tok_uri}"]),
        "sft": (
            {
                "base_model": str(llama),
                "train": [{"uri": str(jsonl), "layout": "messages"}],
                "num_steps": 1,
                "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                "max_length": 64,
            },
            [],
        ),
        "eval (max_bytes_per_set 20000)": (
            {
                "models": [{"label": "base", "uri": str(llama)}],
                "text_sets": [{"uri": str(txt), "name": "big"}],
                "max_bytes_per_set": 20000,
                "generation": {"max_new_tokens": 2, "num_prompts": 1},
                "bpb": {"window": 64, "stride": 32},
            },
            [],
        ),
        "tokenizer, on_oversize: skip": (
            {
                "strategy": "replace",
                "corpora": [
                    {"uri": str(txt), "on_oversize": "skip"},
                    {"uri": "${DILFORGE_DATA}/az/train/udhr_azj_latn.txt"},
                ],
                "vocab_sizes": [600],
            },
            [],
        ),
    }
    rows = []
    for name, (section, extra) in cases.items():
        stage = name.split()[0].rstrip(",")
        config = tmp / f"{stage}-{len(rows)}.yaml"
        config.write_text(
            yaml.safe_dump({"run_id": f"big{len(rows)}", "store": {"uri": str(tmp / "store")}, stage: section})
        )
        code, first, wall, peak = cli(tmp, ["run", stage, "-c", str(config), *extra])
        message = first.replace(str(tmp), "<tmp>")[:150] or "(succeeded)"
        rows.append(f"| {size_mb} MB single line → {name} | exit {code}: {message} | {peak:.0f} MiB | {wall:.1f} s |")
        print(rows[-1], flush=True)
    return rows


def frozen_endpoint(tmp: Path) -> str:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    for name in ("DILFORGE_S3_READ_TIMEOUT", "DILFORGE_S3_CONNECT_TIMEOUT", "DILFORGE_S3_MAX_ATTEMPTS"):
        os.environ.pop(name, None)
    try:
        code, first, wall, _ = cli(
            tmp, ["manifest", "show", "s3://bucket/artifact", "--s3-endpoint-url", endpoint], env
        )
    finally:
        server.close()
    row = f"| frozen S3 endpoint, default timeouts → manifest show | exit {code}: {first[:120]} | | {wall:.1f} s |"
    print(row, flush=True)
    return row


def verification(tmp: Path) -> list[str]:
    """check_artifact on a published 512 MiB artifact: sha256 mode against stamp mode, same process."""
    from dilforge_coordinator.integrity import check_artifact
    from dilforge_shared.manifest import Manifest, current_producer
    from dilforge_shared.store import publish

    out = tmp / "weights"
    out.mkdir()
    with open(out / "model.safetensors", "wb") as f:
        f.writelines(os.urandom(1 << 20) for _ in range(512))
    uri = str(tmp / "store" / "artifacts" / "cpt" / "big")
    publish(
        uri,
        out,
        Manifest(
            code_version="test",
            kind="model",
            artifact_id="big",
            run_id="b",
            stage="cpt",
            producer=current_producer("bench"),
            config={},
            data_dir="x",
            files=[],
        ),
    )
    timings = {}
    for mode in ("sha256", "stamp", "stamp"):  # the first stamp check hashes and records; the second is the fast path
        start = time.perf_counter()
        assert check_artifact(uri, mode=mode) is None
        timings[mode] = time.perf_counter() - start
    rows = [
        (
            f"| reuse check of a 512 MiB artifact, sha256 (default) | {512 / timings['sha256']:.0f} MiB/s "
            f"= {1024 / (512 / timings['sha256']):.1f} s per GiB | | {timings['sha256']:.2f} s |"
        ),
        (
            f"| same, DILFORGE_VERIFY_ON_REUSE=stamp (stats match the last full check) | "
            f"{timings['sha256'] / timings['stamp']:,.0f}x faster than sha256 | | {timings['stamp'] * 1000:.1f} ms |"
        ),
    ]
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--skip-frozen", action="store_true")
    parser.add_argument("--only-verify", action="store_true", help="Only the reuse-check timing.")
    args = parser.parse_args()
    print(describe("transformers", "boto3") + f"; load average {os.getloadavg()[0]:.1f}")
    print("| case | outcome | peak RSS | wall |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [] if args.only_verify else oversized(Path(tmp), args.size_mb)
        rows += verification(Path(tmp))
        if not (args.skip_frozen or args.only_verify):
            rows.append(frozen_endpoint(Path(tmp)))
    print(json.dumps({"rows": len(rows), "peak_rss_limit": "2 GiB"}))


if __name__ == "__main__":
    main()
