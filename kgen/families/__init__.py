"""The template families: each is one module here plus one folder ``templates/<name>/``.

The planner asks the families which of them accept a group of ops
(``claimants``) and picks among them; it knows no family by name. Adding a
family: a module with a ``Family`` subclass and ``FAMILY = ...`` (see
``base.py``), its template folder, an entry below, and its name in the op
table (``kgen.ops``) for the ops it absorbs.
"""
from __future__ import annotations

from . import aten, conv_aten, linear_aten, norm, pool_reduce
from .base import Family, StageRequest

# Registry order is the order of preference when several families accept the same ops.
FAMILIES: tuple[Family, ...] = (conv_aten.FAMILY, norm.FAMILY, pool_reduce.FAMILY, linear_aten.FAMILY, aten.FAMILY)


def claimants(ops) -> list[Family]:
    """The families that can compute ``ops`` as one stage."""
    return [f for f in FAMILIES if f.accepts(list(ops))]


def by_name(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


__all__ = ["FAMILIES", "Family", "StageRequest", "by_name", "claimants"]
