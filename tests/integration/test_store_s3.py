"""The artifact store against a real S3 server (SeaweedFS on 127.0.0.1)."""

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from dilforge_shared import store as backends
from dilforge_shared.errors import ArtifactExistsError, InputError, IntegrityError
from dilforge_shared.store import S3Storage, fetch, publish, read_manifest
from factories import make_manifest, write_output


def test_publish_read_round_trip(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/proj/artifacts/tokenizer/abc"
    published = publish(uri, write_output(tmp_path), make_manifest())
    art = fetch(uri, cache_dir=tmp_path / "cache")
    assert art.manifest == published
    assert (art.path / "model.safetensors").read_bytes() == b"weights"
    assert read_manifest(uri)[1] == art.manifest_sha256


def test_a_fetch_without_a_cache_folder_uses_the_one_download_cache(s3_bucket, tmp_path, monkeypatch):
    """DILFORGE_CACHE, else ~/.cache/dilforge: the folder gc looks in, the same for every store download."""
    uri = f"{s3_bucket}/one-cache"
    publish(uri, write_output(tmp_path), make_manifest())
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "named"))
    assert fetch(uri).path.is_relative_to(tmp_path / "named" / "artifacts")
    monkeypatch.delenv("DILFORGE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch(uri).path.is_relative_to(tmp_path / "home" / ".cache" / "dilforge" / "artifacts")


def test_multipart_upload_round_trips(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "MULTIPART_THRESHOLD", 5 << 20)
    out = tmp_path / "big"
    out.mkdir()
    payload = os.urandom(11 << 20)
    (out / "model.safetensors").write_bytes(payload)
    uri = f"{s3_bucket}/big"
    publish(uri, out, make_manifest())
    bucket = s3_bucket.removeprefix("s3://")
    m = read_manifest(uri)[0]
    head = S3Storage(bucket, "").client.head_object(Bucket=bucket, Key=f"big/{m.data_dir}/model.safetensors")
    assert "-" in head["ETag"], "expected a multipart ETag"
    assert (fetch(uri, cache_dir=tmp_path / "c").path / "model.safetensors").read_bytes() == payload


def test_tampered_object_is_detected(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/t"
    m = publish(uri, write_output(tmp_path), make_manifest())
    bucket = s3_bucket.removeprefix("s3://")
    S3Storage(bucket, "").client.put_object(Bucket=bucket, Key=f"t/{m.data_dir}/model.safetensors", Body=b"weightz")
    with pytest.raises(IntegrityError, match="model.safetensors does not match its sha256"):
        fetch(uri, cache_dir=tmp_path / "cache")


def test_missing_object_is_detected(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/m"
    m = publish(uri, write_output(tmp_path), make_manifest())
    bucket = s3_bucket.removeprefix("s3://")
    S3Storage(bucket, "").client.delete_object(Bucket=bucket, Key=f"m/{m.data_dir}/sub/config.json")
    with pytest.raises(IntegrityError, match="sub/config.json listed in the manifest is missing"):
        fetch(uri, cache_dir=tmp_path / "cache")


def test_manifest_is_never_overwritten(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/o"
    first = publish(uri, write_output(tmp_path, "a", b"first"), make_manifest())
    with pytest.raises(ArtifactExistsError):
        publish(uri, write_output(tmp_path, "b", b"second"), make_manifest())
    assert read_manifest(uri)[0] == first
    # the create-only write itself refuses, even when the early existence check is bypassed
    backend = S3Storage(s3_bucket.removeprefix("s3://"), "o")
    assert backend.create_bytes("manifest.json", b"{}") is False


CONCURRENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from dilforge_shared.errors import ArtifactExistsError
    from dilforge_shared.store import publish
    from factories import make_manifest
    out = Path(sys.argv[1])
    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
    try:
        publish({uri!r}, out, make_manifest())
        print("won")
    except ArtifactExistsError:
        print("lost")
""")


def test_concurrent_publishers_exactly_one_wins(s3_bucket, tmp_path):
    import time

    uri = f"{s3_bucket}/race"
    script = tmp_path / "pub.py"
    script.write_text(CONCURRENT.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), uri=uri))
    outs = [write_output(tmp_path, f"o{i}", f"version {i}".encode() * 1000) for i in range(3)]
    start = str(time.time() + 3)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(o), start], stdout=subprocess.PIPE, text=True) for o in outs
    ]
    results = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(results) == ["lost", "lost", "won"], results
    art = fetch(uri, cache_dir=tmp_path / "cache")  # the winner's files are intact and verified
    bucket = s3_bucket.removeprefix("s3://")
    data_dirs = {k.split("/")[0] for k in S3Storage(bucket, "race").list("")} - {"manifest.json"}
    from dilforge_shared.store import manifest_digest_key

    winner = art.manifest.data_dir
    assert data_dirs == {winner, manifest_digest_key(winner)}, "losers must remove their files and digests"


def test_missing_s3_corpus_object_is_named(s3_bucket):
    from dilforge_shared.corpus import iter_texts

    with pytest.raises(InputError, match=f"{s3_bucket}/corpus/nope.txt: no such S3 object"):
        list(iter_texts(f"{s3_bucket}/corpus/nope.txt"))


def test_s3_corpus_streams_gz_and_jsonl(s3_bucket):
    import gzip
    import json

    from dilforge_shared.corpus import iter_texts

    bucket = s3_bucket.removeprefix("s3://")
    client = S3Storage(bucket, "").client
    client.put_object(Bucket=bucket, Key="c/a.txt.gz", Body=gzip.compress("bir\nIki\u0307\n".encode()))
    client.put_object(Bucket=bucket, Key="c/b.jsonl", Body=(json.dumps({"t": "üç"}) + "\n").encode())
    import unicodedata

    assert list(iter_texts(f"{s3_bucket}/c", text_field="t")) == [
        "bir",
        unicodedata.normalize("NFC", "Iki\u0307"),
        "üç",
    ]


def test_s3_parquet_streams_every_row_group_in_order(s3_bucket, tmp_path):
    """An S3 parquet is read through pyarrow.fs by ranges (a row group at a time), not downloaded whole: all
    of several row groups come back in order, and a damaged object's error names it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from dilforge_shared.corpus import iter_located_texts

    texts = [f"cümlə {i}" for i in range(2500)]
    local = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), local, row_group_size=300)
    assert pq.ParquetFile(local).num_row_groups == 9
    bucket = s3_bucket.removeprefix("s3://")
    client = S3Storage(bucket, "").client
    client.put_object(Bucket=bucket, Key="p/c.parquet", Body=local.read_bytes())
    client.put_object(Bucket=bucket, Key="p/bad.parquet", Body=b"PAR1 not really")
    uri = f"{s3_bucket}/p/c.parquet"
    assert list(iter_located_texts(uri, text_field="body")) == [(uri, i + 1, t) for i, t in enumerate(texts)]
    with pytest.raises(InputError, match=f"{s3_bucket}/p/bad.parquet: not a readable parquet file"):
        list(iter_located_texts(f"{s3_bucket}/p/bad.parquet", text_field="body"))
    with pytest.raises(InputError, match=f"{s3_bucket}/p/nope.parquet: no such S3 object"):
        list(iter_located_texts(f"{s3_bucket}/p/nope.parquet", text_field="body"))


def test_damaged_download_cache_is_fetched_again(s3_bucket, tmp_path):
    uri = f"{s3_bucket}/cache"
    publish(uri, write_output(tmp_path), make_manifest())
    first = fetch(uri, cache_dir=tmp_path / "cache")
    (first.path / "model.safetensors").write_bytes(b"corrupt")  # e.g. a disk error in the local cache
    again = fetch(uri, cache_dir=tmp_path / "cache")
    assert again.path == first.path
    assert (again.path / "model.safetensors").read_bytes() == b"weights"


def test_server_holds_more_buckets_than_a_full_disk_allows_by_default(s3_server):
    """Each bucket is a SeaweedFS collection with volumes of its own; by default `weed mini` allows free disk /
    volume size volumes (14 with 14 GiB free), and CI's test session ran out of them. tests/seaweed.py sets an
    explicit budget, so 40 live buckets all take writes."""
    client = s3_server.client()
    names = [f"many-{i}-{uuid.uuid4().hex[:8]}" for i in range(40)]
    created = []
    try:
        for name in names:
            client.create_bucket(Bucket=name)
            created.append(name)
            client.put_object(Bucket=name, Key="k", Body=b"x" * 1000)
        assert [client.get_object(Bucket=n, Key="k")["Body"].read() for n in names] == [b"x" * 1000] * 40
    finally:
        for name in created:
            for obj in client.list_objects_v2(Bucket=name).get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
            client.delete_bucket(Bucket=name)
