"""No secret in any file under the store: one redaction (`settings.redact`) for logs, errors, run records, manifests
and data cards; secrets recognised by name, by position (URL userinfo) and by format; configs that hold one, or
interpolate a secret-named variable, are refused."""

from __future__ import annotations

import json
import logging
import re
import textwrap
from pathlib import Path

import pytest
from dilforge_coordinator import pipeline as pl
from dilforge_coordinator.cli import app
from dilforge_coordinator.config import load_pipeline
from dilforge_shared.errors import ConfigError
from dilforge_shared.manifest import MANIFEST_NAME, Manifest, current_producer
from dilforge_shared.settings import MaskSecrets, is_secret_name, redact
from dilforge_shared.store import fetch, publish
from test_reliability import write_config
from typer.testing import CliRunner

KEY_ID, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GHP, HF = "ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.abcDEF123_-x"
PEM_BODY = "MIIEowIBAAKCAQEA1234567890abcdefghijklmnopqrstuvwxyz"


def _no_secret_under(root: Path, *secrets: str) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for secret in secrets:
                assert secret.encode() not in data, f"{path} holds {secret!r}"


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (f"s3://{KEY_ID}:{SECRET}@corp/web/a.jsonl", SECRET),
        (f"s3://{KEY_ID}:{SECRET}@corp/web/a.jsonl", KEY_ID),
        ("https://KEY:SECRETVALUE@host/x.jsonl", "SECRETVALUE"),
        ("https://ghp_0123456789abcdef@github.com/x.git", "ghp_0123456789abcdef"),
        (f"aws_access_key_id={KEY_ID}\naws_secret_access_key={SECRET}", SECRET),
        (f"key {KEY_ID} secret {SECRET}", SECRET),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", "eyJhbGciOiJIUzI1NiJ9"),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA"),
        ('{"api_key": "sk-live-0123456789"}', "sk-live-0123456789"),
        ("DILFORGE_VAR_DB_PASS=correct-horse", "correct-horse"),
        ("X-Auth-Token: 9f8e7d6c5b4a", "9f8e7d6c5b4a"),
        ("password='hunter22'", "hunter22"),
        # issued-token formats, wherever they stand
        (f"push with {GHP} failed", GHP),
        ("github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz", "github_pat_11ABCDEFG0123456789_abcdefghij"),
        (f"/data/{HF}/corpus.jsonl", HF),
        ("Authorization: token glpat-abcdefghij0123456789", "glpat-abcdefghij0123456789"),
        ("xoxb-123456789012-1234567890123-abcdefghijABCD", "xoxb-123456789012"),
        ("sk-proj-abcdefghijklmnopqrstuvwxyz0123", "sk-proj-abcdefghijklmnopqrstuvwxyz0123"),
        ("key AIzaSyD-abcdefghijklmnopqrstuvwxyz01234", "AIzaSyD-abcdefghijklmnopqrstuvwxyz01234"),
        (f"session {JWT} expired", JWT.split(".")[1]),
        (f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n-----END RSA PRIVATE KEY-----", PEM_BODY),
        (f"ValueError: bad key -----BEGIN OPENSSH PRIVATE KEY-----\n{PEM_BODY}", PEM_BODY),  # cut before its END
        # an AWS secret with no key id beside it (a tag, a note)
        (f"tags: {{team: ml, note: {SECRET}}}", SECRET),
        # values that hold punctuation, quoted values with blanks, URL-encoded values, query parameters
        ("password=p@ss!w0rd#2024", "ss!w0rd#2024"),
        ('{"password": "hunter2!x"}', "hunter2!x"),
        ('passphrase: "correct horse battery"', "horse battery"),
        ("https://b/k?X-Amz-Security-Token=IQoJb3JpZ2luX2VjEJr%2F%2F%2FwEaCXVz", "wEaCXVz"),
        ("https://acct.blob.core.windows.net/c/x.jsonl?sv=2020&sig=abcdEFGH1234%2Bxyz%3D", "abcdEFGH1234"),
        ("https://h/x?Signature=abcdefghijkl123&Expires=1", "abcdefghijkl123"),
        ("https://h/x?auth=abcdefghijkl123", "abcdefghijkl123"),
        ("Authorization: abcdef123456", "abcdef123456"),
    ],
)
def test_redact_recognises_secrets_by_position_format_and_name(text, secret):
    assert secret not in redact(text, []) and "***" in redact(text, [])


