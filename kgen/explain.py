"""`kgen explain`: what the planner did with a spec, the candidates it chose among, and the floor."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from . import cost, tunefile
from .errors import KgenError
from .families.base import typed_ops, value_bytes
from .ir import Conv, Pipeline
from .plan import (KGEN, PIPELINE, Plan, candidate_plans, choose_plans, describe_choices, make_plan,
                   training_candidates)
from .stage import ConvStage
from .target import Target

MODEL_PIECE_MIN_MS = 0.005  # pieces of a stage's estimate listed beside it (not a weight pack's microseconds)


def stage_cost(plan: Plan, stage, batch: int) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one stage for ``batch`` samples at best: each input read once,
    each output written once (the floor's measure; the cost model's is ``Family.work``). A stage
    that runs another as its epilogue never writes its output, and the epilogue stage reads
    nothing from memory (it works on the tile); statistics gathered by the stage before read its
    tiles' moments."""
    flops = sum(op.flops(t_in, t_out) for op, t_in, t_out in typed_ops(stage)) * batch
    if plan is not None and not stage.family.generates_kernel and not any(
            w.bytes or w.launches for w in stage.family.work(stage, batch, plan.target)):
        return flops, 0  # a view (a reshape, a permute the next stage reads in place): nothing moves
    if isinstance(stage, ConvStage):
        conv = stage.conv.conv
        read = batch * conv.in_channels * math.prod(stage.input_extent) + math.prod(conv.weight_shape())
        written = batch * sum(math.prod(t.dims) for t in stage.output.tiles)
    else:
        read = batch * sum(t.stored for t in stage.input.tiles)
        written = batch * stage.out_type.sample_numel if stage.family.writes_output else 0
    if isinstance(stage, ConvStage) and stage.epilogue is not None:  # set only with the epilogue's absorbed_by
        written = 0
    if getattr(stage, "output_dropped", False):  # only the statistics' tile moments (counted by their stage)
        written = 0
    if stage.absorbed_by is not None:
        read = 0
    if getattr(stage, "gathered_by", None) is not None or stage.in_place:
        # statistics gathered by the stage before: its tiles' moments; a cat written in place: the copies it makes
        return flops, sum(w.bytes for w in stage.family.work(stage, batch, plan.target))
    operands = sum(w.bytes for w in cost.operand_reads(plan, stage, batch))  # the other tensors its ops read
    return flops, value_bytes(stage) * (read + written) + operands


def floor_ms(flops: int, nbytes: int, target: Target, dtype: str = "float32") -> tuple[float, str]:
    """A kernel's floor: its FLOPs at the tensor cores' rate for ``dtype`` products, or its bytes at DRAM's."""
    compute, memory = flops / target.product_flops(dtype) * 1e3, nbytes / target.dram_bytes_per_s * 1e3
    return (compute, "compute") if compute >= memory else (memory, "memory")


def kernel_costs(plan: Plan, batch: int) -> list[tuple[int, int]]:
    """(FLOPs, bytes) per kernel of the plan: a stage with the one it runs as its epilogue."""
    costs: dict[int, list[int]] = {}
    for s in plan.stages:
        flops, nbytes = stage_cost(plan, s, batch)
        c = costs.setdefault(id(s.absorbed_by if s.absorbed_by is not None else s), [0, 0])
        c[0] += flops
        c[1] += nbytes
    return [(c[0], c[1]) for c in costs.values()]


def plan_totals(plan: Plan, batch: int) -> tuple[int, int, float]:
    """FLOPs, bytes, and the floor in ms: kernels run one after another, so their floors add
    (a fused epilogue is part of its convolution's kernel)."""
    costs = kernel_costs(plan, batch)
    return sum(c[0] for c in costs), sum(c[1] for c in costs), sum(floor_ms(*c, plan.target, plan.pipeline.dtype)[0] for c in costs)


