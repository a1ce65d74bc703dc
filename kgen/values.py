"""Where the named values of a pipeline live: in a register of one stage, or in a tensor.

A value is an input or an op's result named with ``as:`` (an IR ``Capture``).
Ops read values as an elementwise operand (``tensor:``) or as their input
(``from:``). The plan keeps a value in a register where every reader is in the
same *run* as the value: consecutive elementwise ops with no op between that
changes the shape or reads another input, which a fused stage computes in one
function at the same coordinates (``x * sigmoid(x)``, ``x + original_x``).
Every other value is a tensor: an input, or the output of the stage that ends
with it; so is every output of the graph (``Pipeline.outputs``), read or not. So stage boundaries are *cuts*: before every op with ``from:``, and
after every non-local value unless a standalone op (a convolution, a GEMM, an
ATen op: always a stage of its own) computed it, whose output is already a
tensor.
"""
from __future__ import annotations

from dataclasses import replace

from .ir import Capture, Elementwise, Op, Pipeline
from .ops import FUSED, OPS


def standalone(op: Op) -> bool:
    """Whether ``op`` is always a stage of its own (no fused family absorbs it)."""
    return not any(f in FUSED for f in OPS[op.op_name].families)


def runs(ops) -> list[int]:
    """The run of each op: elementwise ops that follow each other without ``from:`` share one."""
    out, run = [], 0
    for i, op in enumerate(ops):
        prev = ops[i - 1] if i else None
        joins = (isinstance(op, Elementwise) and isinstance(prev, Elementwise) and op.src is None)
        if not joins:
            run += 1
        out.append(run)
    return out


def readers(ops) -> dict[str, list[int]]:
    """Each value's readers: the indices of the ops that read it (as operand or input)."""
    out: dict[str, list[int]] = {}
    for j, op in enumerate(ops):
        for name in set(op.value_names()) | ({op.src} if op.src is not None else set()):
            out.setdefault(name, []).append(j)
    return out


def _local(ops, c: int, run_of: list[int], cuts: set[int], readers_of: dict, outputs=()) -> bool:
    """Whether every reader of the value captured at ``c`` can take it from a register (an output
    before the last op is not: the stage that ends with it writes it for the op's result)."""
    if ops[c].name in outputs and c + 1 < len(ops):
        return False
    for j in readers_of.get(ops[c].name, ()):
        op = ops[j]
        if op.src is not None or run_of[j] != run_of[c] or any(k in cuts for k in range(c + 1, j + 1)):
            return False
    return True


def local_captures(pipe: Pipeline) -> set[int]:
    """Indices of the captures whose readers all take them from a register (before the plan's cuts)."""
    cuts = resolve(pipe.ops, pipe.outputs)[1]
    run_of, readers_of = runs(pipe.ops), readers(pipe.ops)
    return {c for c, op in enumerate(pipe.ops)
            if isinstance(op, Capture) and _local(pipe.ops, c, run_of, cuts, readers_of, pipe.outputs)}


def resolve(ops, outputs=()) -> tuple[tuple[Op, ...], set[int]]:
    """(ops with ``register`` set on the operands read from a register, cuts): a stage starts
    at every cut index; ``outputs``: the graph's outputs (each a tensor)."""
    ops = list(ops)
    run_of, readers_of = runs(ops), readers(ops)
    cuts = {i for i, op in enumerate(ops) if op.src is not None}
    changed = True
    while changed:
        changed = False
        for c, op in enumerate(ops):
            if not isinstance(op, Capture) or c + 1 >= len(ops) or c + 1 in cuts:
                continue
            if _local(ops, c, run_of, cuts, readers_of, outputs) or (c > 0 and standalone(ops[c - 1])) or c == 0:
                continue
            cuts.add(c + 1)
            changed = True
    names = {op.name: c for c, op in enumerate(ops) if isinstance(op, Capture)}
    for j, op in enumerate(ops):
        if isinstance(op, Elementwise) and op.tensor in names:
            c = names[op.tensor]
            local = run_of[j] == run_of[c] and not any(k in cuts for k in range(c + 1, j + 1))
            if local != op.register:
                ops[j] = replace(op, register=local)
    return tuple(ops), cuts


def materialized(plan) -> dict[str, str]:
    """The binding's tensor expression of each value that some stage reads as a tensor:
    inputs by name (the first is ``x``), a named result by the stage output holding it."""
    pipe = plan.pipeline
    names = pipe.input_names
    exprs = {n: ("x" if i == 0 else n) for i, n in enumerate(names)}
    prev = "x"
    for st in plan.stages:
        source = exprs[st.ops[0].src] if st.ops and st.ops[0].src is not None else prev
        st.source = source
        for k, op in enumerate(st.ops):
            if isinstance(op, Capture):
                if k == len(st.ops) - 1:
                    exprs[op.name] = f"t{st.index}"
                elif k == 0:
                    exprs[op.name] = source
        for name in st.names:
            exprs[name] = f"t{st.index}"
        prev = f"t{st.index}"
    return exprs
