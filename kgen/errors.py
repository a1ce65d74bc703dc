"""The one exception type users see: a one-line message, no traceback."""
from __future__ import annotations


class KgenError(Exception):
    """An error the CLI prints as one line and exits non-zero on."""


class SpecError(KgenError):
    """A problem in a spec file, located by file and key path (``ops[2].max_pool3d.kernel_size``)."""

    def __init__(self, path: str, key: str, message: str):
        self.path, self.key, self.message = str(path), key, message
        where = f"{self.path}: {key}" if key else self.path
        super().__init__(f"{where}: {message}")