def fused_floor_ms(pipe: Pipeline, batch: int, target: Target) -> float:
    """The floor of the fully fused pipeline (bench's floor ratio divides by it): the lowest
    over kgen's candidate plans, every rewrite the choices allow (the default candidates
    may write an intermediate that another candidate never writes: a norm fused into its
    convolution). In the pipeline's dtype: its bytes per value and tensor-core rate (the eager plan's floor
    where no kgen plan computes that dtype)."""
    plans = candidate_plans(pipe, target, batch)
    return min(plan_totals(p, batch)[2] for p in [p for p in plans if p.choices.get(PIPELINE, KGEN) == KGEN] or plans)


def rounding_lines(plan: Plan, stage) -> list[str]:
    """What a 16-bit plan's generated stage rounds to its dtype inside its math (kgen.plan.rounding_points)."""
    dtype = plan.pipeline.dtype
    if dtype == "float32" or not stage.family.generates_kernel:
        return []
    if not stage.rounded:
        return [f"float32 between its ops, rounded to {dtype} at its output only (spec `intermediates: float32`)"]
    return [f"rounds to {dtype} after " + ", ".join(op.key for op in stage.rounded) + " (eager's tensors; "
            "spec `intermediates: float32` keeps float32 between ops)"]


def explain_text(pipe: Pipeline, rewrites: dict | None = None, batch: int | None = None, training: bool = False,
                 dtype: str | None = None) -> str:
    """``training``: detail training mode's plan where eval mode has its own (default: eval mode's);
    ``dtype``: that dtype's plan (default: the spec's first)."""
    sel = choose_plans(pipe, rewrites=rewrites)
    batch = batch or pipe.example_batch()
    dtype = dtype or pipe.dtypes[0]
    variant = sel.variant_for(batch, training, dtype)
    plan = variant.plan
    target = plan.target
    try:
        baseline = make_plan(replace(sel.pipeline, dtype=dtype), {n: False for n in pipe.rewrites}, target, {PIPELINE: KGEN})
    except KgenError as e:  # e.g. plan.conv: gemm, and no rewrite makes the convolution one conv_gemm computes
        baseline, no_baseline = None, str(e)
    sym = pipe.batch_symbol
    out = [
        f"{pipe.name} ({pipe.path}): {pipe.input} -> {pipe.output}, precision {pipe.precision}",
        f"counts below are for {sym or 'batch'} = {batch}; target {target.described()}",
    ]
    if pipe.dtypes != ("float32",):
        out.append(f"dtypes: {', '.join(pipe.dtypes)} (a plan per dtype; the details below are {dtype}'s, --dtype picks)")
    out += [
        "",
        "ops as written:",
    ]
    for op, t in zip(pipe.ops, pipe.types[1:]):
        out.append(f"  {op.key:28s} {op.describe():55s} -> {t}")
    out += ["", "choices:"]
    out.append(f"  chosen by {sel.source}")
    for n in sel.notes:
        out.append(f"  note: {n}")
    if sel.pipeline.eager_conv_tf32:
        calls = ", ".join(f"{m} {'TF32' if tf32 else 'fp32'}" for m, tf32 in sel.pipeline.eager_conv_tf32)
        out.append(f"  eager's cuDNN convolutions, as `kgen tune` measured them on {target.name}: {calls} "
                   "(the generated convolutions' precision follows)")
    if sel.pipeline.eager_batch_norms:
        out.append("  training mode: the batch norms run as eager's ATen call and the convolutions before them as eager's "
                   "cuDNN call, for eager's bits (a norm after the next convolution would amplify a last-bit difference; "
                   "`intermediates: float32` in the spec takes kgen's own statistics and convolutions)")
    if sel.source == "cost model" and any(isinstance(op, Conv) and len(op.kernel) == 3 for op in pipe.ops):
        # measured on the H100 (docs/performance.md): which 3-d kernel cuDNN picks is not a rate
        out.append(f"  note: the cost model's estimates for cuDNN's 3-d convolutions are rough (off by up to 6x either way "
                   f"on the H100): `kgen tune {pipe.path}` measures the candidates on this GPU")
    if len(sel.variants) > 1:
        for i, v in enumerate(sel.variants):
            out.append(f"  plan {i} for {v.runs}: {describe_choices(v.plan.choices)}")
    out += _candidates(sel, batch, dtype, training)
    mode = {"eval": " in eval mode, as bench and tune run it", "train": " in training mode"}.get(variant.mode, "")
    out += ["", "rewrites:" + ("" if len(sel.variants) == 1 else f" (the plan for {sym or 'batch'} = {batch}{mode})")]
    for d in plan.decisions:
        out.append(f"  {'fired  ' if d.fired else 'skipped'}  {d.rewrite:24s} {d.site}: {d.reason}")
    if not plan.decisions:
        out.append("  (none: the plan runs the ops as written)" if plan.choices.get(PIPELINE) != KGEN else "  (no rewrite applies)")
    out += ["", "ops after rewrites:"]
    for op, t in zip(plan.pipeline.ops, plan.pipeline.types[1:]):
        out.append(f"  {op.describe():84s} -> {t}")
    out += ["", "kernels of the plan (floor: at best; model: the cost model's estimate):"]
    estimates = {id(e.stage): e for e in cost.estimate(plan, batch)}
    for s in plan.stages:
        flops, nbytes = stage_cost(plan, s, batch)
        fl, bound = floor_ms(flops, nbytes, target, plan.pipeline.dtype)
        what = " -> ".join(o.describe() for o in s.ops) or "copy the previous stage's output into a plain tensor"
        extra = f" [{s.conv.lowering.name}, {s.layout}]" if isinstance(s, ConvStage) else ""
        out.append(f"  stage {s.index} {s.kind}{extra}: {what}")
        out.append(f"      {s.choice}")
        if s.absorbed_by is not None:
            out.append(f"      runs inside stage {s.absorbed_by.index}'s kernel (its epilogue)")
        else:
            out += [f"      {line}" for line in s.family.explain_lines(s)]
        if s.into is not None:
            c0 = s.into.channel0
            out.append(f"      writes its output into channels {c0}..{c0 + s.out_type.shape[1] - 1} of stage {s.into.stage}'s "
                       "(the cat's) output")
        if s.in_place:
            copied = len(s.ops[0].tensors) + 1 - len(s.in_place)
            out.append(f"      operands {', '.join(map(str, s.in_place))} (0: the input) written in place by their stages"
                       + (f"; copies the other {copied}" if copied else "; copies nothing"))
        out += [f"      {line}" for line in rounding_lines(plan, s)]
        e = estimates.get(id(s))
        model = f"   model {e.ms:.3f} ms ({e.launches} launches)" if e else ""
        out.append(f"      {flops / 1e9:10.2f} GFLOP  {nbytes / 1e6:10.1f} MB   floor {fl:.3f} ms ({bound}){model}")
        pieces = [(w.what, 1e3 * cost.work_s(w, target)) for w in (e.work if e else [])]
        if sum(ms >= MODEL_PIECE_MIN_MS for _, ms in pieces) > 1:  # what the estimate adds up
            out.append("      model: " + " + ".join(f"{what} {ms:.3f}" for what, ms in pieces if ms >= MODEL_PIECE_MIN_MS) + " ms")
    for label, p in (("total", plan), ("without rewrites", baseline)):
        if p is None:
            out.append(f"  {label:17s}: no plan ({no_baseline})")
            continue
        flops, nbytes, fl = plan_totals(p, batch)
        model = cost.estimate_ms(p, batch)
        out.append(f"  {label:17s}: {flops / 1e9:10.2f} GFLOP  {nbytes / 1e6:10.1f} MB   floor {fl:.3f} ms   model {model:.3f} ms")
    rate = "TF32" if plan.pipeline.dtype == "float32" else f"{plan.pipeline.dtype} tensor cores"
    out.append(f"  (floor: FLOPs / {target.product_flops(plan.pipeline.dtype) / 1e12:.0f} TFLOP/s {rate}, "
               f"bytes / {target.dram_bytes_per_s / 1e12:.1f} TB/s, "
               "summed over kernels)")
    out.append(replay_line(plan, batch, target))
    return "\n".join(out)


