"""`kgen explain`: what the planner did with a spec, and the floor it can reach."""
from __future__ import annotations

import math

from .ir import Pipeline
from .plan import Plan, make_plan
from .stage import ConvStage

# H100 SXM: TF32 tensor-core rate and HBM3 bandwidth used for floors.
PEAK_FLOPS = 400e12
PEAK_BYTES_PER_S = 3.0e12
FLOAT_BYTES = 4


def stage_cost(plan: Plan, stage, batch: int) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one stage for ``batch`` samples: each input read once, each output written once."""
    flops = sum(op.flops(t_in, t_out) for op, t_in, t_out in _typed(plan.pipeline, stage)) * batch
    if isinstance(stage, ConvStage):
        conv = stage.conv.conv
        read = batch * conv.in_channels * math.prod(stage.input_extent) + math.prod(conv.weight_shape())
        written = batch * sum(math.prod(t.dims) for t in stage.output.tiles)
    else:
        read = batch * sum(math.prod(t.dims) for t in stage.input.tiles)
        written = batch * stage.out_type.sample_numel
    return flops, FLOAT_BYTES * (read + written)


def _typed(pipe: Pipeline, stage):
    by_id = {id(o): (t_in, t_out) for o, t_in, t_out in zip(pipe.ops, pipe.types, pipe.types[1:])}
    return [(op,) + by_id[id(op)] for op in stage.ops]


def floor_ms(flops: int, nbytes: int) -> tuple[float, str]:
    compute, memory = flops / PEAK_FLOPS * 1e3, nbytes / PEAK_BYTES_PER_S * 1e3
    return (compute, "compute") if compute >= memory else (memory, "memory")


def plan_totals(plan: Plan, batch: int) -> tuple[int, int, float]:
    """FLOPs, bytes, and the floor in ms: stages run one after another, so their floors add."""
    costs = [stage_cost(plan, s, batch) for s in plan.stages]
    return sum(c[0] for c in costs), sum(c[1] for c in costs), sum(floor_ms(*c)[0] for c in costs)


def explain_text(pipe: Pipeline, rewrites: dict | None = None, batch: int | None = None) -> str:
    plan = make_plan(pipe, rewrites)
    baseline = make_plan(pipe, {n: False for n in pipe.rewrites})
    batch = batch or pipe.example_batch()
    sym = pipe.batch_symbol
    out = [
        f"{pipe.name} ({pipe.path}): {pipe.input} -> {pipe.output}, precision {pipe.precision}",
        f"counts below are for {sym or 'batch'} = {batch}",
        "",
        "ops as written:",
    ]
    for op, t in zip(pipe.ops, pipe.types[1:]):
        out.append(f"  {op.key:28s} {op.describe():55s} -> {t}")
    out += ["", "rewrites:"]
    for d in plan.decisions:
        out.append(f"  {'fired  ' if d.fired else 'skipped'}  {d.rewrite:24s} {d.site}: {d.reason}")
    if not plan.decisions:
        out.append("  (no rewrite applies)")
    out += ["", "ops after rewrites:"]
    for op, t in zip(plan.pipeline.ops, plan.pipeline.types[1:]):
        out.append(f"  {op.describe():84s} -> {t}")
    out += ["", "kernels of the plan:"]
    for s in plan.stages:
        flops, nbytes = stage_cost(plan, s, batch)
        fl, bound = floor_ms(flops, nbytes)
        what = " -> ".join(o.describe() for o in s.ops) or "copy the previous stage's output into a plain tensor"
        extra = f" [{s.conv.lowering.name}, {s.layout}]" if isinstance(s, ConvStage) else ""
        out.append(f"  stage {s.index} {s.kind}{extra}: {what}")
        out.append(f"      {s.choice}")
        out.append(f"      {flops / 1e9:10.2f} GFLOP  {nbytes / 1e6:10.1f} MB   floor {fl:.3f} ms ({bound})")
    for label, p in (("total", plan), ("without rewrites", baseline)):
        flops, nbytes, fl = plan_totals(p, batch)
        out.append(f"  {label:17s}: {flops / 1e9:10.2f} GFLOP  {nbytes / 1e6:10.1f} MB   floor {fl:.3f} ms (sum over stages)")
    out.append(f"  (H100 floor: FLOPs / {PEAK_FLOPS / 1e12:.0f} TFLOP/s TF32, bytes / {PEAK_BYTES_PER_S / 1e12:.1f} TB/s)")
    return "\n".join(out)
