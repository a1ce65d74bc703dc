"""`kgen bench`: time generated modules against eager PyTorch and torch.compile.

All in one process on one GPU: CUDA events around each call, warm-up first
(torch.compile compiles then), the median of ``reps`` timed calls. Measured
per pipeline: eager (the reference model in float32, PyTorch's default cuDNN
settings), torch.compile (default mode), the convolution alone (eager), kgen,
and kgen with every rewrite off; and the post-convolution part alone: eager's
ops after the conv vs kgen's fused stages (no-rewrite plan) on the same conv
output. Each of kgen's stages is timed too (torch.profiler: the device time
of the kernels inside the stage's named range), for the roofline plot.

Each row has the floor ratio (kgen's time over the fused pipeline's floor,
``kgen.explain.fused_floor_ms``) and is marked where kgen is slower than eager.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

from .errors import KgenError
from .ir import Conv, load_pipeline
from .explain import fused_floor_ms, stage_cost
from .plan import choose_plans, stage_scope_name
from .reference import ReferenceModel
from .runtime import launches_one_by_one
from .spec import REWRITE_NAMES
from .target import current
from .validate import import_module_dir, init_args, pack_buffer

WARMUP = 5
BLOCK = 10  # consecutive calls of one function per turn; the first of each is not counted
PROFILED_CALLS = 10  # calls under torch.profiler for the per-stage times


def time_ms(fn, reps: int) -> float:
    """Median of about ``reps`` CUDA-event timings of fn(), after warm-up."""
    return time_in_blocks({"fn": fn}, reps)["fn"]


def time_call(fn, cuda: bool = True) -> float:
    """ms of one call of fn(): CUDA events around it (the queue is drained after it), or on
    the CPU the wall clock."""
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_in_blocks(fns: dict, reps: int, device: str = "cuda", block: int = BLOCK) -> dict:
    """Median time in ms of each of ``fns`` (name -> callable) over about ``reps`` calls, after
    warm-up: CUDA events (the queue drained before each call), or on the CPU the wall clock.
    The functions take turns in blocks of BLOCK consecutive calls, the first call of a block
    not counted: turns make a drift of the GPU's clocks or of the host weigh on all of them
    alike (pipelines of 0.1 ms moved by a third between back-to-back runs), blocks time each
    the way it runs when called repeatedly, as KernelBench times a model. Turns of single
    calls measured a short kgen call right after a long eager one, which ran 0.05-0.3 ms
    slower than the same call after itself (bench/bench_order.py, docs/performance.md). ``block``
    1 times them in turns of single calls, every call counted."""
    cuda = device.startswith("cuda")
    for fn in fns.values():
        for _ in range(WARMUP):
            fn()
    if cuda:
        torch.cuda.synchronize()
    times = {name: [] for name in fns}
    counted = block - 1 if block > 1 else 1  # calls of a block that count
    for _ in range(max(1, -(-reps // counted))):
        for name, fn in fns.items():
            for i in range(block):
                ms = time_call(fn, cuda)
                if i or block == 1:
                    times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def _commit() -> str:
    if os.environ.get("KGEN_COMMIT"):
        return os.environ["KGEN_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        # "-dirty" where the tracked files differ from the commit: the numbers are not that commit's alone
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True).returncode == 0
        return head if clean else f"{head}-dirty"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _utc_now() -> str:
    """A measurement's date, as reports and tuning files write it."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def environment() -> dict:
    return dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        commit=_commit(),
        date=_utc_now(),
        host=platform.node(),
    )


def models_and_inputs(module_dir: Path, spec, dtype: str = "float32"):
    """What a timing runs, on CUDA: (pipeline, its example batch, the module's Model, the
    reference model with the same weights (seed 0), random inputs at that batch), all in
    ``dtype`` (model.to(dtype), as a user converts a model: eager and torch.compile too)."""
    pipe = load_pipeline(spec)
    batch = pipe.example_batch()
    mod = import_module_dir(module_dir)
    torch.manual_seed(0)
    model = mod.Model(*init_args(mod)).cuda().eval()
    ref = ReferenceModel(pipe).cuda().eval()
    ref.load_state_dict(model.state_dict())
    inputs = [torch.randn(pipe.inputs[n].concrete(batch), device="cuda") for n in pipe.input_names]
    if dtype != "float32":
        dt = getattr(torch, dtype)
        model, ref, inputs = model.to(dt), ref.to(dt), [t.to(dt) for t in inputs]
    return pipe, batch, model, ref, inputs