@pytest.mark.parametrize(
    "text",
    [
        "s3://bucket/key@v2 and http://host/a@b",
        "max_tokens: 64, max_new_tokens=256",
        "eos_token: <|eot_id|>",
        "tokenizer: artifacts/tokenizer/0123456789abcdef",
        "NoSuchKey: key=runs/demo.json",
        "Basic knowledge of Azerbaijani",
        "second pass: embeddings-only",
        "new token embeddings initialised from sub-token means",
        "sha256 " + "a" * 64,
        "git " + "0123456789abcdef" * 2 + "01234567",  # a commit id: 40 hex characters
        "/tmp/pytest/store/artifacts/tok/Run12345",  # a path of 40 characters
        "eos_token: </s>, pad_token: [PAD], bos_token=<s>",
        "flops_per_token=1.2e9, bits_per_token: 0.8125",
        "SignatureDoesNotMatch: the request signature we calculated does not match",
        "Authorization: AWS4-HMAC-SHA256 Credential=the-public-key-id/20260101/us-east-1/s3/aws4_request",
        "hf_hub_download and sk-learn and task-specific",
    ],
)
def test_redact_leaves_ordinary_text_alone(text):
    assert redact(text, []) == text


@pytest.mark.parametrize(
    "name", ["API_KEY", "DB_PASS", "DB_PWD", "BASIC_AUTH", "X_AUTH_TOKEN", "MY_PASSWORD", "APIKEY", "CREDENTIALS"]
)
def test_secret_names_include_key_pass_pwd_and_auth(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["LLAMA32_TOKENIZER", "AUTHOR", "MONKEY", "HOME", "DATA_ROOT"])
def test_ordinary_names_are_not_secret(name):
    assert not is_secret_name(name)


def test_an_environment_secret_is_masked_in_a_log_line(monkeypatch):
    monkeypatch.setenv("ACME_API_KEY", "k3y-value-0001")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "calling with %s", ("k3y-value-0001",), None)
    MaskSecrets().filter(record)
    assert record.getMessage() == "calling with ***"


def _curate_config(tmp_path: Path, uri: str, licence: str = "CC-BY-4.0") -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(
        textwrap.dedent(f"""
        run_id: leak
        store: {{uri: {tmp_path / "store"}}}
        curate:
          corpora: [{{uri: "{uri}", licence: "{licence}"}}]
    """)
    )
    return path


@pytest.mark.parametrize(
    ("uri", "secret"),
    [(f"s3://{KEY_ID}:{SECRET}@corp/web/a.jsonl", SECRET), ("https://KEY:SECRETVALUE@host/x.jsonl", "SECRETVALUE")],
)
def test_a_source_uri_with_credentials_is_refused_in_one_line_and_written_nowhere(tmp_path, uri, secret):
    path = _curate_config(tmp_path, uri)
    with pytest.raises(ConfigError, match=r"curate\.corpora\[0\]\.uri: holds a credential") as err:
        load_pipeline(path)
    assert secret not in str(err.value)
    result = CliRunner().invoke(app, ["run-all", "-c", str(path)])
    assert result.exit_code == 1 and secret not in result.output and "Traceback" not in result.output
    assert result.output.count("\n") == 1, result.output
    if (tmp_path / "store").exists():
        _no_secret_under(tmp_path / "store", secret)


@pytest.mark.parametrize(
    ("field", "value", "secret"),
    [
        ("name", GHP, GHP),
        ("licence", SECRET, SECRET),
        ("licence", JWT, JWT),
        ("licence", f"-----BEGIN PRIVATE KEY-----\\n{PEM_BODY}\\n-----END PRIVATE KEY-----", PEM_BODY),
        ("uri", f"/data/{HF}/a.txt", HF),
        ("uri", "https://h/a.jsonl?sv=1&sig=AbCdEf123456", "AbCdEf123456"),
        ("uri", "https://h/a.jsonl?password=p@ss!w0rd", "p@ss!w0rd"),
    ],
)
def test_a_secret_in_any_config_field_is_refused_naming_the_field(tmp_path, field, value, secret):
    (tmp_path / "a.txt").write_text("bir\n")
    source = {"uri": str(tmp_path / "a.txt"), "licence": "CC-BY-4.0", field: value}
    path = tmp_path / "c.yaml"
    path.write_text(f"run_id: leak\nstore: {{uri: {tmp_path / 'store'}}}\ncurate:\n  corpora: [{json.dumps(source)}]\n")
    with pytest.raises(ConfigError, match=rf"curate\.corpora\[0\]\.{field}: holds a credential") as err:
        load_pipeline(path)
    assert secret not in str(err.value)


def test_a_key_from_the_aws_credentials_file_is_masked_even_inside_a_path(tmp_path, monkeypatch):
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    assert redact(f"reading /data/{SECRET}/a.jsonl") == "reading /data/***/a.jsonl"


