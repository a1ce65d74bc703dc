"""Render a plan through the Jinja2 templates into a module directory.

``generated/NAME/`` gets ``stages.h`` (the math of each fused stage, shared by
both backends), ``kernel.cu`` (CUDA schedules), ``kernel_cpu.cpp`` (C++
schedules), ``binding.cpp`` (the torch op), ``__init__.py`` and ``plan.json``;
``generated/`` itself gets the shared headers and the package ``__init__.py``,
so the output root is an importable package wherever it lies. A whole model's
kernel.cu, kernel_cpu.cpp and binding.cpp come in parts (``kernel_2.cu``, ...:
SPLIT_FILES) that compile in parallel.

The shared templates know no family: for each generated file they include,
stage by stage, the piece of the stage's family (``templates/<family>/``).
Rendering makes no decisions: everything comes from the plan.

Rendering is pure: every file is rendered in memory first and written only if
all of them rendered, each through a temporary file and an atomic rename.
"""
from __future__ import annotations

import contextlib
import importlib.resources
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2

from . import cexpr
from .errors import KgenError
from .families.eager import aten_call, aten_prelude
from .cost import exposed_dispatch_s
from .ir import dropout_refusal, load_pipeline
from .plan import Plan, Selection, Variant, choose_plans, stage_op_name, stage_scope_name
from .spec import NO_DEFAULT, spec_to_data
from .stage import Stage

# The templates ship inside the package: kgen/templates links to the
# repository's templates/ folder, and wheels carry copies (pyproject.toml).
TEMPLATES = Path(str(importlib.resources.files("kgen") / "templates"))
# Copied verbatim into the output root, under the same relative path (a family's
# kernel.cu piece includes its headers from there: Family.cuda_includes).
SHARED_FILES = ("kgen_math.h", "kgen_runtime.h", "kgen_launch.cuh", "conv_gemm/conv_gemm.cuh", "conv_gemm/wgmma.cuh", "conv_gemm/phase_pool.cuh",
                "conv_gemm/pool_ring.cuh", "linear_gemm/gemm3xtf32.cuh")
AT_DTYPES = {"float32": "at::kFloat", "bfloat16": "at::kBFloat16", "float16": "at::kHalf"}  # a spec's dtype in C++
# the element type a generated stage of a plan in the dtype reads and writes (kgen_math.h's 16-bit types)
C_TYPES = {"float32": "float", "bfloat16": "kgen::bfloat16", "float16": "kgen::float16"}
MODULE_FILES = {  # output file -> shared template; a family's piece of it: templates/<family>/<piece>.j2
    "stages.h": "stages.h.j2",
    "kernel.cu": "kernel.cu.j2",
    "kernel_cpu.cpp": "kernel_cpu.cpp.j2",
    "binding.cpp": "binding.cpp.j2",
    "__init__.py": "module.py.j2",
}
# Marks where each template's output starts in a generated file, so a compiler
# error can be traced back to its template (kgen.build reads these).
TEMPLATE_MARK = "kgen-template:"
# The kernel sources of a whole model run to tens of thousands of lines (DenseNet-201's kernel.cu: 40k), which one
# compiler process takes half a minute or more for. Past PART_LINES lines such a file is rendered as parts of
# consecutive stages of about equal length (kernel.cu, kernel_2.cu, ...; at most MAX_PARTS), which ninja compiles in
# parallel; each part includes stages.h, where every stage's launch is declared, so no part needs another's code.
SPLIT_FILES = ("kernel.cu", "kernel_cpu.cpp", "binding.cpp")
PART_LINES = 4000
MAX_PARTS = 16


