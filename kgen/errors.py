"""The one exception type users see: a one-line message, no traceback."""
from __future__ import annotations

MAX_SHOWN_PATH = 160  # characters of a file path an error message shows
MAX_SPEC_MESSAGE = 1000  # characters of a spec error, file and key included (a backstop: values are cut at 80)


def one_line(text: str, limit: int) -> str:
    """``text`` on one line (line breaks escaped), cut to ``limit`` characters with '...'."""
    text = str(text).replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class KgenError(Exception):
    """An error the CLI prints as one line and exits non-zero on."""


class SpecError(KgenError):
    """A problem in a spec file, located by file and key path (``ops[2].max_pool3d.kernel_size``).

    The message is always one line of bounded length, whatever the spec holds.
    """

    def __init__(self, path: str, key: str, message: str):
        self.path, self.key, self.message = str(path), key, message
        shown = one_line(self.path, MAX_SHOWN_PATH)
        where = f"{shown}: {key}" if key else shown
        super().__init__(one_line(f"{where}: {message}", MAX_SPEC_MESSAGE))