def bench_one(module_dir: Path, spec, reps: int, baseline: bool, dtype: str = "float32") -> dict:
    from .variants import baseline_module

    pipe, batch, model, ref, (x, *others) = models_and_inputs(module_dir, spec, dtype)
    row = dict(name=pipe.name if dtype == "float32" else f"{pipe.name} [{dtype}]", batch=batch,
               input=list(pipe.input.concrete(batch)), dtype=dtype)
    baseline = baseline and dtype == "float32"  # (16-bit plans run the ops as written: no rewrites to compare)
    with torch.no_grad():
        fns = {"eager_ms": lambda: ref(x, *others)}
        compiled = None
        try:
            compiled = torch.compile(ref)
            compiled(x, *others)  # compiles here: inductor may fail on a model eager runs
            fns["compile_ms"] = lambda: compiled(x, *others)
        except Exception as e:  # noqa: BLE001 - the row says so and the bench goes on
            compiled, text = None, str(e).strip()
            row["compile_error"] = f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}".rstrip(": ")
            print(f"kgen: bench {row['name']}: torch.compile failed ({row['compile_error']}); timed without it", flush=True)
            torch._dynamo.reset()
        fns["kgen_ms"] = lambda: model(x, *others)
        row.update(time_in_blocks(fns, reps))
        row.setdefault("compile_ms", None)
        row["floor_ms"] = fused_floor_ms(replace(pipe, dtype=dtype), batch, current())
        try:
            row["stages"] = stage_times(module_dir.name, pipe, model, x, *others, dtype=dtype)
        except RuntimeError as e:  # the profiler is unavailable here (CUPTI): the plot goes without stages
            print(f"kgen: bench {pipe.name}: no per-stage times ({str(e).splitlines()[0][:120]})", flush=True)
            row["stages"] = []
        first = pipe.ops[0]
        if isinstance(first, Conv):
            conv = ref.get_submodule(first.module)
            row["conv_ms"] = time_ms(lambda: conv(x), reps)
            conv_out = conv(x)
            tensors = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}  # a batch norm reads its running statistics
            rest = pipe.ops[1:]

            def eager_post():
                y = conv_out
                for op in rest:
                    y = op.run(y, tensors)
                return y

            row["eager_post_ms"] = time_ms(eager_post, reps)
        if baseline:
            nr_dir = baseline_module(spec)
            nr_mod = import_module_dir(nr_dir)  # the same constructor arguments as the module's
            nr = nr_mod.Model(*init_args(nr_mod)).cuda().eval()
            nr.load_state_dict(model.state_dict())
            row["kgen_norewrite_ms"] = time_ms(lambda: nr(x, *others), reps)
            if isinstance(first, Conv):
                plan = choose_plans(pipe, rewrites={n: False for n in REWRITE_NAMES}).plans[0]  # the module's
                fused = plan.kernel_stages()
                if fused and fused[0].index == 1:
                    params = dict(nr.named_parameters())
                    calls = []
                    for st in fused:
                        op = getattr(torch.ops.kgen, f"{nr_dir.name}_stage{st.index}")
                        calls.append((op, [params[a.name] for a in plan.stage_args(st)]))
                    packed = pack_buffer(fused[0].input, conv_out)

                    def kgen_post():
                        y = calls[0][0](packed, calls[0][1], [])
                        for op, args in calls[1:]:
                            y = op([y], args, [])
                        return y

                    row["kgen_post_ms"] = time_ms(kgen_post, reps)
    del compiled
    torch.cuda.empty_cache()
    return row


def stage_times(name: str, pipe, model, x, *others, dtype: str = "float32") -> list[dict]:
    """Per stage of the plan that runs at x's batch: its device time (torch.profiler, the
    kernels launched inside its named range), FLOPs and bytes at best (``stage_cost``)."""
    from torch.profiler import ProfilerActivity, profile

    sel = choose_plans(pipe)
    variant = sel.variant_for(x.shape[0], dtype=dtype)
    index, plan = sel.variants.index(variant), variant.plan
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, launches_one_by_one():  # each stage's range
        for _ in range(PROFILED_CALLS):
            model(x, *others)
        torch.cuda.synchronize()
    events = {e.key: e for e in prof.key_averages()}
    out = []
    for st in plan.stages:
        e = events.get(stage_scope_name(name, index, len(sel.variants), st))
        device_us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) if e else 0.0
        flops, nbytes = stage_cost(plan, st, x.shape[0])
        out.append(dict(stage=st.index, kind=st.kind, family=st.family.name, ms=device_us / 1e3 / PROFILED_CALLS,
                        flops=flops, bytes=nbytes))
    return out