@dataclass(frozen=True)
class Part:
    """Part ``number`` of a file split into the runs of stages ``split`` ((plan index, stage index) sets, one per
    part); WHOLE, the file unsplit, holds every stage."""
    number: int
    split: tuple | None  # None: WHOLE

    @property
    def count(self) -> int:
        return 1 if self.split is None else len(self.split)

    @property
    def stages(self) -> frozenset | None:
        return None if self.split is None else self.split[self.number - 1]

    def has(self, plan: int, stage: int) -> bool:
        return self.split is None or (plan, stage) in self.stages

    def has_plan(self, plan: int) -> bool:
        return self.split is None or any(p == plan for p, _ in self.stages)

    def stage_indices(self, plan: int) -> list[int]:
        """The indices of plan ``plan``'s stages in this part."""
        return sorted(s for p, s in self.stages or () if p == plan)

    def numbers_of(self, plan: int) -> list[int]:
        """The parts holding stages of plan ``plan``, in order."""
        return [1] if self.split is None else [k for k, ss in enumerate(self.split, 1) if any(p == plan for p, _ in ss)]

    def describe(self) -> str:
        """``stages 12-40 of plan 0, stages 0-7 of plan 1``."""
        plans: dict = {}
        for p, s in sorted(self.stages or ()):
            plans.setdefault(p, []).append(s)
        return ", ".join(f"stages {min(ss)}-{max(ss)} of plan {p}" if len(ss) > 1 else f"stage {ss[0]} of plan {p}"
                         for p, ss in plans.items())


WHOLE = Part(1, None)


def part_file(out: str, number: int) -> str:
    """The name of part ``number`` of the split file ``out``: ``kernel.cu``, ``kernel_2.cu``, ..."""
    stem, dot, suffix = out.partition(".")
    return out if number == 1 else f"{stem}_{number}{dot}{suffix}"


def part_number(out: str, name: str) -> int | None:
    """The part of ``out`` the file ``name`` is (1 for ``out`` itself), or None."""
    if name == out:
        return 1
    stem, _, suffix = out.partition(".")
    m = re.fullmatch(rf"{re.escape(stem)}_(\d+)\.{re.escape(suffix)}", name)
    return int(m[1]) if m and int(m[1]) >= 2 else None


def part_files(module_dir: Path, out: str) -> list[Path]:
    """The rendered parts of ``out`` in ``module_dir``, in order (render removes parts a new render lacks)."""
    found = [(part_number(out, f.name), f) for f in Path(module_dir).iterdir()] if Path(module_dir).is_dir() else []
    return [f for n, f in sorted((n, f) for n, f in found if n is not None)]


_STAGE_MARK = re.compile(r"^// ==== (plan|stage) (\d+)", re.M)


def stage_lines(text: str) -> list[tuple[tuple[int, int], int]]:
    """((plan, stage), lines) of each stage's piece in a rendered kernel file, in file order (from the
    ``// ==== plan`` and ``// ==== stage`` lines the shared templates write before each)."""
    out, plan, last = [], 0, None
    for m in _STAGE_MARK.finditer(text):
        line = text.count("\n", 0, m.start())
        if last is not None:
            out.append((last[0], line - last[1]))
            last = None
        if m[1] == "plan":
            plan = int(m[2])
        else:
            last = ((plan, int(m[2])), line)
    if last is not None:
        out.append((last[0], text.count("\n") - last[1]))
    return out


def split_stages(weights: list[tuple[tuple[int, int], int]], count: int, joined: frozenset = frozenset()) -> list[frozenset]:
    """``count`` runs of consecutive stages of about equal weight, none empty: a run ends where the next stage
    would take it farther past its share of the total than it is short of it. A stage in ``joined`` stays in the
    run of the stage before it."""
    units: list[list] = []  # [keys, weight]
    for key, w in weights:
        if units and key in joined:
            units[-1][0].append(key)
            units[-1][1] += w
        else:
            units.append([[key], w])
    count = max(1, min(count, len(units)))
    total, parts, acc, current = sum(w for _, w in units), [], 0, []
    for i, (keys, w) in enumerate(units):
        share = total * (len(parts) + 1) / count
        more = count - 1 - len(parts)  # parts still to start
        if current and more and (acc + w - share > share - acc or len(units) - i == more):
            parts.append(frozenset(current))
            current = []
        current += keys
        acc += w
    parts.append(frozenset(current))
    return parts


