"""The DILFORGE_* settings stages and the store read (pydantic-settings), read on each use (`settings()`), and the
redaction of secrets in everything dilforge writes."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRET_SUBSTRINGS = ("SECRET", "PASSWORD", "PASSWD", "APIKEY", "ACCESS_KEY", "CREDENTIAL", "PRIVATE_KEY")
SECRET_MARKERS = ("PASS", "PWD", "TOKEN", "KEY", "AUTH", "AUTHORIZATION", "SESSION", "PRIVATE", "COOKIE", "SIGNATURE")
# Shell and desktop variables whose names hold a marker but whose values are paths, never credentials.
NOT_SECRETS = ("PWD", "OLDPWD", "SSH_AUTH_SOCK", "DBUS_SESSION_BUS_ADDRESS", "SESSION_MANAGER")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DILFORGE_", extra="ignore")

    cache: Path | None = Field(
        default=None,
        description="Download cache root (store downloads, recipe wheels, digests, the export converter); unset = "
        "~/.cache/dilforge on a host and <opt_ml>/cache inside a stage (on SageMaker the instance's ML volume).",
    )
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint URL.")
    s3_access_key_id: SecretStr | None = Field(default=None, description="Access key for that endpoint only.")
    s3_secret_access_key: SecretStr | None = Field(default=None, description="Secret key for that endpoint only.")
    s3_connect_timeout: float = Field(default=5.0, gt=0, description="Seconds to connect, per attempt.")
    s3_read_timeout: float = Field(default=15.0, gt=0, description="Seconds to wait for an answer, per attempt.")
    s3_max_attempts: int = Field(default=3, ge=1, le=10, description="Attempts per S3 call, the first included.")
    log_level: str = Field(default="INFO", description="Stage log level.")
    git_sha: str | None = Field(
        default=None, description="Source commit for manifests and image labels (set in images); unset = git rev-parse."
    )
    image: str | None = Field(default=None, description="Image reference a stage runs in, recorded in its manifest.")
    token_cache_uri: str | None = Field(
        default=None,
        description="CPT `build-cache`: where an earlier build of this job's token cache was uploaded (the SageMaker "
        "backends set it to the job's own output prefix); restored and reused instead of tokenising again.",
    )


def cache_root() -> Path:
    """Where downloads are kept between runs and tests: $DILFORGE_CACHE, else ~/.cache/dilforge."""
    return (settings().cache or Path.home() / ".cache" / "dilforge").expanduser()


def settings() -> Settings:
    return Settings()


def is_secret_name(name: str) -> bool:
    """A credential-looking name: a marker as a whole `_`/`-`/`.`-separated part, plural too (AWS_SESSION_TOKEN,
    API_KEYS, DB_PWD) or a SECRET_SUBSTRINGS entry anywhere (MYPASSWORD); `LLAMA32_TOKENIZER` is not one."""
    upper = name.upper()
    parts = set(re.split(r"[_.\-]", upper))
    return any(m in upper for m in SECRET_SUBSTRINGS) or any(m in parts or f"{m}S" in parts for m in SECRET_MARKERS)


def secret_values() -> list[str]:
    """Values of every credential variable and of the AWS credentials and config files, longest first; not key ids
    (public) nor values under 8 characters: masking those would garble every line holding them."""
    import configparser

    found = list(os.environ.items())
    for variable, default in (("AWS_SHARED_CREDENTIALS_FILE", "credentials"), ("AWS_CONFIG_FILE", "config")):
        path = Path(os.environ.get(variable) or Path.home() / ".aws" / default).expanduser()
        parser = configparser.RawConfigParser(strict=False)
        try:
            parser.read_string(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, configparser.Error):
            continue
        found += [item for section in parser.sections() for item in parser.items(section)]
    public = {n for n, _ in found if n.upper().endswith("KEY_ID") or n.startswith("XDG_") or n in NOT_SECRETS}
    values = {v.strip() for n, v in found if is_secret_name(n) and n not in public}
    return sorted((v for v in values if len(v) >= 8), key=len, reverse=True)


class MaskSecrets:
    """A logging filter that passes every record through `redact` (installed on handlers)."""

    def __init__(self, values: list[str] | None = None):
        self.values = values if values is not None else secret_values()

    def filter(self, record) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report, not the filter's to raise
            return True
        masked = redact(message, self.values)
        if masked != message:
            record.msg, record.args = masked, None
        return True


REDACTED = "***"
# A URL's userinfo, `user:password@` or `token@` (a password may hold `/`: it runs to the last `@` before a blank).
_URL_USERINFO = re.compile(r"(?<=://)(?:[^\s@/:\"'<>]+@|[^\s@/:\"'<>]*:[^\s@\"'<>]*@)")
# By format: AWS key ids and 40-character secrets; bearer and basic tokens; issued tokens; JWTs; PEM private keys.
_AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|APKA)[A-Z0-9]{16}(?![A-Z0-9])")
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
_LONE_AWS_SECRET = re.compile(
    r"(?<![A-Za-z0-9/+=])(?!/)(?![A-Za-z0-9+/]{0,38}//)"
    r"(?=[A-Za-z0-9+/]{0,39}[A-Z])(?=[A-Za-z0-9+/]{0,39}[a-z])(?=[A-Za-z0-9+/]{0,39}[0-9])"
    r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
)
_ISSUED_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,}|hf_[A-Za-z0-9]{30,}"
    r"|glpat-[A-Za-z0-9_\-]{20,}|xox[abposr]-[A-Za-z0-9\-]{10,}|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}"
    r"|sk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_\-]{20,}|AIza[A-Za-z0-9_\-]{35,})"
    r"|eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"
    r"|-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?(?:-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|$)"
)
_BEARER = re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9\-._~+/]{12,}=*")
_BASIC = re.compile(r"(\bBasic\s+)[A-Za-z0-9+/]{12,}={0,2}")
# an Authorization header's value after its scheme (AWS's signed header: its `Signature=` is left to _NAMED)
_AUTHORIZATION = re.compile(
    r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z]+\s+)?+)(?!AWS4-)(?![A-Za-z]+=)(?!\*\*\*)"
    r"[^\s\"',;]+"
)
# By name: `api_key=…`, `"password": "…"`, `X-Auth-Token: …`, `DB_PASS=…`, a URL's `?sig=…`; a value of 6+
# characters, not a number (`max_tokens: 64` is none). Generic words (pass, auth, key, signature) count only as the
# last part of a compound name or as a query parameter (`second pass: embeddings` is none, `db_pass=…` is one).
_NAMED = re.compile(
    r"(?i)((?<![A-Za-z0-9])(?:[A-Za-z0-9]+[_.\-])*(?:api[_\-]?key|secret(?:[_\-]?access)?(?:[_\-]?key)?|"
    r"access[_\-]?key|private[_\-]?key|token|password|passwd|passphrase|pwd|cookie)s?"
    r"|(?<![A-Za-z0-9])(?:[A-Za-z0-9]+[_.\-])+(?:keys?|pass|auth|credentials?|signature|cookie)"
    r"|(?<![A-Za-z0-9])signature|(?<=[?&])(?:sig|auth|key|code))"
    r"((?P<quote>[\"'])?\s*[:=]\s*)"
    r"(?:(?P<q>[\"'])(?![\d.,_+\-eE]+(?P=q))(?![<\[])([^\"'\n]{6,}?)(?P=q)"
    r"|(?![\d.,_+\-eE]+(?:[\s\"',;&)}\]]|$))(?![<\[])([^\s\"'&;,<>()\[\]{}`]{6,}))"
)

# What every pattern above needs somewhere in the text.
_MAYBE_SECRET = re.compile(
    r"[@:=]|A(?:KI|SI|GP|ID|RO|IP|NP|NV|PK)A|(?i:bearer|basic)|gh[pousr]_|github_pat_|hf_|glpat-|xox|sk[-_]|rk_"
    r"|AIza|eyJ|PRIVATE KEY|[A-Za-z0-9/+]{40}"
)


def _named(match: re.Match) -> str:
    quote = match.group("q") or ""
    return match.group(1) + match.group(2) + quote + REDACTED + quote


def redact(text: str, values: list[str] | None = None) -> str:
    """The one redaction of secrets, used by every writer: credential values and what the patterns recognise."""
    for value in values if values is not None else secret_values():
        text = text.replace(value, REDACTED)
    if not _MAYBE_SECRET.search(text):  # most strings (paths, digests, numbers): none of the patterns can match
        return text
    text = _ISSUED_TOKEN.sub(REDACTED, text)
    text = _URL_USERINFO.sub(REDACTED + "@", text)
    if _AWS_KEY_ID.search(text):
        text = _AWS_SECRET.sub(REDACTED, _AWS_KEY_ID.sub(REDACTED, text))
    text = _LONE_AWS_SECRET.sub(REDACTED, text)
    text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
    text = _BASIC.sub(lambda m: m.group(1) + REDACTED, text)
    text = _AUTHORIZATION.sub(lambda m: m.group(1) + REDACTED, text)
    return _NAMED.sub(_named, text)


def redact_values(obj, values: list[str] | None = None):
    """`redact` applied to every string in a JSON-like structure (keys kept): what records and manifests write."""
    values = values if values is not None else secret_values()
    if isinstance(obj, str):
        return redact(obj, values)
    if isinstance(obj, dict):
        return {k: redact_values(v, values) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_values(v, values) for v in obj]
    return obj


def install_log_masking() -> None:
    """Mask credentials on every handler of the root logger (call after logging is configured)."""
    import logging

    masker = MaskSecrets()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, MaskSecrets) for f in handler.filters):
            handler.addFilter(masker)
