"""The kgen command line. Errors print one line (``kgen: error: ...``) and exit 1."""
from __future__ import annotations

import math

import functools
import sys
from pathlib import Path

import click

from . import __version__
from .errors import KgenError, one_line
from .spec import DTYPES

DEFAULT_SPECS = Path("specs")
DEFAULT_OUT = Path("generated")


def _fail_cleanly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KgenError as e:
            msg = str(e)
            first, _, rest = msg.partition("\n")
            click.echo(f"kgen: error: {first}", err=True)
            if rest:
                click.echo(rest, err=True)
            sys.exit(1)

    return wrapper


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def _spec_paths(specs: tuple[str, ...]) -> list[Path]:
    if specs:
        return [Path(s) for s in specs]
    found = sorted(DEFAULT_SPECS.glob("*.yaml"))
    if not found:
        raise KgenError(f"no specs given and none found under {DEFAULT_SPECS}/")
    return found


def _module_dirs(out: Path, names: tuple[str, ...]) -> list[Path]:
    if names:
        # a spec file names its module (specs/x.yaml -> x), as `kgen render` writes it
        dirs = [out / (Path(n).stem if n.endswith((".yaml", ".yml")) else n) for n in names]
        for d in dirs:
            if not (d / "binding.cpp").exists():
                raise KgenError(f"no rendered module {d.name!r} under {out}/; run `kgen render specs/{d.name}.yaml`")
        return dirs
    dirs = sorted(d for d in out.iterdir() if (d / "binding.cpp").exists()) if out.exists() else []
    if not dirs:
        raise KgenError(f"no rendered modules under {out}/; run `kgen render` first")
    return dirs


def _spec_of(module_dir: Path) -> Path:
    """The spec a module was rendered from (plan.json names it relative to the project)."""
    import json

    plan = module_dir / "plan.json"
    if not plan.exists():
        raise KgenError(f"{module_dir} has no plan.json; run `kgen render` again")
    spec = module_dir.parent.parent / json.loads(plan.read_text())["spec"]
    if not spec.exists():
        raise KgenError(f"{module_dir.name}: its spec {spec} is gone")
    return spec


