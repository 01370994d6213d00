"""Errors a user can act on. Each names the file, line or field to fix."""


class DilforgeError(Exception):
    """Base class: the message is shown to the user as is, and the process exits non-zero."""


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {9: "\\t", 10: "\\n", 13: "\\r"}


def printable(path: object) -> str:
    """A path as one line of an error: its control characters (a newline in a file name) escaped, `\\n`."""
    return str(path).translate(_CONTROL)


def field_errors(exc, sep: str = "; ", within: tuple = ()) -> str:
    """A pydantic ValidationError as `field.path: message` joined by `sep`, paths prefixed by `within`."""
    return sep.join(f"{'.'.join(map(str, (*within, *e['loc']))) or '<root>'}: {e['msg']}" for e in exc.errors())


class InputError(DilforgeError):
    """Bad user input: a corpus, a data record, a config value."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        where = "" if path is None else printable(path) + ("" if line is None else f":{line}") + ": "
        super().__init__(f"{where}{message}")


class ConfigError(DilforgeError):
    """A config document that does not validate; the message lists every bad field."""


class ManifestError(DilforgeError):
    """A manifest that cannot be read: wrong schema version, bad JSON, failed integrity check."""


class ManifestNotFound(ManifestError):
    """No manifest at that URI: not an artifact (yet), which callers may treat as 'a plain folder'."""


class IntegrityError(ManifestError):
    """A published file is missing or does not match its recorded size or sha256."""


class UnsafePathError(DilforgeError, ValueError):
    """A file name that would escape its artifact (absolute, '..', empty parts); a ValueError for pydantic too."""


class ArtifactExistsError(DilforgeError):
    """An artifact's manifest already exists; manifests are never overwritten."""

    def __init__(self, uri: str):
        super().__init__(f"artifact already published at {uri}; manifests are never overwritten")
