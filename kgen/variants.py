"""Variants of a spec rendered beside generated/ (not committed): the same
pipeline with every rewrite off, for `kgen validate --baseline` and bench."""
from __future__ import annotations

from pathlib import Path

from .build import build_module
from .ir import load_pipeline
from .render import render_spec, write_rendered
from .spec import REWRITE_NAMES

VARIANTS = Path("generated") / "_variants"


def baseline_module(spec_path, root: Path = VARIANTS, build: bool = True) -> Path:
    """Render (and build) ``spec_path`` with no rewrites as module NAME_norewrite; returns its directory."""
    name = f"{load_pipeline(spec_path).name}_norewrite"
    rendered = render_spec(spec_path, root, rewrites={n: False for n in REWRITE_NAMES}, name=name)
    write_rendered(rendered, root)
    if build:
        build_module(root / name)
    return root / name