def runs_with_previous(st) -> bool:
    """Whether the stage before ``st`` runs it as its kernel's epilogue or gathers its statistics (ConvStage's
    epilogue and moments_for): forward calls the two as one, so a split keeps them in one part."""
    return st.absorbed_by is not None or getattr(st, "gathered_by", None) is not None


def forward_defines(st) -> bool:
    """Whether forward's calls define ``t<index>`` for ``st``: not for a stage that runs another as its epilogue
    (the epilogue's is defined), nor for a cat written in place (allocated before the stages)."""
    return not st.in_place and not isinstance(getattr(st, "epilogue", None), Stage)  # (pool_reduce's is its ops)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["cfloat"] = cexpr.cfloat
    env.filters["pyrepr"] = repr  # checked values only: None, bools, numbers, tuples of them
    env.filters["at_dtype"] = lambda d: AT_DTYPES[d]
    env.filters["ctype"] = lambda d: C_TYPES[d]
    env.filters["member"] = member_expr  # a checked member path (kgen.fields.member_path)
    env.globals.update(cexpr.FUNCTIONS, TEMPLATE_MARK=TEMPLATE_MARK, prod=math.prod, dropout_refusal=dropout_refusal,
                       fail=_fail, NO_DEFAULT=NO_DEFAULT, constructor_call=constructor_call, aten_call=aten_call,
                       aten_prelude=aten_prelude, forward_defines=forward_defines)
    return env


def member_expr(path: str, root: str = "self") -> str:
    """The Python expression of the member ``path`` of ``root`` (``getattr(self.layer1, "0").conv1``):
    numbered children (nn.Sequential's "0", kgen.runtime.set_member's containers) are read with
    getattr, names as attributes."""
    expr = root
    for part in path.split("."):
        expr = f'getattr({expr}, "{part}")' if part[0].isdigit() else f"{expr}.{part}"
    return expr


def _fail(message: str):
    """For templates: a case they do not handle (a template bug, reported by render_plan)."""
    raise jinja2.TemplateError(message)


SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+\Z")


def spec_display_path(spec_path: str, out_root: Path) -> str:
    """The spec path as the generated files name it: relative to the project (out_root's parent).

    It lands in comments and strings of generated code, so anything but plain
    path characters is replaced by the file name's safe part.
    """
    try:
        shown = os.path.relpath(Path(spec_path).resolve(), out_root.resolve().parent)
    except ValueError:  # another drive on Windows
        shown = Path(spec_path).name
    return shown if SAFE_PATH.match(shown) else "spec.yaml"


@dataclass
class Rendered:
    name: str
    files: dict[str, str]  # path relative to out_root -> content


