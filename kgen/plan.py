"""Split a (rewritten) pipeline into stages; pick a family (an implementation) and a schedule for each.

1. The rewrites run (``kgen.rewrites``); each convolution's bias moves into
   the stage that reads the convolution (``defer_conv_bias``).
2. The op chain is grouped greedily: an op joins the current group while some
   template family accepts the longer group (``kgen.families.claimants``).
3. ``choose`` picks one of the families that accept a group (for a
   convolution: its implementations) and records why.
4. The chosen family makes the stage with its schedule, for the plan's
   ``Target`` (``kgen.target``); every tunable number is a field of a stage.
5. A convolution output that is not a plain tensor where it is read gets a
   copy stage; an implementation may absorb the next stage as its epilogue.

``plan.json`` records all of it; ``kgen explain`` prints it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from . import families, target as targets, values
from .errors import KgenError
from .ir import Capture, Elementwise, Op, Pipeline
from .lowering import lowered
from .ops import FUSED, OPS
from .rewrites import Decision, apply_rewrites
from .stage import Stage, flat_buffer
from .target import Target


@dataclass
class Plan:
    pipeline: Pipeline  # rewritten
    original: Pipeline
    decisions: list[Decision]
    stages: list[Stage]
    target: Target
    value_exprs: dict = None  # value name -> the binding's tensor holding it (kgen.values.materialized)

    @property
    def name(self) -> str:
        return self.pipeline.name

    def kernel_stages(self) -> list[Stage]:
        """Stages whose kernels kgen generates; each is also the op kgen::NAME_stageK."""
        return [s for s in self.stages if s.family.generates_kernel]

    def stage_args(self, stage: Stage) -> list:
        """The parameter tensors (TensorArgs) a stage takes, in the module's argument order."""
        names = stage.tensor_names()
        return [a for a in self.pipeline.tensor_args() if a.name in names]

    def stage_values(self, stage: Stage) -> list[str]:
        """The values a stage reads as tensors (operands not in a register), in definition order."""
        names = {n for op in stage.ops for n in op.value_names() if not getattr(op, "register", False)}
        return [n for n in self.pipeline.values if n in names]

    def to_json(self) -> dict:
        def stage_json(s: Stage) -> dict:
            d = {
                "index": s.index,
                "kind": s.kind,
                "ops": [o.describe() for o in s.ops],
                "spec_keys": s.keys,
                "input": str(s.in_type),
                "output": str(s.out_type),
                "family": s.family.name,
                "candidates": list(s.candidates),
                "choice": s.choice,
            }
            d.update(s.family.stage_json(s))
            return d

        return {
            "name": self.name,
            "spec": self.pipeline.path,
            "precision": self.pipeline.precision,
            "target": asdict(self.target),
            "rewrites": [asdict(d) for d in self.decisions],
            "ops_before": [o.describe() for o in self.original.ops],
            "ops_after": [o.describe() for o in self.pipeline.ops],
            "stages": [stage_json(s) for s in self.stages],
        }


# ---------------------------------------------------------------- planning


def defer_conv_bias(pipe: Pipeline) -> Pipeline:
    """Move each convolution's bias into the fused stage that reads it.

    cuDNN does not add a bias: ATen adds it in a separate pass over the whole
    convolution output. Adding it where the next stage loads the value costs
    nothing there, and the value is the same (conv, then one rounded add).
    """
    ops = []
    local = values.local_captures(pipe)
    for i, op in enumerate(pipe.ops):
        lc = lowered(op)
        nxt = pipe.ops[i + 1] if i + 1 < len(pipe.ops) else None
        # only into a fused stage; a conv output named for a later stage stays the conv stage's output
        fused_next = nxt is not None and any(f in FUSED for f in OPS[nxt.op_name].families) and nxt.src is None
        if isinstance(nxt, Capture) and i + 1 not in local:
            fused_next = False
        if lc is not None and lc.conv.bias and fused_next:
            ops.append(replace(lc, bias_deferred=True))
            view = (lc.conv.out_channels,) + (1,) * lc.conv.rank
            ops.append(Elementwise(key=op.key, fn="add", param=lc.conv.bias_name, param_view=view))
        else:
            ops.append(op)
    return pipe.with_ops(ops) if len(ops) != len(pipe.ops) else pipe


