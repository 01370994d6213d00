"""Memory of reading an S3 parquet corpus: streamed through pyarrow.fs (what dilforge_shared.corpus does) vs the
whole object read into memory first (what it did before issue 22 item 7).

    .venv/bin/python bench/s3_parquet.py [--rows 60000] [--row-group 1000]

Writes a parquet of --rows 1 kB texts (uncompressed, --row-group rows per group) and the same three times over,
puts both on a local SeaweedFS server (tests/seaweed.py) and reads every text of each in a fresh process per
mode: the peak RSS above the process's state after imports and S3 start-up. Streamed, the peak does not grow
with the object; read whole, it grows with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hardware import describe

BUCKET = "bench-parquet"


def peak_rss_kib() -> int:
    """VmHWM: this process's own peak (ru_maxrss would carry the parent's over fork + exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def child(mode: str, key: str) -> None:
    """Read every text of s3://BUCKET/key; print {"rows", "peak_mib"} (RSS above the post-setup baseline)."""
    import pyarrow.parquet as pq
    from dilforge_shared.corpus import iter_texts, parquet_location
    from dilforge_shared.store import S3Storage

    storage = S3Storage(BUCKET, "")
    parquet_location(f"s3://{BUCKET}/{key}", None)[1].get_file_info(f"{BUCKET}/{key}")  # the SDK's start-up, unmeasured
    base = peak_rss_kib()
    if mode == "whole":
        import io

        data = storage.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        batches = pq.ParquetFile(io.BytesIO(data)).iter_batches(columns=["text"], batch_size=4096)
        texts = (v for b in batches for v in b.column(0).to_pylist())
    else:
        texts = iter_texts(f"s3://{BUCKET}/{key}")
    rows = sum(1 for _ in texts)
    peak = peak_rss_kib()
    print(json.dumps({"rows": rows, "peak_mib": round((peak - base) / 1024, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=60000)
    ap.add_argument("--row-group", type=int, default=1000)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "KEY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)

    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    import seaweed

    print(describe("pyarrow", "boto3"))
    work = Path(tempfile.mkdtemp(prefix="bench-parquet-"))
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz əöüğışç"
    table = pa.table({"text": ["".join(rng.choices(alphabet, k=1000)) for _ in range(args.rows)]})
    files = {"x1.parquet": work / "x1.parquet", "x3.parquet": work / "x3.parquet"}
    pq.write_table(table, files["x1.parquet"], row_group_size=args.row_group, compression="none")
    pq.write_table(
        pa.concat_tables([table] * 3), files["x3.parquet"], row_group_size=args.row_group, compression="none"
    )
    del table
    server = seaweed.start(work / "seaweed")
    env = {**os.environ, **server.env()}
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        print("| object | row groups | mode | rows read | peak RSS above baseline |")
        print("|---|---|---|---|---|")
        for key, path in files.items():
            client.upload_file(str(path), BUCKET, key)
            groups = pq.ParquetFile(path).num_row_groups
            for mode in ("whole", "streamed"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, key], env=env, capture_output=True, text=True
                )
                if out.returncode:
                    sys.exit(out.stderr)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                size = path.stat().st_size / 2**20
                print(f"| {size:.0f} MiB | {groups} | {mode} | {got['rows']:,} | {got['peak_mib']:.0f} MiB |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
