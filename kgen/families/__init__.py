"""The template families: each is one module here plus one folder ``templates/<name>/``.

The planner asks the families which of them accept a group of ops
(``claimants``) and picks among them; it knows no family by name. Adding a
family: a module with a ``Family`` subclass and ``FAMILY = ...`` (see
``base.py``), its template folder, an entry below, and its name in the op
table (``kgen.ops``) for the ops it absorbs.
"""
from __future__ import annotations

from . import aten, batch_stats, conv_aten, conv_gemm, eager, layer_norm, linear_aten, linear_gemm, norm, pool_reduce, softmax
from ..ops import OPS
from .base import EAGER_SOFTMAXES, Family, StageRequest, before_eager_batch_norm

# Registry order is the order of preference when several families accept the same ops
# (the default candidate; the tuning file or the cost model chooses among them).
# The generated convolution comes first; it declines (Family.unsupported) what cuDNN does better; so does the
# generated matrix product before cuBLAS's (linear_gemm declines targets without Hopper's warpgroup MMA).
# `aten` runs an op no fused family takes yet through its ATen function, in a stage of its own
# (and a layer_norm that the layer_norm family declines: rows too long for registers); alone, a
# layer_norm, softmax or logsumexp is also its candidate, after the generated family's.
FAMILIES: tuple[Family, ...] = (conv_gemm.FAMILY, conv_aten.FAMILY, norm.FAMILY, layer_norm.FAMILY, softmax.FAMILY,
                                pool_reduce.FAMILY, linear_gemm.FAMILY, linear_aten.FAMILY, batch_stats.FAMILY, aten.FAMILY)
# The whole pipeline as written, one ATen call per op: a candidate for every pipeline
# (kgen.plan), not a family the planner groups ops with.
EAGER = eager.FAMILY


MAX_REMEMBERED = 100_000
_CLAIMANTS: dict = {}  # what claimants() answered: planning asks again for every plan it tries


def claimants(ops) -> list[Family]:
    """The families that can compute ``ops`` as one stage. Remembered per family list, ops (values) and their
    op-table entries (by identity: an entry replaced is a new question; each remembered answer holds its entries,
    so their ids are not reused while it stands)."""
    entries = tuple(OPS.get(op.op_name) for op in ops)
    key = (FAMILIES, tuple(ops), tuple(map(id, entries)))
    found = _CLAIMANTS.get(key)
    if found is None:
        if len(_CLAIMANTS) > MAX_REMEMBERED:
            _CLAIMANTS.clear()
        found = _CLAIMANTS[key] = (entries, tuple(f for f in FAMILIES if f.accepts(list(ops))))
    return list(found[1])


def by_name(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


__all__ = ["EAGER", "EAGER_SOFTMAXES", "FAMILIES", "Family", "StageRequest", "before_eager_batch_norm", "by_name",
           "claimants"]
