"""A local corpus is read in full once per content: planning hashes it, the stage's identity checks (at start,
before publishing, every rank) find the digest by the file's stat stamp; any write is a new stamp."""

from __future__ import annotations

import os

from dilforge_shared import identity


def test_a_corpus_is_hashed_once_and_again_after_any_write(tmp_path, monkeypatch):
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "cache"))
    reads = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: reads.append(p) or real(p))
    data = tmp_path / "az.txt"
    data.write_text("Bakı şəhəri\n")
    first = identity.data_digest(str(data))
    assert identity.data_digest(str(data)) == first and len(reads) == 1
    stat = data.stat()
    data.write_text("Gəncə şəhər\n")  # same size
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime: the ctime moved
    assert identity.data_digest(str(data)) != first and len(reads) == 2
    monkeypatch.setenv("DILFORGE_CACHE", str(tmp_path / "readonly" / "x"))
    (tmp_path / "readonly").write_text("a file where the cache folder would be")  # unwritable cache: still right
    assert identity.stamped_sha256(data) == real(data)