def _device(device: str | None) -> str:
    """``--device`` checked against this machine (default: cuda if available, else cpu)."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    shown = one_line(device, 80)
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise KgenError(f"--device {shown}: not a device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise KgenError(f"--device {shown}: no CUDA device is available (torch {torch.__version__}, {build})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise KgenError(f"--device {shown}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type != "cpu":
        raise KgenError(f"--device {shown}: kgen runs on cpu or cuda")
    return device


def _positive(value: int | None, option: str) -> None:
    if value is not None and value < 1:
        raise KgenError(f"{option} must be a positive integer, got {value}")


def _render_specs(specs: tuple[str, ...], out: Path):
    """Render every spec in memory (all or nothing); two specs with one name are an error."""
    from .render import render_spec

    paths, seen_files = [], set()
    for p in _spec_paths(specs):
        key = Path(p).resolve() if Path(p).exists() else p
        if key not in seen_files:  # the same file named twice renders once
            seen_files.add(key)
            paths.append(p)
    notes: list[str] = []
    rendered = [render_spec(p, out, notes=notes) for p in paths]
    for n in notes:  # a tuning file that does not apply, and why
        click.echo(f"kgen: {n}", err=True)
    owner = {}
    for p, r in zip(paths, rendered):
        if r.name in owner:
            raise KgenError(f"{one_line(owner[r.name], 160)} and {one_line(p, 160)} both have name '{r.name}'; "
                            "rendered together one would overwrite the other")
        owner[r.name] = p
    return paths, rendered


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="kgen", message="%(prog)s %(version)s")
def main():
    """Render fused GPU/CPU kernels from YAML pipeline specs.

    \b
    A spec (specs/NAME.yaml) lists ops, shapes and reduction axes; kgen plans
    it (with algebraic rewrites), renders CUDA and C++ sources whose sizes are
    compile-time constants into generated/NAME/, builds them with ninja, and
    checks them against PyTorch in float64.

    \b
    Typical session (`kgen ops` lists the ops a spec may name):
      kgen render specs/maxpool_sum.yaml   # write generated/maxpool_sum/
      kgen build                           # compile every rendered module
      kgen validate                        # compare with the float64 reference
      python -c "from generated import maxpool_sum"
    or all of it at once: kgen all

    \b
    Environment:
      KGEN_DEVICE=cpu|cuda      build variant when --device is not given
                                (default: cuda when torch has CUDA and nvcc is found)
      TORCH_CUDA_ARCH_LIST      GPU architectures to build for, e.g. "9.0a;8.0"
                                (default: the GPU's own; sm_90a on Hopper)
      KGEN_TARGET=default       plan for the default target (an H200) instead of this GPU,
                                so that rendering gives the committed files on any machine
      KGEN_MAX_ELEMENTS=N       largest activation sample or weight a spec may make
                                (default 2**34 elements)
      KGEN_POISON_OUTPUTS=1     fill outputs with a NaN pattern before the kernels run
                                (kgen validate sets it, to catch unwritten elements)
      KGEN_CUDA_GRAPHS=0        launch a module's kernels one by one, never as a replayed
                                CUDA graph (the default where no autograd graph is recorded)
      KGEN_MEASURE=0            under the backend, run kgen's form of every graph and
                                partition, never measured against PyTorch's (the default
                                runs the faster, timed in the first calls)
      KGEN_CACHE=DIR            kgen's cache (default ~/.cache/kgen): what kgen.compile and
                                the backend compile, and the CPU build's precompiled
                                kgen_runtime.h (KGEN_PCH=0 builds without it); `kgen cache`
                                shows and clears it
      CUDA_HOME, CXX            the CUDA toolkit and the C++ compiler to build with
    """


@main.command()
@click.argument("specs", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if generated/ differs from what rendering gives.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True,
              help="Where the module directories go.")
@_fail_cleanly
def render(specs, check, out):
    """Render SPECS (default: specs/*.yaml) into OUT/NAME/.

    Each module gets stages.h (the math), kernel.cu (CUDA schedule),
    kernel_cpu.cpp (C++ schedule), binding.cpp (the torch op), __init__.py and
    plan.json; past 4000 lines the three sources come in parts (kernel_2.cu,
    ...) that the build compiles in parallel. With --check nothing is written
    and stale files are listed.
    """
    from .render import stale_files, write_rendered

    _, rendered = _render_specs(specs, out)  # all or nothing: render everything first
    if check:
        # dict.fromkeys: a shared header (conv_gemm.cuh) is every module's, listed once
        stale = list(dict.fromkeys(f"{out}/{f}" for r in rendered for f in stale_files(r, out)))
        if stale:
            raise KgenError(f"{len(stale)} generated file(s) are stale; run `kgen render`:\n  " + "\n  ".join(stale))
        click.echo(f"generated/ is up to date ({len(rendered)} module(s))")
        return
    for r in rendered:
        changed = write_rendered(r, out)
        click.echo(f"{r.name}: {len(changed)} file(s) written" if changed else f"{r.name}: up to date")


@main.command()
@click.argument("names", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Build variant (default: cuda when a GPU and nvcc are there, else cpu).")
@_fail_cleanly
def build(names, out, device):
    """Compile rendered modules NAMES (default: all under generated/).

    Builds are cached by a hash of the sources, flags, torch version and GPU
    arch; an unchanged module is not rebuilt. Concurrent builds are safe.
    """
    from .build import build_modules

    for r in build_modules(_module_dirs(out, names), device):
        click.echo(f"{r.name}: {'built' if r.built else 'up to date'} -> {r.library}")


def _run_validation(module_dirs, device, full, baseline, verbose, specs=None, example_batch=False, batch=None):
    """Validate each module against its spec (``specs``: the spec paths, else read from plan.json)."""
    from .validate import validate

    rows, failed = [], []
    for i, d in enumerate(module_dirs):
        spec = specs[i] if specs else _spec_of(d)
        reports = [("rewritten", validate(spec, d, device, full=full, example_batch=example_batch, batch=batch))]
        if baseline:
            from .variants import baseline_module

            reports.append(("no rewrites", validate(spec, baseline_module(spec), device, full=full, stages=False)))
        for label, whole in reports:
            for dtype, rep in whole.by_dtype():  # a row per dtype the module computes
                if not rep.cases:
                    continue
                normal = [c for c in rep.cases if c.case.removeprefix(f"{dtype}: ").startswith("normal") and math.isfinite(c.rel_l2)]
                rows.append([
                    d.name + ("" if label == "rewritten" else " (no rewrites)") + ("" if dtype == "float32" else f" [{dtype}]"),
                    rep.device, rep.precision if dtype == "float32" else dtype,
                    f"{sum(c.passed for c in rep.cases)}/{len(rep.cases)}", f"{max((c.rel_l2 for c in normal), default=math.nan):.2e}",
                    f"{max((c.max_abs for c in normal), default=math.nan):.2e}", "ok" if rep.passed else "FAIL",
                ])
            rep = whole
            for c in rep.cases:
                if verbose or not c.passed:
                    mark = "ok  " if c.passed else "FAIL"
                    click.echo(f"  {mark} {rep.name}: {c.case}: max abs {c.max_abs:.2e}, rel L2 {c.rel_l2:.2e} {c.problem}")
            if not rep.passed:
                failed.append(rep.name)
    click.echo(format_table(
        ["module", "device", "precision", "cases passed", "rel L2 err (normal)", "max abs err (normal)", "status"], rows
    ))
    return failed


@main.command()
@click.argument("names", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available).")
@click.option("--full", is_flag=True, help="More random seeds.")
@click.option("--example-batch", is_flag=True, help="Also check at each spec's example batch (a model's own size).")
@click.option("--batch", type=int, default=None, help="Run the end-to-end cases at this batch only (e.g. 1 for huge models on the CPU).")
@click.option("--baseline", is_flag=True, help="Also build and check the same spec with every rewrite off.")
@click.option("-v", "--verbose", is_flag=True, help="Print every case, not only failures.")
@_fail_cleanly
def validate(names, out, device, full, example_batch, batch, baseline, verbose):
    """Check modules NAMES (default: all) against the float64 reference.

    End-to-end cases (normal data, batch 1, odd batch, NaN, large values,
    ties, non-contiguous and channels_last inputs) and per-stage adversarial
    cases (+-inf, NaN, ties, data far from zero, constants) with poisoned
    outputs. Tolerances follow the spec's precision (tf32 on CUDA).
    """
    _positive(batch, "--batch")
    failed = _run_validation(_module_dirs(out, names), _device(device), full, baseline, verbose,
                             example_batch=example_batch, batch=batch)
    if failed:
        raise KgenError(f"validation failed: {', '.join(failed)}")


@main.command(name="all")
@click.argument("specs", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available).")
@click.option("--example-batch", is_flag=True, help="Also check at each spec's example batch (a model's own size).")
@click.option("--batch", type=int, default=None, help="Run the end-to-end cases at this batch only (e.g. 1 for huge models on the CPU).")
@_fail_cleanly
def all_(specs, out, device, example_batch, batch):
    """Render, build and validate SPECS (default: specs/*.yaml) and print a table.

    This is the main job: it leaves every module importable
    (`from generated import NAME`) and exits 1 if any check fails.
    """
    from .build import build_modules
    from .render import write_rendered

    device = _device(device)
    paths, rendered = _render_specs(specs, out)
    for r in rendered:
        write_rendered(r, out)
    dirs = [out / r.name for r in rendered]
    build_modules(dirs, "cuda" if device.startswith("cuda") else "cpu")
    _positive(batch, "--batch")
    failed = _run_validation(dirs, device, False, False, False, specs=paths, example_batch=example_batch, batch=batch)
    if failed:
        raise KgenError(f"validation failed: {', '.join(failed)}")


def _shape_option(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not 2 <= len(shape) <= 5 or min(shape) < 1:
        raise KgenError(f"--input-shape {one_line(text, 80)}: expected 2 to 5 positive sizes like 128,3,32,32")
    return shape


@main.command(name="import")
@click.argument("source")
@click.option("--name", default=None, help="Module name (default: from the file name).")
@click.option("--input-shape", "input_shapes", multiple=True,
              help="An input's shape, batch first, e.g. 128,3,32,32 (repeat for each input); needed for "
                   "package.module:Class without get_inputs().")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("specs"),
              show_default=True, help="Where the spec goes.")
@_fail_cleanly
def import_(source, name, input_shapes, out_dir):
    """Import a PyTorch model as specs/NAME.yaml, ready for `kgen all`.

    SOURCE is a file in KernelBench's layout (class Model, get_inputs(),
    get_init_inputs()) or package.module:Class. The model is traced with
    torch.fx; every call becomes a spec op. The spec records the constructor
    arguments (the generated Model takes the same ones) and the inputs, the
    batch as the run-time symbol N. An unsupported call is one error naming it
    and its file:line, and nothing is written.
    """
    from .importer import import_model

    shapes = [_shape_option(s) for s in input_shapes] or None
    path = import_model(source, name, shapes, out_dir)
    click.echo(f"{path}: written; next: kgen all {path}")


@main.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--no-rewrites", is_flag=True, help="Plan with every rewrite off.")
@click.option("--batch", type=int, default=None, help="Batch for FLOPs and bytes (default: the spec's example).")
@click.option("--training", is_flag=True,
              help="Detail training mode's plan and list its candidates (where a batch norm gives eval mode a plan of "
                   "its own; default: eval mode's).")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Detail this dtype's plan (default: the spec's first).")
@_fail_cleanly
def explain(spec, no_rewrites, batch, training, dtype):
    """Show how SPEC is planned: what chose the plan (the spec's tuning file
    for this target, else the cost model), every candidate plan with the
    model's estimate and the measured time, ops before and after rewrites,
    which rewrites fired and why others did not, the stages, FLOPs, bytes
    moved, the target's floor (FLOPs / its tensor-core rate, bytes / its DRAM
    bandwidth, both printed with it) and the model's estimate per stage. Where
    a batch norm uses running statistics, eval mode has a plan of its own; the
    details are eval mode's (as bench and tune run the module) unless
    --training."""
    from .explain import explain_text
    from .ir import load_pipeline
    from .spec import REWRITE_NAMES

    _positive(batch, "--batch")
    pipe = load_pipeline(spec)
    if dtype is not None and dtype not in pipe.dtypes:
        raise KgenError(f"{spec}: the spec's dtypes are {', '.join(pipe.dtypes)}, not {dtype} (add it to the input's `dtype`)")
    click.echo(explain_text(pipe, {n: False for n in REWRITE_NAMES} if no_rewrites else None, batch, training, dtype))


@main.command(name="ops")
def ops_():
    """List every op a spec may name, from the op table (kgen/ops.py): its
    fields with their defaults (* = required), its role (the IR op that
    computes it) and the template families that can absorb it."""
    from .fields import REQUIRED
    from .ops import MADE_BY_REWRITES, OPS

    def field(name, default):
        return f"{name}*" if default is REQUIRED else (name if default is None else f"{name}={default}")

    rows = [[e.name, e.role, ", ".join(field(n, d) for n, (_, d) in e.fields.items()) or "-", ", ".join(e.families), e.doc]
            for e in OPS.values() if e.name not in MADE_BY_REWRITES]
    click.echo(format_table(["op", "role", "fields", "families", "what"], rows))


@main.command(name="list")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@_fail_cleanly
def list_(out):
    """List the specs under specs/ with their stages and whether generated/ is fresh."""
    from .ir import load_pipeline
    from .plan import choose_plans
    from .render import render_plan, stale_files

    rows = []
    for p in _spec_paths(()):
        pipe = load_pipeline(p)
        sel = choose_plans(pipe)
        stale = stale_files(render_plan(sel, out), out)
        state = "missing" if not (out / pipe.name).exists() else ("stale" if stale else "fresh")
        stages = " | ".join(" + ".join(s.kind for s in plan.stages) for plan in sel.plans)
        rows.append([pipe.name, str(pipe.input), str(pipe.output), stages, sel.source, state])
    click.echo(format_table(["name", "input", "output", "stages (per batch range)", "chosen by", "generated/"], rows))


@main.command()
@click.option("--older-than", "days", type=click.FloatRange(min=0), metavar="DAYS",
              help="Remove the entries that no compile or build has used for DAYS days.")
@click.option("--clear", is_flag=True, help="Remove every entry.")
@_fail_cleanly
def cache(days, clear):
    """Show kgen's cache ($KGEN_CACHE, default ~/.cache/kgen): the models and
    partitions compiled by kgen.compile and torch.compile(backend="kgen")
    (compiled/, one per model and kgen version), and the CPU build's
    precompiled headers (pch/, ~290 MB each; all but the two last used are
    removed when a new one is made). With --older-than or --clear, remove
    entries: what is removed is compiled again when next needed.

    \b
    kgen cache                  # where it is, what it holds
    kgen cache --older-than 30  # what was not used in a month
    """
    import time

    from .cache import DYNAMIC_BATCH_FILE, entries, human, kgen_cache, remove, remove_stray_locks

    root = kgen_cache()
    found = entries(root)
    if clear or days is not None:
        cutoff = time.time() - (days or 0) * 86400
        gone = [e for e in found if clear or e.used < cutoff]
        for e in gone:
            remove(e)
        if clear:
            remove_stray_locks(root, min_age=0)
            (root / DYNAMIC_BATCH_FILE).unlink(missing_ok=True)
        click.echo(f"kgen cache {root}: removed {len(gone)} of {len(found)} entries ({human(sum(e.size for e in gone))})")
        found = entries(root)
    rows = []
    for kind in ("compiled", "pch"):
        mine = [e for e in found if e.kind == kind]
        last = time.strftime("%Y-%m-%d %H:%M", time.localtime(mine[-1].used)) if mine else "-"
        rows.append([kind, len(mine), human(sum(e.size for e in mine)), last])
    click.echo(f"kgen cache: {root}")
    click.echo(format_table(["kind", "entries", "size", "last used"], rows))


@main.command()
@click.argument("names", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--arch", default="9.0a", show_default=True, help="CUDA arch to compile for.")
@_fail_cleanly
def ptxas(names, out, arch):
    """Compile the kernel.cu of NAMES (default: all) with nvcc only (no GPU,
    no torch CUDA needed) and print ptxas' registers, stack and spills per
    kernel. Exits 1 if any kernel spills, uses local memory or has its wgmma
    instructions serialized by ptxas (C7518)."""
    from .build import demangle, ptxas_report

    rows, bad = [], []
    for d in _module_dirs(out, names):
        for k in ptxas_report(d, arch):
            name = demangle(k.name)
            rows.append([d.name, name.split("(")[0], k.registers, k.stack, f"{k.spill_stores}/{k.spill_loads}",
                         "serialized" if k.serialized_wgmma else "-"])
            if not k.clean:
                bad.append(f"{d.name}: {name}")
    click.echo(format_table(["module", "kernel", "registers", "stack bytes", "spill st/ld bytes", "wgmma"], rows))
    if bad:
        raise KgenError("kernels spill, use local memory or run serialized wgmma:\n  " + "\n  ".join(bad))


@main.command()
@click.argument("names", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write the numbers as JSON.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, path_type=Path), help="Also write a Markdown report.")
@click.option("--reps", type=int, default=30, show_default=True, help="Timed runs per measurement (median).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also time each spec with every rewrite off.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw a roofline of each stage and kgen vs eager vs torch.compile (needs matplotlib: kgen[plot]).")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="Time only these of each spec's dtypes (default: every one; eager and torch.compile in the same dtype).")
@_fail_cleanly
def bench(names, out, json_path, md_path, reps, baseline, plot_path, dtypes):
    """Time modules NAMES (default: all) on the GPU against eager PyTorch and
    torch.compile in the same process: CUDA events, warm-up, median of REPS.

    Each row has kgen's floor ratio (its time over the fully fused pipeline's
    floor: FLOPs / the GPU's TF32 rate + bytes / its DRAM bandwidth per
    stage, kgen.target's figures for it) and is
    marked where kgen is slower than eager. Each stage is timed too
    (torch.profiler), for the roofline of --plot.
    """
    from .bench import run_bench, write_reports

    _positive(reps, "--reps")
    if plot_path:  # fail before the measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise KgenError("--plot needs matplotlib: pip install 'kgen[plot]'") from None
    results = run_bench(_module_dirs(out, names), _spec_of, reps=reps, baseline=baseline, dtypes=dtypes)
    write_reports(results, json_path, md_path)
    if plot_path:
        from .plot import plot

        click.echo(f"plot: {plot(results, plot_path)}")


@main.command()
@click.argument("specs", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--batch", "batches", type=int, multiple=True,
              help="Also tune at this batch (repeatable); the spec's example batch is always tuned.")
@click.option("--reps", type=int, default=30, show_default=True, help="Timed runs per candidate (median).")
@click.option("--max-candidates", type=int, default=None,
              help="Candidates measured per spec at most: the cost model's best and the eager one (default 8).")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="Tune the plans of this dtype (repeatable; default: every dtype of each spec).")
@click.option("--precision-only", is_flag=True,
              help="Only measure whether eager's float32 cuDNN calls for the specs' convolutions run TF32 on this "
                   "GPU (seconds; nothing built) and store it: the cost model's plans then match eager's precision "
                   "there, where untuned they assume fp32 calls on a GPU whose rules were not measured.")
@_fail_cleanly
def tune(specs, batches, reps, max_candidates, dtypes, precision_only):
    """Measure the candidate plans of SPECS (default: specs/*.yaml) on this GPU
    and write each spec's tuning file (specs/NAME.tune.json), which
    `kgen render` reads.

    \b
    Candidates: each size-dependent rewrite on or off where it applies
    (sub-pixel or direct transposed convolution, dead-region cropping,
    avg-pool folding), each stage's implementations (a convolution's output
    layouts), and the spec's ops run eagerly through ATen. Each is rendered
    under generated/_tune/, built, checked against eager PyTorch and timed
    (CUDA events, median of REPS). The fastest at each batch wins; where the
    winner changes with the batch, the module dispatches between plans by
    batch range. A file keeps one entry per device and dtype (16-bit plans:
    the models and inputs converted to the dtype, checked against eager
    PyTorch in it); an entry for another device, or one made before the
    spec or kgen's candidates changed, is ignored by render (with a note),
    and the cost model decides.
    """
    from .tune import MAX_CANDIDATES, PRECISION_HEADERS, TABLE_HEADERS, run_precision, run_tune

    if precision_only:
        if batches or dtypes or max_candidates:
            raise KgenError("--precision-only measures eager's float32 calls at each spec's example batch: "
                            "--batch, --dtype and --max-candidates do not apply")
        click.echo(format_table(PRECISION_HEADERS, run_precision(_spec_paths(specs))))
        return
    for b in batches:
        _positive(b, "--batch")
    _positive(reps, "--reps")
    rows = run_tune(_spec_paths(specs), list(batches), reps, max_candidates or MAX_CANDIDATES, dtypes=tuple(dtypes))
    click.echo(format_table(TABLE_HEADERS, rows))


if __name__ == "__main__":
    main()