def group_ops(pipe: Pipeline, cuts: set[int] = frozenset()) -> list[tuple[int, list[Op], list[families.Family]]]:
    """Split the op chain into (first op index, ops, families that accept them); an op
    joins the current group while some family accepts the longer group, and a group
    starts at every cut (``kgen.values``: where a value must be a tensor)."""
    groups: list[tuple[int, list[Op]]] = []
    for i, op in enumerate(pipe.ops):
        if groups and i not in cuts and families.claimants(groups[-1][1] + [op]):
            groups[-1][1].append(op)
            continue
        if not families.claimants([op]):
            raise KgenError(f"{pipe.path}: {op.key}: no template family computes {op.describe()}")
        groups.append((i, [op]))
    return [(start, ops, families.claimants(ops)) for start, ops in groups]


def choose(candidates: list[families.Family]) -> tuple[families.Family, str]:
    """The family that computes a group, among those that accept it, and why.

    For now the first in registry order: there is no tuning file or cost model
    to compare candidates by yet (a convolution: ATen is the only implementation).
    """
    chosen = candidates[0]
    if len(candidates) == 1:
        return chosen, f"{chosen.name}: the only family that computes these ops"
    others = ", ".join(c.name for c in candidates[1:])
    return chosen, f"{chosen.name}: first in the registry (also possible: {others}; no tuning data or cost model yet)"


def make_plan(pipeline: Pipeline, rewrites: dict | None = None, target: Target | None = None) -> Plan:
    """Rewrite ``pipeline`` (per the spec's switches, or ``rewrites``) and split it into stages."""
    target = target or targets.current()
    rewritten, decisions = apply_rewrites(pipeline, rewrites)
    rewritten = defer_conv_bias(rewritten)
    resolved, cuts = values.resolve(rewritten.ops)
    rewritten = rewritten.with_ops(resolved)
    types = rewritten.types
    groups = group_ops(rewritten, cuts)
    # a group of nothing but names (after a standalone op, before a cut) names that op's output: no stage
    named_after, kept = {}, []
    for group in groups:
        if kept and all(isinstance(o, Capture) for o in group[1]):
            named_after.setdefault(len(kept) - 1, []).extend(o.name for o in group[1])
        else:
            kept.append(group)
    groups = kept
    chosen = [choose(cands) for _, _, cands in groups]
    batch = rewritten.example_batch()
    stages: list[Stage] = []
    buf = flat_buffer(rewritten.input)  # what the next stage reads
    for gi, (start, gops, cands) in enumerate(groups):
        family, why = chosen[gi]
        if gops[0].src is not None:  # it reads a value: a plain tensor
            buf = flat_buffer(rewritten.in_type(start))
        req = families.StageRequest(
            index=len(stages),
            ops=gops,
            types=(rewritten.in_type(start),) + types[start + 1 : start + len(gops) + 1],
            input=buf,
            next_family=chosen[gi + 1][0] if gi + 1 < len(groups) else None,
            pipeline=rewritten,
            target=target,
            batch=batch,
        )
        st = family.make_stage(req)
        st.family, st.candidates, st.choice = family, tuple(c.name for c in cands), why
        st.names = named_after.get(gi, [])
        buf = st.output
        stages.append(st)
    _add_copy_stages(stages, rewritten, target, batch)
    _absorb_epilogues(stages)
    for i, st in enumerate(stages):
        st.index = i
    plan = Plan(rewritten, pipeline, decisions, stages, target)
    plan.value_exprs = values.materialized(plan)
    return plan


def _add_copy_stages(stages: list[Stage], pipe: Pipeline, target: Target, batch: int) -> None:
    """A stage output that is not a plain tensor (sub-pixel phase tiles, a cropped or
    channels_last buffer) gets a copy stage where it is read as a tensor: at the end
    (a plain contiguous tensor) or by a stage that generates no kernel (a dense one)."""
    for i in range(len(stages) - 1, -1, -1):
        st = stages[i]
        nxt = stages[i + 1] if i + 1 < len(stages) else None
        if nxt is not None and nxt.family.generates_kernel:
            continue  # generated kernels read any buffer in place
        if st.output.flat or (nxt is not None and st.output.dense):
            continue
        family, why = choose(families.claimants([]))  # a stage of no ops: a copy
        t = st.out_type
        req = families.StageRequest(i + 1, [], (t,), st.output, nxt.family if nxt else None, pipe, target, batch)
        copy = family.make_stage(req)
        copy.family, copy.candidates, copy.choice = family, (family.name,), why
        stages.insert(i + 1, copy)


def _absorb_epilogues(stages: list[Stage]) -> None:
    """Let a stage's family take the next stage as its epilogue (a generated convolution may)."""
    i = 0
    while i + 1 < len(stages):
        st, nxt = stages[i], stages[i + 1]
        if st.family.absorbs_epilogue(st, nxt):
            st.epilogue, st.output = nxt, nxt.output
            del stages[i + 1]
        i += 1