def render_plan(plan: Plan | Selection, out_root: Path, spec_shown: str | None = None) -> Rendered:
    """Render one plan, or a selection of plans by batch range (one module, the op
    dispatches by batch), into the files of ``out_root``."""
    sel = plan if isinstance(plan, Selection) else Selection(plan.original, [Variant(plan)], "given")
    env = _environment()
    name = sel.name
    first = sel.variants[0].plan
    spec_shown = spec_shown or spec_display_path(first.pipeline.path, out_root)
    args = [a.name for a in sel.pipeline.tensor_args()]
    for v in sel.variants:  # every plan takes the op's arguments, in the op's order
        assert [a.name for a in v.plan.pipeline.tensor_args()] == args, (name, v.plan.choices)
    tensors = {a.name: a for v in sel.variants for a in v.plan.pipeline.stage_tensors()}
    values = first.pipeline.values  # the spec's named results (the same in every plan)
    op_args = op_arguments(sel.pipeline)
    forward_args, op_call_args = forward_arguments(sel.pipeline)
    n = len(sel.variants)

    def variant(i: int, v: Variant) -> dict:
        plan = v.plan

        def pieces(piece: str) -> list:
            """(stage, template) of each stage whose family renders ``piece``, in stage order."""
            return [(st, st.family.template(piece)) for st in plan.stages if piece in st.family.pieces]

        return dict(index=i, plan=plan, lo=v.lo, hi=v.hi, batches=v.batches, runs=v.runs, kernels=plan.kernel_stages(), pieces=pieces,
                    why=v.why, mode=v.mode, dtype=v.dtype,
                    op=lambda st: stage_op_name(name, i, n, st.index),
                    scope=lambda st: stage_scope_name(name, i, n, st))

    variants = [variant(i, v) for i, v in enumerate(sel.variants)]
    dispatch_us = host_dispatch_us(sel)  # the module's HOST_DISPATCH_US and plan.json's host_dispatch_us
    ctx = dict(
        name=name,
        dtypes=sel.dtypes,  # the op dispatches on x's dtype to its variants (Variant.dtype)
        dtype_key="`input:`" if not sel.pipeline.spec or not sel.pipeline.spec.multi_input else "each input of `inputs:`",
        pipe=sel.pipeline,
        plan=first,  # the header's and common macros' plan outside a variant
        variants=variants,
        spec_path=spec_shown,
        plan_summary=plan_summary(sel),
        binding_includes=sorted({h for v in sel.variants for st in v.plan.stages for h in st.family.binding_includes(st)}),
        ident=lambda n: tensors[n].ident,
        # (the plan: its value operands that are views are read through their strides, as its binding passes them)
        ew=lambda op, act, coords, plan: cexpr.elementwise(op, act, coords, tensors, values, plan.view_values()),
        summed=lambda ops: cexpr.summed_params(ops, tensors),
        host_summed=lambda ops: [i for i, _, host in cexpr.summed_params(ops, tensors) if host],
        spec_data=spec_data_literal(first),
        cuda_includes=sorted({h for v in sel.variants for st in v.plan.stages for h in st.family.cuda_includes}),
        zip=zip,
        op_args_cpp=lambda: ", ".join(a[0] for a in op_args),
        op_schema_args=lambda: ", ".join(a[1] for a in op_args),
        op_args_py=[a[2] for a in op_args],
        forward_args=forward_args,  # the functional forward's arguments (flat)
        op_call_args=op_call_args,  # the op's call on them
        dispatch_us=dispatch_us,
    )
    files = {}
    for out, tpl in MODULE_FILES.items():
        try:
            template = env.get_template(tpl)
            text = template.render(**ctx, part=WHOLE, template_name=f"templates/{tpl}")
            count = min(MAX_PARTS, -(-text.count("\n") // PART_LINES)) if out in SPLIT_FILES else 1
            if count <= 1:
                files[f"{name}/{out}"] = text
                continue
            # binding.cpp: its cost is forward's few lines per stage more than the host blocks' (one stage, one unit)
            weights = ([((v["index"], st.index), 1) for v in variants for st in v["plan"].stages] if out == "binding.cpp"
                       else stage_lines(text))
            joined = frozenset((v["index"], st.index) for v in variants for st in v["plan"].stages if runs_with_previous(st))
            split = tuple(split_stages(weights, count, joined))
            for number in range(1, len(split) + 1):
                files[f"{name}/{part_file(out, number)}"] = template.render(**ctx, part=Part(number, split),
                                                                            template_name=f"templates/{tpl}")
        except jinja2.TemplateError as e:  # a template bug, not a user error: say where
            where = getattr(e, "filename", None) or tpl
            raise KgenError(f"rendering templates/{tpl} for {name} failed in {where}: {type(e).__name__}: {e}") from None
    files[f"{name}/plan.json"] = json.dumps(selection_json(sel, spec_shown, dispatch_us), indent=1) + "\n"
    for f in SHARED_FILES:
        files[f] = (TEMPLATES / f).read_text()
    files["__init__.py"] = env.get_template("package_init.py.j2").render()
    return Rendered(name, files)


def host_dispatch_us(sel: Selection) -> dict:
    """The host's dispatch of a call at the example batch that the GPU waits for, in us, per mode (``any``, or
    ``train`` and ``eval`` where eval mode has a plan of its own; the least of the mode's plans'; the cost model's
    launches and library calls against its kernels' times, kgen.cost.exposed_dispatch_s): what a CUDA-graph replay
    of the op saves (kgen.runtime.replay_pays)."""
    batch = sel.pipeline.example_batch()
    return {mode: round(1e6 * min(exposed_dispatch_s(v.plan, batch) for v in sel.variants if v.mode == mode), 1)
            for mode in dict.fromkeys(v.mode for v in sel.variants)}


def selection_json(sel: Selection, spec_shown: str, dispatch_us: dict) -> dict:
    """plan.json: how the plans were chosen, the host's dispatch of a call (``host_dispatch_us``, as the module's
    HOST_DISPATCH_US), then each plan with the batches it runs."""
    return {
        "name": sel.name,
        "spec": spec_shown,
        "chosen_by": sel.source,
        "notes": sel.notes,
        "host_dispatch_us": dispatch_us,
        "plans": [{"batches": [v.lo, v.hi], "mode": v.mode} | ({} if v.dtype == "float32" else {"dtype": v.dtype})
                  | ({"eager_as_fast": True} if v.eager_as_fast else {})
                  | {k: x for k, x in v.plan.to_json().items() if k not in ("name", "spec")}
                  for v in sel.variants],
    }
def constructor_call(args) -> list[str]:
    """The positional arguments (reprs) that rebuild the reference model: every argument up to
    the last one without a default or with a value other than its default."""
    n = max((i + 1 for i, a in enumerate(args) if a.default is NO_DEFAULT or a.value != a.default), default=0)
    return [repr(a.value) for a in args[:n]]


def op_arguments(pipe) -> list[tuple[str, str, str]]:
    """(C++ parameter, schema argument, Python name) of each argument of the op kgen::NAME:
    the inputs (the first is x), the parameters as one list, the running statistics as
    one list (pipelines that have them), then the mode (pipelines with batch norm or
    dropout) and the running statistics' update weights. PyTorch's dispatcher takes ops
    of at most 64 arguments (a longer schema aborts the process when the library loads):
    with the lists, a spec's at most MAX_INPUTS inputs keep the op below that (spec.py says why)."""
    kinds = {"params": ("at::TensorList", "Tensor[]"), "buffers": ("at::TensorList", "Tensor[]"), "training": ("bool", "bool"),
             "factors": ("at::ArrayRef<double>", "float[]")}
    return [(f"{kinds[n][0]} {n}", f"{kinds[n][1]} {n}", n) if n in kinds else (f"const at::Tensor& {n}", f"Tensor {n}", n)
            for n in pipe.op_signature()]


def forward_arguments(pipe) -> tuple[list[str], str]:
    """The module's functional ``forward(x, *params)``: (its argument names: the op's arguments
    (op_arguments) with each list spelled out, one per parameter and buffer; the op's call on them,
    the parameters and buffers gathered into the op's lists)."""
    lists = {"params": [t.ident for t in pipe.tensor_args()], "buffers": [t.ident for t in pipe.buffer_args()]}
    names, call = [], []
    for _, _, arg in op_arguments(pipe):
        if arg in lists:
            names += lists[arg]
            call.append("[" + ", ".join(lists[arg]) + "]")
        else:
            names.append(arg)
            call.append(arg)
    return names, ", ".join(call)


def spec_data_literal(plan: Plan) -> str:
    """The module's spec as a Python literal (``spec_to_data``: checked identifiers and numbers only)."""
    spec = plan.original.spec
    if spec is None:
        raise KgenError(f"{plan.name}: the plan's pipeline was not built from a spec")
    data = spec_to_data(spec)  # with the spec's own name: a variant (NAME_norewrite) is the same spec
    lines = ["{"]
    for key, value in data.items():
        if key == "ops":  # one op a line
            lines += [f"    {key!r}: ["] + [f"        {_literal(op)}," for op in value] + ["    ],"]
        else:
            lines.append(f"    {key!r}: {_literal(value)},")
    return "\n".join(lines + ["}"])


def _literal(v) -> str:
    """``repr(v)`` of checked data, but an infinity (a mask's fill value) as ``float('inf')``, which Python reads."""
    if isinstance(v, float) and math.isinf(v):
        return "float('inf')" if v > 0 else "-float('inf')"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_literal(e)}" for k, e in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_literal(e) for e in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
    return repr(v)


def plan_summary(sel: Selection) -> str:
    """One line per stage (per plan when there are several), for the headers of generated files."""
    lines = []
    for i, v in enumerate(sel.variants):
        if len(sel.variants) > 1:
            lines.append(f"plan {i}, {v.runs}:")
        lines += [f"stage {s.index} ({s.kind}): " + " -> ".join(o.describe() for o in s.ops) for s in v.plan.stages]
    return "\n".join(lines)


def render_spec(spec_path, out_root: Path, rewrites: dict | None = None, name: str | None = None,
                notes: list | None = None) -> Rendered:
    """Load, plan and render one spec (``name`` renames the module, for variants); the
    choice's notes (a tuning file that does not apply) are appended to ``notes``."""
    pipe = load_pipeline(spec_path)
    sel = choose_plans(pipe, rewrites=rewrites)
    if notes is not None:
        notes += [f"{pipe.name}: note: {n}" for n in sel.notes]
    if name is not None:
        sel = rename(sel, name)
    return render_plan(sel, Path(out_root))


def rename(sel: Selection, name: str) -> Selection:
    """The same plans as module ``name`` (the spec keeps its own name: SPEC_DATA)."""
    def plan(p: Plan) -> Plan:
        return replace(p, pipeline=replace(p.pipeline, name=name), original=replace(p.original, name=name))
    return replace(sel, pipeline=replace(sel.pipeline, name=name), variants=[replace(v, plan=plan(v.plan)) for v in sel.variants])


def _same_text(path: Path, content: str) -> bool:
    try:
        return path.is_file() and path.read_text() == content
    except UnicodeDecodeError:  # not what kgen wrote: replace it
        return False


def obsolete_parts(rendered: Rendered, out_root: Path) -> list[str]:
    """Parts of split files (kernel_2.cu, ...) on disk that the rendering no longer has (paths relative to out_root):
    a build would compile every part it finds."""
    out_root, old = Path(out_root), []
    for module in sorted({rel.split("/", 1)[0] for rel in rendered.files if "/" in rel}):
        for out in SPLIT_FILES:
            old += [f"{module}/{f.name}" for f in part_files(out_root / module, out) if f"{module}/{f.name}" not in rendered.files]
    return old


def write_rendered(rendered: Rendered, out_root: Path) -> list[str]:
    """Write the files that changed and remove parts the rendering no longer has; returns their paths (relative
    to out_root).

    Every changed file is first written beside its target, then all are renamed
    into place; a file system error (a read-only directory) is one KgenError line
    and leaves nothing half-written.
    """
    out_root = Path(out_root)
    staged = []  # (temporary file, target, relative path)
    try:
        for rel, content in rendered.files.items():
            path = out_root / rel
            if _same_text(path, content):
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            staged.append((tmp, path, rel))
            tmp.write_text(content)
        for tmp, path, _ in staged:
            os.replace(tmp, path)
        removed = obsolete_parts(rendered, out_root)
        for rel in removed:
            (out_root / rel).unlink()
    except OSError as e:
        for tmp, _, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise KgenError(f"{rendered.name}: cannot write {e.filename or out_root}: {e.strerror or e}") from None
    return [rel for _, _, rel in staged] + removed


def stale_files(rendered: Rendered, out_root: Path) -> list[str]:
    """Files whose content on disk differs from what rendering gives now, and parts it no longer has."""
    out_root = Path(out_root)
    return ([rel for rel, content in rendered.files.items() if not (out_root / rel).exists() or (out_root / rel).read_text() != content]
            + obsolete_parts(rendered, out_root))
