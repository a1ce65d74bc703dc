"""Checkers for the fields of a spec: each takes (value, key, path) and returns the clean value.

A field schema is ``{field: (checker, default)}``; ``REQUIRED`` marks a field
without default. ``kgen.spec`` applies them to the top-level keys and
``kgen.ops`` declares each op's fields with them. A bad value raises
``SpecError`` naming the file and the key path.
"""
from __future__ import annotations

import math
import re
from typing import Callable

from .errors import SpecError

IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")


class _Required:
    """Marks a field without default."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()


def fail(path, key, msg):
    raise SpecError(path, key, msg)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(lo: int) -> Callable:
    what = "a positive integer" if lo == 1 else "a non-negative integer"

    def check(v, key, path):
        if not is_int(v) or v < lo:
            fail(path, key, f"expected {what}, got {v!r}")
        return v

    return check


def ints(rank: int, lo: int) -> Callable:
    """An int, or a list of ``rank`` ints, each >= lo; returns a tuple of length rank."""
    what = "positive" if lo == 1 else "non-negative"

    def check(v, key, path):
        if is_int(v) and v >= lo:
            return (v,) * rank
        if isinstance(v, list) and len(v) == rank and all(is_int(e) and e >= lo for e in v):
            return tuple(v)
        fail(path, key, f"expected a {what} integer or a list of {rank} {what} integers, got {v!r}")

    return check


def optional(check: Callable) -> Callable:
    return lambda v, key, path: None if v is None else check(v, key, path)


def boolean(v, key, path):
    if not isinstance(v, bool):
        fail(path, key, f"expected true or false, got {v!r}")
    return v


def number(v, key, path):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(path, key, f"expected a finite number, got {v!r}")
    return float(v)


def ident(v, key, path):
    if not isinstance(v, str) or not IDENT.match(v):
        fail(path, key, f"expected an identifier matching [a-z][a-z0-9_]*, got {v!r}")
    return v


def dims(v, key, path):
    if is_int(v):
        return (v,)
    if isinstance(v, list) and v and all(is_int(e) for e in v):
        if len(set(v)) != len(v):
            fail(path, key, f"repeated dimension in {v!r}")
        return tuple(v)
    fail(path, key, f"expected a dimension index or a non-empty list of them, got {v!r}")


def ones(rank: int) -> Callable:
    def check(v, key, path):
        if (is_int(v) and v == 1) or (isinstance(v, list) and len(v) == rank and all(is_int(e) and e == 1 for e in v)):
            return (1,) * rank
        fail(path, key, f"only global pooling (output_size 1) is supported, got {v!r}")

    return check