@pytest.mark.parametrize(
    "name", ["DILFORGE_VAR_API_KEY", "DILFORGE_VAR_DB_PASS", "DILFORGE_VAR_DB_PWD", "DILFORGE_VAR_AUTH"]
)
def test_interpolating_a_secret_named_variable_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "s3cr3t-licence-value")
    (tmp_path / "a.txt").write_text("bir\n")
    path = _curate_config(tmp_path, str(tmp_path / "a.txt"), licence=f"${{{name}}}")
    with pytest.raises(ConfigError, match="may not be interpolated") as err:
        load_pipeline(path)
    assert "s3cr3t-licence-value" not in str(err.value)
    result = CliRunner().invoke(app, ["run-all", "-c", str(path)])
    assert result.exit_code == 1 and "may not be interpolated" in result.output, result.output
    assert "s3cr3t-licence-value" not in result.output and not (tmp_path / "store").exists()


def test_an_environment_secret_in_a_stage_failure_never_reaches_the_run_record(tmp_path, monkeypatch):
    monkeypatch.setenv("ACME_SERVICE_TOKEN", "tok-0123456789-secret")

    class Leaky:
        name = "fake"

        def run(self, job):
            raise pl.StageFailed(
                job.stage,
                "upload refused for tok-0123456789-secret and Bearer abcdefgh12345678\nTraceback: "
                f"token {GHP} rejected; {HF}; {JWT}; -----BEGIN EC PRIVATE KEY-----\n{PEM_BODY}\n"
                f"-----END EC PRIVATE KEY-----; https://b/k?X-Amz-Signature=0123abcd4567ef&password=p@ss!w0rd",
            )

    cfg = load_pipeline(write_config(tmp_path))
    with pytest.raises(pl.StageFailed):
        pl.run_all(cfg, Leaky())
    record = (tmp_path / "store" / "runs" / "demo.json").read_text()
    assert "upload refused for ***" in record
    _no_secret_under(
        tmp_path / "store",
        "tok-0123456789-secret",
        "abcdefgh12345678",
        GHP,
        HF,
        JWT.split(".")[1],
        PEM_BODY,
        "0123abcd4567ef",
        "p@ss!w0rd",
    )


def test_a_manifest_never_holds_a_secret_and_still_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("ACME_PASSWORD", "pa55-w0rd-value")
    out = tmp_path / "out"
    out.mkdir()
    (out / "w.bin").write_bytes(b"weights")
    uri = str(tmp_path / "store" / "artifacts" / "tokenizer" / "t1")
    manifest = Manifest(
        code_version="test",
        kind="tokenizer",
        artifact_id="t1",
        run_id="r",
        stage="tokenizer",
        producer=current_producer("test"),
        config={},
        data_dir="x",
        files=[],
        metrics={"note": f"pushed with pa55-w0rd-value via s3://{KEY_ID}:{SECRET}@b/k"},
    )
    publish(uri, out, manifest)
    _no_secret_under(tmp_path / "store", "pa55-w0rd-value", SECRET, KEY_ID)
    assert fetch(uri).manifest.metrics["note"] == "pushed with *** via s3://***@b/k"
    assert json.loads((Path(uri) / MANIFEST_NAME).read_text())["artifact_id"] == "t1"


def test_a_stage_failure_file_holds_no_secret(tmp_path, monkeypatch):
    from dilforge_shared.contract import OptMl, write_failure

    monkeypatch.setenv("ACME_SERVICE_TOKEN", "tok-0123456789-secret")
    opt = OptMl(root=tmp_path / "ml")
    write_failure(opt, f"Traceback: upload to s3://{KEY_ID}:{SECRET}@b/k failed with tok-0123456789-secret")
    assert opt.failure_file.read_text() == "Traceback: upload to s3://***@b/k failed with ***"


def test_the_curate_report_and_data_card_are_written_through_redact(tmp_path, monkeypatch):
    """A config that bypassed loading (built in code) and an example of removed text holding secrets: neither the
    card nor the report writes them."""
    from dilforge_curate import report
    from dilforge_curate.config import CurateConfig
    from dilforge_curate.metrics import CurateMetrics

    monkeypatch.setenv("ACME_PASSWORD", "pa55-w0rd-value")
    config = CurateConfig.model_validate(
        {"corpora": [{"uri": str(tmp_path / "a.jsonl"), "name": "web", "licence": "CC-BY; api_key=sk-live-0123456789"}]}
    )
    metrics = CurateMetrics(
        language="az",
        documents_read=2,
        chars_read=20,
        documents_kept=1,
        chars_kept=10,
        words_kept=2,
        steps=[{"step": "quality", "removed": 1, "reasons": {"short": 1}, "examples": ["pw pa55-w0rd-value"]}],
        repairs={"encoding_repaired": 0, "unicode_normalised": 0, "whitespace_normalised": 0},
        redacted={"email": {"replaced": 0, "documents": 0}},
        per_source={"web": {"read": 2, "kept": 1}},
        num_shards=1,
        seconds={},
    )
    report.write(tmp_path, config, metrics)
    _no_secret_under(tmp_path, "sk-live-0123456789", "pa55-w0rd-value")
    assert "| web | CC-BY; api_key=*** |" in re.sub(r" *\| *", " | ", (tmp_path / "README.md").read_text())