def run_bench(module_dirs, spec_of, reps: int = 30, baseline: bool = True, dtypes=None) -> dict:
    """Each module in each of its spec's dtypes (``dtypes``: only those of them)."""
    if not torch.cuda.is_available():
        raise KgenError("kgen bench needs a CUDA GPU")
    if reps < 20:
        raise KgenError("--reps must be at least 20 for a meaningful median")
    rows = []
    for d in module_dirs:
        spec = spec_of(d)
        for dtype in load_pipeline(spec).dtypes:
            if dtypes and dtype not in dtypes:
                continue
            row = bench_one(d, spec, reps, baseline, dtype)
            rows.append(row)
            print(f"kgen: bench {row['name']}: eager {row['eager_ms']:.3f} ms, compile {_f(row['compile_ms'])} ms, "
                  f"kgen {row['kgen_ms']:.3f} ms{'  SLOWER than eager' if slower(row) else ''}", flush=True)
    result = dict(environment=environment(), reps=reps, warmup=WARMUP, block=BLOCK, rows=rows)
    print(markdown_table(result))
    return result


def _f(v, digits=3):
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a, b) -> str:
    """a / b as a speed-up, "-" where a was not measured (torch.compile failed)."""
    return "-" if a is None else f"{a / b:.2f}x"


def slower(row: dict) -> bool:
    """kgen slower than eager PyTorch on this row."""
    return row["kgen_ms"] > row["eager_ms"]


def markdown_table(result: dict) -> str:
    head = ("| pipeline | batch | eager ms | torch.compile ms | conv alone ms | kgen ms | vs eager | vs compile | floor ms "
            "| kgen / floor | kgen no-rewrites ms | post-conv eager ms | post-conv kgen ms | post-conv speedup |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        post_e, post_k = r.get("eager_post_ms"), r.get("kgen_post_ms")
        floor = r.get("floor_ms")
        ratio = f"{r['kgen_ms'] / floor:.1f}x" if floor else "-"
        vs_eager = f"{r['eager_ms'] / r['kgen_ms']:.2f}x" + (" **slower**" if slower(r) else "")
        lines.append(
            f"| {r['name']} | {r.get('batch', '-')} | {_f(r['eager_ms'])} | {_f(r['compile_ms'])} | {_f(r.get('conv_ms'))} "
            f"| {_f(r['kgen_ms'])} | {vs_eager} | {_ratio(r['compile_ms'], r['kgen_ms'])} | {_f(floor)} "
            f"| {ratio} | {_f(r.get('kgen_norewrite_ms'))} "
            f"| {_f(post_e)} | {_f(post_k)} | {'-' if not (post_e and post_k) else f'{post_e / post_k:.2f}x'} |"
        )
    behind = [r["name"] for r in result["rows"] if slower(r)]
    lines += ["", f"kgen slower than eager: {', '.join(behind)}" if behind else "kgen is at least as fast as eager on every row."]
    failed = [f"{r['name']} ({r['compile_error']})" for r in result["rows"] if r.get("compile_error")]
    if failed:
        lines += ["", "torch.compile failed on: " + "; ".join(failed)]
    return "\n".join(lines)


def write_reports(result: dict, json_path: Path | None, md_path: Path | None) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    if md_path:
        env = result["environment"]
        text = [
            f"# kgen bench on {env['device']}",
            "",
            f"torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}, cuDNN TF32 allowed: {env['cudnn_allow_tf32']}),"
            f" commit {env['commit']}, {env['date']}.",
            f"Median of about {result['reps']} runs after {result['warmup']} warm-up runs, CUDA events, one process; eager, torch.compile and kgen take turns in blocks of {result['block']} calls, the first call of each block not counted.",
            "",
            markdown_table(result),
            "",
        ]
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text("\n".join(text))
