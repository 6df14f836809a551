"""The one error type of configuration: it carries the file, the key path and what was wrong."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem a person must fix; printed as one line, exit code 2."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        self.detail = message
        where = ": ".join(part for part in (file, key) if part)
        super().__init__(f"{where}: {message}" if where else message)
