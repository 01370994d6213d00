"""Bad input: a clear error naming the file/line/field, non-zero exit, a failure file, nothing published.

Each case runs through the coordinator (`run-all`, which starts the real entrypoint subprocess) and,
where the coordinator rejects the input before starting the stage, also through the entrypoint itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

os.environ["OMP_NUM_THREADS"] = "1"

from dilforge_coordinator.backends.local import write_inputs
from dilforge_coordinator.cli import app
from dilforge_shared.contract import OPT_ML_ENV, OptMl
from typer.testing import CliRunner


def published(store: Path) -> list[Path]:
    return list(store.rglob("manifest.json")) if store.exists() else []


def run_all(root: Path, section: dict, store: dict | None = None):
    store = store or {"uri": str(root / "store")}
    (root / "p.yaml").write_text(yaml.safe_dump({"run_id": "bad", "store": store, "tokenizer": section}))
    os.environ["DILFORGE_WORKDIR"] = str(root / "work")
    return CliRunner().invoke(app, ["run-all", "--config", str(root / "p.yaml")])


def failure_text(root: Path) -> str:
    files = list((root / "work").glob("tokenizer-*/output/failure"))
    assert len(files) == 1, "the stage left no failure file"
    return files[0].read_text()


def entrypoint(root: Path, config: dict, artifact_uri: str, endpoint: str | None = None):
    opt = OptMl(root / "optml")
    hp = {"stage_config": json.dumps(config), "artifact_uri": artifact_uri, "run_id": "bad"}
    if endpoint:
        hp["s3_endpoint_url"] = endpoint
    write_inputs(opt, hp)
    proc = subprocess.run(
        [sys.executable, "-m", "dilforge_tokenizer", "train"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, OPT_ML_ENV: str(opt.root)},
        timeout=300,
    )
    failure = opt.failure_file.read_text() if opt.failure_file.exists() else ""
    return proc.returncode, failure


def write_bad(tmp_path: Path, kind: str) -> tuple[dict, str]:
    """A corpus source with one defect, and the message (regex) that must name it."""
    if kind == "empty":
        (tmp_path / "empty.txt").write_text("\n   \n\n")
        return {"uri": str(tmp_path / "empty.txt")}, r"empty\.txt: corpus is empty"
    if kind == "non_utf8":
        (tmp_path / "latin1.txt").write_bytes("salam\ndünya\n".encode() + "gözel şehir\n".encode("cp1254"))
        return {"uri": str(tmp_path / "latin1.txt")}, r"latin1\.txt:3: not valid UTF-8"
    if kind == "bad_jsonl":
        (tmp_path / "c.jsonl").write_text('{"text": "salam"}\n{"text": "dünya"\n{"text": "ok"}\n')
        return {"uri": str(tmp_path / "c.jsonl")}, r"c\.jsonl:2: not valid JSON"
    if kind == "bad_word_counts":
        (tmp_path / "freq.txt").write_text("kitab 12\n\nkitablar\nev 3\n")
        return (
            {"uri": str(tmp_path / "freq.txt"), "format": "word_counts"},
            r"freq\.txt:3: expected 'WORD COUNT' .*got 'kitablar'",
        )
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["empty", "non_utf8", "bad_jsonl", "bad_word_counts"])
def test_bad_corpus_fails_the_stage_naming_file_and_line(tmp_path, data_root, kind):
    source, message = write_bad(tmp_path, kind)
    wiki = {"uri": str(data_root / "az/train/udhr_azj_latn.txt")}
    result = run_all(tmp_path, {"strategy": "replace", "corpora": [wiki, source], "vocab_sizes": [600]})
    assert result.exit_code != 0
    assert re.search(message, result.output), result.output
    assert re.search(message, failure_text(tmp_path))
    assert published(tmp_path / "store") == []


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("vocab_size", 1000, r"tokenizer\.vocab_size: Extra inputs are not permitted"),
        (
            "vocab_sizes",
            [300],
            (
                r"tokenizer\.vocab_sizes: Value error, 300 is not above the byte alphabet "
                r"\+ special tokens \(256 \+ 256 = 512\)"
            ),
        ),
    ],
)
def test_bad_config_field_is_named(tmp_path, data_root, field, value, message):
    section = {"strategy": "replace", "corpora": [{"uri": str(data_root / "az/train/udhr_azj_latn.txt")}], field: value}
    result = run_all(tmp_path, section)
    assert result.exit_code != 0 and re.search(message, result.output), result.output
    assert published(tmp_path / "store") == []
    # the container entrypoint refuses it the same way, with a failure file for SageMaker
    rc, failure = entrypoint(tmp_path, section, str(tmp_path / "store2/artifacts/tokenizer/x"))
    assert rc != 0 and re.search(message.removeprefix(r"tokenizer\."), failure), failure
    assert published(tmp_path / "store2") == []


@pytest.mark.slow
def test_missing_s3_object_is_named(tmp_path, s3_server, s3_bucket):
    missing = f"{s3_bucket}/corpus/nope.txt"
    section = {"strategy": "replace", "corpora": [{"uri": missing}], "vocab_sizes": [600]}
    store = {"uri": f"{s3_bucket}/store", "s3_endpoint_url": s3_server.endpoint_url}
    result = run_all(tmp_path, section, store)
    assert result.exit_code != 0 and f"{missing}: no such S3 object" in result.output, result.output
    rc, failure = entrypoint(tmp_path, section, f"{s3_bucket}/store/artifacts/tokenizer/x", s3_server.endpoint_url)
    assert rc != 0 and f"{missing}: no such S3 object" in failure, failure
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket.removeprefix("s3://"), Prefix="store/artifacts/")
    assert [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith("manifest.json")] == []


def unextendable_base(root: Path, kind: str) -> tuple[Path, str]:
    """An HF tokenizer folder `extend` cannot continue, and the message (regex) that must say why."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = root / f"base-{kind}"
    folder.mkdir()
    if kind == "wordpiece":  # not BPE at all
        tok = Tokenizer(models.WordPiece({"[UNK]": 0, "salam": 1}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        message = r"tokenizer.json: extend needs a BPE base tokenizer, got model type 'WordPiece'"
    elif kind == "no_merges":
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
        message = r"extend needs a BPE base with merges; this tokenizer.json has none"
    else:  # byte-level BPE with merges, but no known family's special tokens
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {c: i for i, c in enumerate(alphabet)}
        vocab["sa"] = len(vocab)
        tok = Tokenizer(models.BPE(vocab, [("s", "a")]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        message = r"tokenizer follows no known family"
    tok.save(str(folder / "tokenizer.json"))
    return folder, message


@pytest.mark.parametrize("kind", ["wordpiece", "no_merges", "unknown_family"])
def test_base_that_extend_cannot_continue_fails_in_one_line(tmp_path, data_root, kind):
    folder, message = unextendable_base(tmp_path, kind)
    config = {
        "strategy": "extend",
        "base_tokenizer": str(folder),
        "num_new_tokens": [100],
        "corpora": [{"uri": str(data_root / "az/train/udhr_azj_latn.txt")}],
    }
    store = tmp_path / "store"
    rc, failure = entrypoint(tmp_path, config, str(store / "artifacts/tokenizer/x"))
    assert rc == 1 and len(failure.strip().splitlines()) == 1, failure
    assert re.search(message, failure) and str(folder) in failure, failure
    assert published(store) == []


def test_extend_without_any_base_names_the_field(tmp_path, data_root):
    config = {"strategy": "extend", "corpora": [{"uri": str(data_root / "az/train/udhr_azj_latn.txt")}]}
    store = tmp_path / "store"
    rc, failure = entrypoint(tmp_path, config, str(store / "artifacts/tokenizer/x"))
    assert rc == 1 and "tokenizer.base_tokenizer: strategy 'extend' needs a base tokenizer" in failure, failure
    assert published(store) == []
