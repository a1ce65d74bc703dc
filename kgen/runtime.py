"""What a generated module needs at import: its library, built on first use."""
from __future__ import annotations

from pathlib import Path

import torch


def load_library(module_file: str) -> str:
    """Build (if needed) and load the library of the generated module at ``module_file``.

    Loading registers the module's ``kgen::NAME`` ops with the dispatcher.
    """
    from .build import ensure_built

    lib = ensure_built(Path(module_file).resolve().parent)
    torch.ops.load_library(str(lib))
    return str(lib)
