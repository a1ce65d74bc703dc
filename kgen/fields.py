"""Checkers for the fields of a spec: each takes (value, key, path) and returns the clean value.

A field schema is ``{field: (checker, default)}``; ``REQUIRED`` marks a field
without default. ``kgen.spec`` applies them to the top-level keys and
``kgen.ops`` declares each op's fields with them. A bad value raises
``SpecError`` naming the file and the key path; a message quotes at most a
short prefix of the value (``show``). Sizes are bounded so that every
compile-time constant fits the kernels' 32-bit indices; scalars must be
finite in float32.
"""
from __future__ import annotations

import math
import re
import reprlib
from typing import Callable

from .errors import SpecError
from .names import path_reason, reserved_reason, value_reserved_reason

IDENT = re.compile(r"[a-z][a-z0-9_]*\Z")
# a member path: `conv`, or a submodule or parameter of a nested model, `layer1.0.conv1` (kgen.names.path_reason)
PATH = re.compile(r"[a-z][a-z0-9_]*(\.([a-z_][a-z0-9_]*|[0-9]+))*\Z")
MAX_PATH = 200  # characters of a member path
MAX_NAME = 64  # characters of a name (module, parameter, submodule, symbol)
MAX_SIZE = 2**31 - 1  # any one size, stride, padding...: kernels index single dims with 32-bit ints
FLOAT32_MAX = 3.4028234663852886e38
MAX_SHOWN = 80  # characters of a value an error message shows


class _Required:
    """Marks a field without default."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlong, _repr.maxlevel = MAX_SHOWN, MAX_SHOWN, 40, 3


def show(v) -> str:
    """A value as an error message quotes it: its repr, cut to a short prefix."""
    text = _repr.repr(v)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def fail(path, key, msg):
    raise SpecError(path, key, msg)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def size_ok(v, lo: int) -> bool:
    return is_int(v) and lo <= v <= MAX_SIZE


def integer(lo: int) -> Callable:
    what = "a positive integer" if lo == 1 else "a non-negative integer"

    def check(v, key, path):
        if not size_ok(v, lo):
            too_big = " (at most 2**31 - 1)" if is_int(v) and v > MAX_SIZE else ""
            fail(path, key, f"expected {what}{too_big}, got {show(v)}")
        return v

    return check


def ints(rank: int, lo: int) -> Callable:
    """An int, or a list of ``rank`` ints, each in [lo, 2**31 - 1]; returns a tuple of length rank."""
    what = "positive" if lo == 1 else "non-negative"

    def check(v, key, path):
        if size_ok(v, lo):
            return (v,) * rank
        if isinstance(v, list) and len(v) == rank and all(size_ok(e, lo) for e in v):
            return tuple(v)
        fail(path, key, f"expected a {what} integer or a list of {rank} {what} integers, each at most 2**31 - 1, got {show(v)}")

    return check


def optional(check: Callable) -> Callable:
    return lambda v, key, path: None if v is None else check(v, key, path)


def boolean(v, key, path):
    if not isinstance(v, bool):
        fail(path, key, f"expected true or false, got {show(v)}")
    return v


def number(v, key, path):
    """A number the kernels can use: finite in float32 (compared exactly, so 10**400 is refused, not an overflow)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        fail(path, key, f"expected a finite number, got {show(v)}")
    if abs(v) > FLOAT32_MAX:
        fail(path, key, f"{show(v)} is not finite in float32 (largest: 3.4028235e38)")
    v = float(v)
    if v != 0 and abs(v) <= 2.0**-150:  # half the smallest float32 or less: it would become 0
        fail(path, key, f"{show(v)} rounds to 0 in float32")
    return v


def fill_value(v, key, path):
    """A value a tensor is filled with: a number finite in float32, or an infinity (a mask's -inf); not NaN."""
    if isinstance(v, float) and math.isinf(v):
        return v
    return number(v, key, path)


def ident(v, key, path, reserved=reserved_reason):
    """A parameter or submodule name (``reserved``: the rule for the module's own name)."""
    if not isinstance(v, str) or not IDENT.match(v):
        fail(path, key, f"expected an identifier matching [a-z][a-z0-9_]*, got {show(v)}")
    if len(v) > MAX_NAME:
        fail(path, key, f"name is {len(v)} characters long; at most {MAX_NAME} are allowed")
    reason = reserved(v)
    if reason:
        fail(path, key, f"'{v}' is {reason}; choose another name")
    return v


def member_path(v, key, path):
    """The name of a submodule or parameter: an identifier, or a dotted path of a nested
    model's member (``layer1.0.conv1``: attributes, and "0", "1"... of nn.Sequential)."""
    if not isinstance(v, str) or not PATH.match(v):
        fail(path, key, "expected an identifier matching [a-z][a-z0-9_]* or a dotted path of them "
             f"(parts may be numbers: layer1.0.conv1), got {show(v)}")
    if len(v) > (MAX_NAME if "." not in v else MAX_PATH):
        fail(path, key, f"name is {len(v)} characters long; at most {MAX_NAME if '.' not in v else MAX_PATH} are allowed")
    reason = path_reason(v)
    if reason:
        fail(path, key, f"'{v}' is {reason}; choose another name")
    return v