def replay_line(plan: Plan, batch: int, target: Target) -> str:
    """Whether the module replays this plan's kernels as one CUDA graph at ``batch`` where no autograd graph is
    recorded (kgen.runtime.replay_pays: the host's dispatch the GPU waits for against the bytes the replay copies)."""
    from .runtime import replay_pays

    dispatch, argument_bytes = cost.replay_terms(plan, batch)
    work = [w for e in cost.estimate(plan, batch) for w in e.work]
    launches, calls = sum(w.launches for w in work), sum(w.calls for w in work)
    pays = replay_pays(dispatch, argument_bytes, target)
    copied = 2 * argument_bytes  # at most (replay_pays)
    library = f", {calls} library call{'s' * (calls > 1)}" if calls else ""
    return (f"CUDA-graph replay without autograd (at batch {batch}): {'yes' if pays else 'no'}: the host's dispatch "
            f"the GPU waits for {1e3 * dispatch:.3f} ms (of {1e3 * sum(cost.dispatch_s(w, target) for w in work):.3f} ms: "
            f"{launches} launches{library}) against the replay's copies, at most "
            f"{copied / 1e6:.1f} MB ({1e3 * copied / target.dram_bytes_per_s:.3f} ms)")


def _candidates(sel, batch: int, dtype: str = "float32", training: bool = False) -> list[str]:
    """The candidate plans (of ``dtype``) with the model's estimate and, from the tuning file, the measured time;
    ``training``: training mode's candidates where it has a plan of its own (the cost model's: not tuned)."""
    train = sel.variant_for(batch, True, dtype)
    if training and train.mode == "train":
        pipe = sel.pipeline if sel.pipeline.dtype == dtype else replace(sel.pipeline, dtype=dtype)
        cands, chosen_plan, measured = training_candidates(pipe, train.plan.target), train.plan, {}
        mode, times = "train", "the cost model's: `kgen tune` measures eval mode's plans"
    else:
        cands = [p for p in sel.candidates if p.pipeline.dtype == dtype]
        variant = sel.variant_for(batch, dtype=dtype)  # eval mode's, as the candidates
        chosen_plan, mode, times = variant.plan, variant.mode, "measured: the tuning file's times on this target"
        entry = sel.tuning_for(dtype)
        measured = tunefile.measured(entry) if entry is not None else {}
    if len(cands) < 2:
        return []
    chosen = json.dumps(chosen_plan.choices, sort_keys=True)
    rows = []
    if all(json.dumps(p.choices, sort_keys=True) != chosen for p in cands):  # found one choice at a time from them
        cands = [chosen_plan] + cands
    for p in cands:
        key = json.dumps(p.choices, sort_keys=True)
        ms = measured.get(key, {}).get(batch)
        rows.append((cost.estimate_ms(p, batch), ms, key == chosen, describe_choices(p.choices)))
    rows.sort(key=lambda r: (r[1] is None, r[1] if r[1] is not None else r[0]))
    where = {"eval": " in eval mode", "train": " in training mode"}.get(mode, "")
    where += "" if dtype == "float32" else f" in {dtype}"
    out = [f"  candidates{where} at batch {batch} (* = chosen; {times}):",
           f"    {'model ms':>10s} {'measured ms':>12s}  plan"]
    for est, ms, mark, text in rows:
        out.append(f"  {'*' if mark else ' '} {est:10.3f} {'-' if ms is None else f'{ms:.3f}':>12s}  {text}")
    return out
