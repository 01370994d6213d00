"""What a corpus URI names is read, and nothing else: hidden entries, stores and artifacts inside a corpus folder
are skipped, a link to a folder is refused, `data[1].txt` is a file, `s3://bucket/prefix/` is a prefix; a
non-text parquet column, a repeated YAML key, a boolean number, a seed or weight curate ignores are one-line
errors; a huge document is dropped before any step reads it; one file has one spelling in a config."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from dilforge_coordinator.config import PipelineConfig, load_yaml
from dilforge_curate.config import CurateConfig, RawSource
from dilforge_shared.configs import validate_model
from dilforge_shared.corpus import iter_located_texts, iter_texts
from dilforge_shared.errors import ConfigError, InputError
from dilforge_shared.identity import data_digest, expand


def _corpus(root: Path) -> Path:
    for rel, text in {
        "a.txt": "Bakı\n",
        "sub/b.jsonl": json.dumps({"text": "Xəzər"}) + "\n",
        "data[1].txt": "Gəncə\n",
        ".hidden.txt": "HIDDEN\n",
        ".git/objects/x.txt": "GIT\n",
        ".cache/c.jsonl": json.dumps({"text": "CACHE"}) + "\n",
        "store/.dilforge-store": "dilforge artifact store\n",
        "store/curate/abc/data-1/shard-00000.jsonl": json.dumps({"text": "OWN OUTPUT"}) + "\n",
        "copies/art/manifest.json": "{}",
        "copies/art/data-1/shard-00000.jsonl": json.dumps({"text": "ARTIFACT"}) + "\n",
        "work/curate-abc/.dilforge-work": "curate abc\n",
        "work/curate-abc/checkpoints/curate/filtered/00000.jsonl": json.dumps({"text": "WORK"}) + "\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_corpus_folder_reads_its_corpus_files_and_skips_hidden_entries_stores_and_artifacts(tmp_path):
    root = _corpus(tmp_path / "corpus")
    assert [Path(f).relative_to(root).as_posix() for f in expand(str(root))] == [
        "a.txt", "data[1].txt", "sub/b.jsonl",
    ]  # fmt: skip
    assert sorted(iter_texts(str(root))) == ["Bakı", "Gəncə", "Xəzər"]


def test_a_store_inside_the_corpus_folder_does_not_change_what_is_read(tmp_path):
    root = _corpus(tmp_path / "corpus")
    before = data_digest(str(root))
    (root / "store/curate/def/data-2").mkdir(parents=True)
    (root / "store/curate/def/data-2/shard-00000.jsonl").write_text(json.dumps({"text": "RERUN"}) + "\n")
    assert data_digest(str(root)) == before


def test_a_link_to_a_folder_is_refused_naming_it(tmp_path):
    root = _corpus(tmp_path / "corpus")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/e.txt").write_text("E\n")
    os.symlink(tmp_path / "elsewhere", root / "linked")
    with pytest.raises(InputError, match="linked is a link to a folder.*name its target"):
        expand(str(root))


def test_a_file_named_like_a_glob_is_read_and_globs_still_work(tmp_path):
    root = _corpus(tmp_path / "corpus")
    assert expand(str(root / "data[1].txt")) == [str(root / "data[1].txt")]
    assert expand(f"file://{root}/data[1].txt") == [str(root / "data[1].txt")]
    assert expand(str(root / "*.txt")) == [str(root / "a.txt"), str(root / "data[1].txt")]
    with pytest.raises(InputError, match="glob matches no file"):
        expand(str(root / "nothing[0-9].txt"))


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    import boto3
    import moto
    from factories import clear_aws

    clear_aws(monkeypatch, tmp_path)
    for key, value in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="bkt")
        for key, body in {
            "web/a.jsonl": json.dumps({"text": "Bakı"}),
            "web/sub/b.txt": "Xəzər",
            "web/.git/x.txt": "GIT",
            "web/store/.dilforge-store": "",
            "web/store/curate/abc/data-1/shard-00000.jsonl": json.dumps({"text": "OWN OUTPUT"}),
            "webx/c.txt": "OTHER PREFIX",
        }.items():
            s3.put_object(Bucket="bkt", Key=key, Body=body.encode())
        yield "bkt"


@pytest.mark.parametrize("uri", ["s3://bkt/web/", "s3://bkt/web"])
def test_an_s3_prefix_with_or_without_its_trailing_slash_is_read(bucket, uri):
    assert expand(uri) == ["s3://bkt/web/a.jsonl", "s3://bkt/web/sub/b.txt"]
    assert sorted(iter_texts(uri)) == ["Bakı", "Xəzər"]


def test_a_parquet_column_that_is_not_text_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [1, 2], "body": ["Bakı", "Xəzər"]}), path)
    with pytest.raises(
        InputError, match=r"t.parquet: column 'text' holds int64, not text \(text columns: \['body'\]\)"
    ):
        list(iter_texts(str(path)))
    assert list(iter_texts(str(path), text_field="body")) == ["Bakı", "Xəzər"]
    named = tmp_path / "t.bin"  # format: parquet reads a file whatever its name
    path.rename(named)
    assert list(iter_texts(str(named), fmt="parquet", text_field="body")) == ["Bakı", "Xəzər"]


def test_a_huge_document_is_dropped_by_the_reader_at_once(tmp_path):
    path = tmp_path / "web.jsonl"
    path.write_text(json.dumps({"text": "söz " * 6_500_000}) + "\n" + json.dumps({"text": "Bakı şəhəri"}) + "\n")
    source = RawSource(uri=str(path))
    start = time.perf_counter()
    texts = [t for _, _, t in iter_located_texts(source.uri, "auto", "text", None, "none", **source.bounds)]
    assert texts == ["Bakı şəhəri"] and time.perf_counter() - start < 5


def test_a_repeated_yaml_key_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run_id: r\nstore: {uri: /s}\ncurate:\n  output:\n    num_shards: 8\n    num_shards: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml: line 6: key 'num_shards' appears twice .*first on line 5"):
        load_yaml(path)
    path.write_text("base: &b {num_shards: 8, format: jsonl}\nout:\n  <<: *b\n  num_shards: 1\n")
    assert load_yaml(path)["out"] == {"num_shards": 1, "format": "jsonl"}  # a merge key may be overridden


def _curate(**curate):
    raw = {"run_id": "r", "store": {"uri": "/s"}, "curate": {"corpora": [{"uri": "a.jsonl"}], **curate}}
    return validate_model(PipelineConfig, raw, "c.yaml")


@pytest.mark.parametrize(
    ("curate", "field"),
    [
        ({"output": {"num_shards": True}}, "curate.output.num_shards"),
        ({"quality": {"min_words": False}}, "curate.quality.min_words"),
        ({"language_id": {"min_score": True}}, "curate.language_id.min_score"),
        ({"corpora": [{"uri": "a", "max_document_bytes": True}]}, "curate.corpora.0.max_document_bytes"),
    ],
)
def test_a_boolean_for_a_number_is_refused_naming_the_field(curate, field):
    with pytest.raises(ConfigError, match=rf"{field}: .*(true|false) is a boolean"):
        _curate(**curate)


def test_curate_refuses_a_seed_and_a_weight_it_would_not_use():
    with pytest.raises(ConfigError, match="curate.seed: .*no random choice"):
        _curate(seed=7)
    with pytest.raises(ConfigError, match=r"curate.corpora.0.weight: .*no mixture"):
        _curate(corpora=[{"uri": "a.jsonl", "weight": 2.0}])
    assert _curate(seed=0, corpora=[{"uri": "a.jsonl", "weight": 1.0}]).curate.identity() == _curate().curate.identity()


@pytest.mark.parametrize("spelling", ["./data/web.jsonl", "data/web.jsonl", "file://data/web.jsonl", "data//web.jsonl"])
def test_one_local_file_has_one_spelling_and_so_one_identity(spelling):
    assert (
        CurateConfig(corpora=[{"uri": spelling}]).identity()
        == CurateConfig(corpora=[{"uri": "data/web.jsonl"}]).identity()
    )
    absolute = CurateConfig(corpora=[{"uri": "/data/web.jsonl"}]).identity()
    assert CurateConfig(corpora=[{"uri": "//data/web.jsonl"}]).identity() == absolute
    assert CurateConfig(corpora=[{"uri": "file:///data/web.jsonl"}]).identity() == absolute


def test_the_alpha_words_bound_means_what_datatrove_does_with_it():
    """`max_non_alpha_words_ratio` is the fewest share of words holding a letter (datatrove's name, despite 'max')."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import GopherQualityFilter
    from dilforge_curate.steps import WordSplitter

    text = " ".join(["Bakı şəhəri və Xəzər dənizi"] * 12 + ["2024 100 5"] * 3)  # 48 of 57 words hold a letter: 0.84
    info = CurateConfig.model_fields["quality"].annotation.model_fields["max_non_alpha_words_ratio"]
    assert info.description.startswith("Fewest share of words that contain a letter")

    def kept(bound: float):
        gopher = GopherQualityFilter(max_non_alpha_words_ratio=bound, min_stop_words=0, language=WordSplitter())
        return gopher.filter(Document(text, "d"))

    assert kept(0.8) is True and kept(0.9) == (False, "gopher_below_alpha_threshold")


def _stage(tmp_path, monkeypatch, body, publish=True):
    from dilforge_coordinator.backends.local import write_inputs
    from dilforge_coordinator.config import STAGE_CONFIGS
    from dilforge_coordinator.pipeline import build_hyperparameters
    from dilforge_shared.contract import OptMl, stage_main

    config = CurateConfig(corpora=[{"uri": str(tmp_path / "web.jsonl")}])
    opt = OptMl(tmp_path / "opt")
    write_inputs(opt, build_hyperparameters(config, str(tmp_path / "store" / "a"), "r", {}))
    monkeypatch.setenv("DILFORGE_OPT_ML", str(opt.root))
    return stage_main(STAGE_CONFIGS["curate"], body, "test", ["train"], publish_from_this_process=publish), opt


def _full_disk(monkeypatch, free_when_reserve_gone: bool):
    """Every write fails with ENOSPC, except (with `free_when_reserve_gone`) once the stage's reserve is deleted."""
    import errno

    real = Path.write_text
    state = {"freed": False}
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        state["freed"] |= self.name == ".failure-reserve" and self.exists()
        return real_unlink(self, missing_ok=missing_ok)

    def write_text(self, data, *args, **kwargs):
        if not (free_when_reserve_gone and state["freed"]):
            self.touch()  # as a real full disk: the file is created, its data cannot be written
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_full_work_disk_ends_with_the_oserror_s_reason(tmp_path, monkeypatch):
    import errno

    def body(config, ctx):
        _full_disk(monkeypatch, free_when_reserve_gone=True)
        raise OSError(errno.ENOSPC, "No space left on device", str(ctx.opt.checkpoint_dir / "curate" / "x.jsonl"))

    code, opt = _stage(tmp_path, monkeypatch, body)
    monkeypatch.undo()
    assert code == 1
    assert opt.failure_file.read_text().endswith("x.jsonl: No space left on device (disk full or a file-size limit)")
    assert not (opt.output_dir / ".failure-reserve").exists()


def test_a_failure_that_cannot_be_written_leaves_no_empty_reason(tmp_path, monkeypatch):
    import errno

    def body(config, ctx):
        _full_disk(monkeypatch, free_when_reserve_gone=False)
        raise OSError(errno.ENOSPC, "No space left on device", "x")

    code, opt = _stage(tmp_path, monkeypatch, body)
    assert code == 1 and not opt.failure_file.exists()  # the coordinator then reports the exit code, not ""


def test_a_stage_that_succeeds_leaves_no_reserve(tmp_path, monkeypatch):
    from dilforge_shared.contract import StageResult

    code, opt = _stage(tmp_path, monkeypatch, lambda config, ctx: StageResult(metrics={}), publish=False)
    assert code == 0 and not (opt.output_dir / ".failure-reserve").exists() and not opt.failure_file.exists()


def test_a_tsv_corpus_is_read_by_its_header_through_the_one_tsv_reader(tmp_path):

    good = tmp_path / "pairs.tsv"
    good.write_text("eng\taze\nhello\tsalam\n\nbye\tsağ ol\n")
    assert [(line, text) for _, line, text in iter_located_texts(str(good), text_field="aze")] == [
        (2, "salam"),
        (4, "sağ ol"),
    ]
    with pytest.raises(InputError, match=r"pairs\.tsv:1: header has no column 'az' \(columns: \['eng', 'aze'\]\)"):
        list(iter_located_texts(str(good), text_field="az"))
    short = tmp_path / "short.tsv"
    short.write_text("eng\taze\nhello\tsalam\nonly-english\n")
    with pytest.raises(InputError, match=r"short\.tsv:3: row has 1 columns, the header 2"):
        list(iter_located_texts(str(short), text_field="aze"))