def value_name(v, key, path):
    """The name of a value of the pipeline: an input, or an op's result named with `as:`."""
    return ident(v, key, path, value_reserved_reason)


def dim(v, key, path):
    """One dimension index (negative counts from the end)."""
    if is_int(v) and abs(v) <= MAX_SIZE:
        return v
    fail(path, key, f"expected a dimension index, got {show(v)}")


def shape(v, key, path):
    """A shape: a positive integer, or a list of at most 5 positive integers where one may be -1
    (the rest, as in view); returns a tuple (checked further where it is used)."""
    if size_ok(v, 1):
        return (v,)
    if isinstance(v, list) and len(v) <= 5 and all(size_ok(e, 1) or (is_int(e) and e == -1) for e in v):
        if v.count(-1) > 1:
            fail(path, key, f"at most one -1 in a shape, got {show(v)}")
        return tuple(v)
    fail(path, key, f"expected a positive integer or a list of at most 5 of them (one may be -1), got {show(v)}")


def dims(v, key, path):
    if is_int(v) and abs(v) <= MAX_SIZE:
        return (v,)
    if isinstance(v, list) and 0 < len(v) <= 5 and all(is_int(e) and abs(e) <= MAX_SIZE for e in v):
        if len(set(v)) != len(v):
            fail(path, key, f"repeated dimension in {show(v)}")
        return tuple(v)
    fail(path, key, f"expected a dimension index or a non-empty list of at most 5 of them, got {show(v)}")


def ones(rank: int) -> Callable:
    def check(v, key, path):
        if (is_int(v) and v == 1) or (isinstance(v, list) and len(v) == rank and all(is_int(e) and e == 1 for e in v)):
            return (1,) * rank
        fail(path, key, f"only global pooling (output_size 1) is supported, got {show(v)}")

    return check


def value_names(v, key, path):
    """A non-empty list of value names (cat's other pieces, in order)."""
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not 0 < len(v) <= 64:
        fail(path, key, f"expected a non-empty list of at most 64 value names, got {show(v)}")
    return tuple(value_name(e, f"{key}[{i}]", path) for i, e in enumerate(v))


def index(v, key, path):
    """An integer position along a dim (negative counts from the end)."""
    if is_int(v) and abs(v) <= MAX_SIZE:
        return v
    fail(path, key, f"expected an integer index, got {show(v)}")


def permutation(v, key, path):
    """A permutation of a tensor's dims, as torch.permute takes it (checked against the rank where it is used)."""
    if isinstance(v, list) and 1 < len(v) <= 6 and all(is_int(e) and abs(e) <= 6 for e in v):
        return tuple(v)
    fail(path, key, f"expected a list of 2 to 6 dimension indices, got {show(v)}")


def sizes(v, key, path):
    """A positive integer or a list of 1 to 3 of them (one per spatial dim, checked where it is used)."""
    if size_ok(v, 1):
        return (v,)
    if isinstance(v, list) and 0 < len(v) <= 3 and all(size_ok(e, 1) for e in v):
        return tuple(v)
    fail(path, key, f"expected a positive integer or a list of 1 to 3 of them, got {show(v)}")


def scales(v, key, path):
    """A positive number or a list of 1 to 3 of them (scale factors per spatial dim)."""
    items = v if isinstance(v, list) and 0 < len(v) <= 3 else [v]
    out = []
    for i, e in enumerate(items):
        e = number(e, key if items is not v else f"{key}[{i}]", path)
        if e <= 0:
            fail(path, key, f"expected positive scale factors, got {show(v)}")
        out.append(e)
    return tuple(out)


def pads(v, key, path):
    """F.pad's pad: an even-length list of integers (last dim first: left, right, then the dim before)."""
    if isinstance(v, list) and v and len(v) % 2 == 0 and len(v) <= 10 and all(is_int(e) and abs(e) <= MAX_SIZE for e in v):
        return tuple(v)
    fail(path, key, f"expected a list of 2, 4, ... 10 integers (before and after, last dim first), got {show(v)}")


def expand_shape(v, key, path):
    """A sample shape to expand to: positive sizes, -1 where the size stays."""
    if isinstance(v, list) and 0 < len(v) <= 5 and all(size_ok(e, 1) or (is_int(e) and e == -1) for e in v):
        return tuple(v)
    fail(path, key, f"expected a list of at most 5 sizes (positive, or -1 to keep one), got {show(v)}")


def choice(*options: str) -> Callable:
    def check(v, key, path):
        if not isinstance(v, str) or v not in options:
            fail(path, key, f"expected one of {', '.join(options)}, got {show(v)}")
        return v

    return check
