"""Fuzz and fault cases of the records/manifests/secrets classes (budget: tests/fuzzing.py): a secret in any
recognised form, anywhere in any text, never survives `redact`; a file of any name at any depth added to a
published artifact, or its manifest edited with or without its digest, never validates."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.config import load_pipeline
from dilforge_coordinator.integrity import check_artifact
from dilforge_shared.errors import IntegrityError
from dilforge_shared.identity import source_files
from dilforge_shared.manifest import MANIFEST_NAME, sha256_bytes
from dilforge_shared.settings import redact
from dilforge_shared.store import fetch, manifest_digest_key
from fuzzing import FUZZ, fault_seeds
from hypothesis import assume, given
from hypothesis import strategies as st
from test_manifest_exact import _corpus_artifact, _data
from test_reliability import PublishingBackend, write_config

SECRET_CHARS = string.ascii_letters + string.digits + "/+"
SEPARATORS = [" ", "\n", "\t", ", ", "; ", "&", "?", "(", ")", "'", '"', "<", ">"]
NAMES = [
    "api_key",
    "API_KEY",
    "apikey",
    "DB_PASS",
    "db_password",
    "MY_PWD",
    "x-auth-token",
    "access_token",
    "client_secret",
    "secret_access_key",
    "private_key",
    "basic_auth",
    "session_token",
    "password",
    "token",
]


def _secret_form(kind: str, secret: str, name: str) -> str:
    if kind == "userinfo":
        return f"s3://AKIA{'Q' * 16}:{secret}@bucket/k.jsonl"
    if kind == "token_userinfo":
        return f"https://{secret}@github.com/x.git"
    if kind == "named":
        return f"{name}={secret}"
    if kind == "json":
        return f'"{name}": "{secret}"'
    if kind == "bearer":
        return f"Authorization: Bearer {secret}"
    if kind == "query":  # a signed or keyed URL
        return f"https://host/x.jsonl?{name.split('=')[0]}=1&{QUERY_NAMES[len(secret) % len(QUERY_NAMES)]}={secret}"
    if kind == "punctuated":  # a password holding punctuation, bare or quoted
        return f"{name}={secret}" if len(secret) % 2 else f'"{name}": "{secret}"'
    if kind in ("issued", "jwt", "pem", "lone_aws"):
        return _formatted(kind, secret)
    return f"AKIAIOSFODNN7EXAMPLE {secret[:40].ljust(40, 'Z')}"  # an AWS key pair


QUERY_NAMES = ["sig", "Signature", "X-Amz-Signature", "X-Amz-Security-Token", "password", "access_token", "auth", "key"]
ISSUED_PREFIXES = ["ghp_", "gho_", "ghs_", "github_pat_", "hf_", "glpat-", "xoxb-", "sk-proj-", "sk-ant-", "sk_live_"]


def _formatted(kind: str, secret: str) -> str:
    """A secret in a format recognised wherever it stands; `_hidden` gives the part that must not survive."""
    body = "".join(c for c in secret if c.isalnum()).ljust(36, "Q")
    if kind == "issued":
        return ISSUED_PREFIXES[len(secret) % len(ISSUED_PREFIXES)] + body
    if kind == "jwt":
        return f"eyJhbGciOiJIUzI1NiJ9.eyJ{body}.{body[:10]}"
    if kind == "pem":
        return f"-----BEGIN PRIVATE KEY-----\n{body}\n{body[::-1]}\n-----END PRIVATE KEY-----"
    return ("a1B" + secret)[:40].ljust(40, "Z").lstrip("/").rjust(40, "Q").replace("//", "/Q")  # a lone AWS secret


def _hidden(kind: str, secret: str) -> str:
    if kind == "aws_pair":
        return secret[:40].ljust(40, "Z")
    if kind in ("issued", "jwt", "pem", "lone_aws"):
        form = _formatted(kind, secret)
        return form.split("\n")[1] if kind == "pem" else form
    return secret


KINDS = ["userinfo", "token_userinfo", "named", "json", "bearer", "aws_pair", "query", "punctuated", "issued", "jwt"]
KINDS += ["pem", "lone_aws"]
PUNCTUATED = SECRET_CHARS + "!@#$%^*~-_.:=|"


@FUZZ
@given(
    st.sampled_from(KINDS),
    st.text(SECRET_CHARS, min_size=16, max_size=48).filter(lambda s: not s.isdigit()),
    st.sampled_from(NAMES),
    st.text(max_size=60),
    st.text(max_size=60),
    st.sampled_from(SEPARATORS),
    st.sampled_from(SEPARATORS),
)
def test_a_secret_in_any_recognised_form_never_survives_redaction(kind, secret, name, before, after, sep1, sep2):
    if kind == "token_userinfo":  # a user name cannot hold `/` (it would end the host part)
        secret = secret.replace("/", "_")
    if kind == "punctuated":  # any printable character but a blank, a quote or a separator (&;,<>()[]{})
        secret = "".join(PUNCTUATED[ord(c) % len(PUNCTUATED)] for c in secret)
        assume(secret[0] not in "<[" and not secret.replace(".", "").replace("-", "").replace("_", "").isdigit())
    if kind == "lone_aws":  # random enough to hold upper and lower case and a digit, as every real one does
        assume(any(c.isupper() for c in secret) and any(c.islower() for c in secret))
    form = _secret_form(kind, secret, name)
    hidden = _hidden(kind, secret)
    text = f"{before}{sep1}{form}{sep2}{after}"
    assume(text.count(hidden) == 1)  # the secret only where the form puts it
    assert hidden not in redact(text, [])


@FUZZ
@given(st.text(min_size=8, max_size=40).filter(lambda s: s.strip() == s and len(s.strip()) >= 8), st.text(max_size=80))
def test_an_environment_secret_is_redacted_wherever_it_appears(value, around):
    text = f"{around[: len(around) // 2]}{value}{around[len(around) // 2 :]}"
    assert value not in redact(text, [value])


def _random_path(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + "._-əğıöüşç "
    parts = []
    for _ in range(rng.randint(1, 3)):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))).strip() or "x"
        parts.append(name if name not in (".", "..") else "x")
    if rng.random() < 0.3:
        parts[-1] = "." + parts[-1]
    if rng.random() < 0.5:
        parts[-1] += rng.choice([".jsonl", ".txt", ".parquet", ".txt.gz"])
    return "/".join(parts)


@pytest.mark.parametrize("seed", fault_seeds())
def test_a_file_added_anywhere_in_an_artifact_never_validates_and_is_never_listed(tmp_path, seed):
    rng = random.Random(seed)
    uri = _corpus_artifact(tmp_path)
    data = _data(uri)
    rel = _random_path(rng)
    while (data / rel).exists() or any((data / p).is_file() for p in Path(rel).parents if str(p) != "."):
        rel = _random_path(rng)
    (data / rel).parent.mkdir(parents=True, exist_ok=True)
    (data / rel).write_bytes(rng.randbytes(rng.randint(0, 200)))
    problem = check_artifact(str(uri))
    assert problem and "not listed in the manifest" in problem, f"{rel!r} (seed {seed}): {problem}"
    with pytest.raises(IntegrityError, match="not listed in the manifest"):
        fetch(str(uri))
    assert [Path(f).name for f in source_files(str(data))] == ["shard-00000.jsonl", "shard-00001.jsonl"]


@pytest.mark.parametrize("seed", fault_seeds())
def test_a_manifest_edited_with_or_without_its_digest_never_validates(tmp_path, seed):
    rng = random.Random(seed)
    cfg = load_pipeline(write_config(tmp_path))
    uri = Path(pl.run_all(cfg, PublishingBackend())["tokenizer"].removeprefix("file://"))
    path = uri / MANIFEST_NAME
    raw = json.loads(path.read_text())
    edit = rng.choice(["metrics", "size", "sha256", "add_file", "created_at"])
    if edit == "metrics":
        raw["metrics"] = {"edited": rng.random()}
    elif edit == "size":
        raw["files"][0]["size"] += rng.randint(1, 9)
    elif edit == "sha256":
        raw["files"][0]["sha256"] = "".join(rng.choice("0123456789abcdef") for _ in range(64))
    elif edit == "add_file":
        raw["files"].append({"path": "zz.jsonl", "size": 1, "sha256": "0" * 64})
    else:
        raw["created_at"] = "2020-01-01T00:00:00Z"
    sidecar = rng.choice(["kept", "deleted", "rewritten", "new data folder"])
    if sidecar == "new data folder":  # the files moved under a new name, with that manifest's own digest
        new = f"data-{rng.randbytes(6).hex()}"
        (uri / raw["data_dir"]).rename(uri / new)
        (uri / manifest_digest_key(raw["data_dir"])).unlink()
        raw["data_dir"] = new
    body = json.dumps(raw, indent=rng.choice([None, 2])).encode()
    path.write_bytes(body)
    digest = uri / manifest_digest_key(raw["data_dir"])
    if sidecar == "deleted":
        digest.unlink()
    elif sidecar in ("rewritten", "new data folder"):
        digest.write_text(sha256_bytes(body))
    assert check_artifact(str(uri)) is not None, f"{edit}, sidecar {sidecar} (seed {seed})"
    with pytest.raises(IntegrityError):
        fetch(str(uri))
