"""Render a plan through the Jinja2 templates into a module directory.

``generated/NAME/`` gets ``stages.h`` (the math of each fused stage, shared by
both backends), ``kernel.cu`` (CUDA schedules), ``kernel_cpu.cpp`` (C++
schedules), ``binding.cpp`` (the torch op), ``__init__.py`` and ``plan.json``;
``generated/`` itself gets the shared headers and the package ``__init__.py``.

Rendering is pure: every file is rendered in memory first and written only if
all of them rendered, each through a temporary file and an atomic rename.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2

from .errors import KgenError
from .ir import Elementwise, Pipeline, TensorType, load_pipeline
from .plan import CUDA_THREADS, Buffer, Plan, make_plan
from .spec import spec_to_data

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
SHARED_FILES = ("kgen_math.h", "kgen_runtime.h")  # copied verbatim into generated/
MODULE_FILES = {  # output file -> template
    "stages.h": "stages.h.j2",
    "kernel.cu": "kernel.cu.j2",
    "kernel_cpu.cpp": "kernel_cpu.cpp.j2",
    "binding.cpp": "binding.cpp.j2",
    "__init__.py": "module.py.j2",
}
# Marks where each template's output starts in a generated file, so a compiler
# error can be traced back to its template (kgen.build reads these).
TEMPLATE_MARK = "kgen-template:"


# ------------------------------------------------------------ C expression helpers


def cfloat(x: float) -> str:
    """A float32 C literal that reads back as the same value."""
    x = float(x)
    if math.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    text = repr(x)
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def dim_names(rank: int) -> list[str]:
    """Coordinate names of a sample's dims (C, *S)."""
    return ["c"] + [f"d{i}" for i in range(rank - 1)]


def unravel(var: str, dims: list[tuple[str, int]], tmp: str, ty: str = "Index") -> str:
    """C statements that split the row-major index ``var`` into ``dims`` (outermost first)."""
    if not dims:
        return f"(void)({var});"
    lines = [f"{ty} {tmp} = {var};"]
    for i, (name, size) in enumerate(reversed(dims)):
        if size == 1:
            lines.append(f"const int {name} = 0;")
        elif i == len(dims) - 1:
            lines.append(f"const int {name} = static_cast<int>({tmp});")
        else:
            lines.append(f"const int {name} = static_cast<int>({tmp} % {size}); {tmp} /= {size};")
    return "\n".join(lines)


class Codegen:
    """What the templates need besides the plan: names and C expressions."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.pipe: Pipeline = plan.pipeline
        self.idents = {a.name: a.ident for a in self.pipe.tensor_args()}

    def ident(self, name: str) -> str:
        return self.idents[name]

    def param_shape(self, name: str) -> tuple[int, ...]:
        if name in self.pipe.params:
            return self.pipe.params[name].shape
        return next(a.shape for a in self.pipe.tensor_args() if a.name == name)

    def ew(self, op: Elementwise, act: TensorType, coords: list[str]) -> str:
        """C statement applying ``op`` to the float ``v``; ``coords`` index act's dims 1.."""
        if op.fn == "relu":
            return "v = kgen::relu(v);"
        if op.fn == "sigmoid":
            return "v = kgen::sigmoid(v);"
        if op.fn == "clamp":
            lo = cfloat(op.lo) if op.lo is not None else "-INFINITY"
            hi = cfloat(op.hi) if op.hi is not None else "INFINITY"
            return f"v = kgen::clamp(v, {lo}, {hi});"
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[op.fn]
        if op.param is None:
            return f"v = v {sym} {cfloat(op.scalar)};"
        p = f"a.{self.ident(op.param)}"
        if op.param_sum_dims:  # reduction algebra: the parameter summed (it varies only there)
            scale = f" * {cfloat(op.param_sum_scale)}" if op.param_sum_scale != 1 else ""
            return f"v = v {sym} sum_of_{self.ident(op.param)}(a){scale};"
        shape = op.param_view or self.param_shape(op.param)
        return f"v = v {sym} {p}[{self.param_index(shape, act, coords)}];"

    @staticmethod
    def param_index(shape: tuple[int, ...], act: TensorType, coords: list[str]) -> str:
        """Flat index of a parameter of ``shape``, broadcast to ``act``, at ``coords``."""
        aligned = (1,) * (act.rank - len(shape)) + tuple(shape)
        terms, stride = [], 1
        for d in range(act.rank - 1, 0, -1):
            if aligned[d] != 1:
                terms.append(coords[d - 1] if stride == 1 else f"{coords[d - 1]} * {stride}")
            stride *= aligned[d]
        return " + ".join(reversed(terms)) or "0"

    def summed_params(self, ops) -> list[tuple[str, int]]:
        """(ident, numel) of parameters that enter summed (reduction algebra)."""
        out = []
        for op in ops:
            if isinstance(op, Elementwise) and op.param_sum_dims:
                item = (self.ident(op.param), math.prod(self.param_shape(op.param)))
                if item not in out:
                    out.append(item)
        return out

    @staticmethod
    def tile_address(buf: Buffer, t: int, coords: list[str]) -> str:
        """Element offset of logical ``coords`` in tile ``t`` (phased: coords are phase-local m)."""
        tile = buf.tiles[t]
        terms = [f"n * {tile.sample_stride}LL"]
        for d, (name, stride) in enumerate(zip(coords, tile.strides)):
            off = tile.offset[d - 1] if d > 0 else 0
            pos = f"({name} + {off})" if off else name
            if tile.dims[d] > 1:
                terms.append(pos if stride == 1 else f"{pos} * {stride}")
        return " + ".join(terms)

    @staticmethod
    def pool_bounds_check(level, d: int) -> bool:
        """Whether a window of ``level``'s pool can leave the input along spatial dim ``d``."""
        pool = level.pool
        L = level.in_type.spatial[d]
        O = level.out_type.spatial[d]
        last = (O - 1) * pool.stride[d] - pool.padding[d] + (pool.kernel[d] - 1) * pool.dilation[d]
        return pool.padding[d] > 0 or last >= L

    @staticmethod
    def index_type(stage) -> str:
        """int when every per-sample index of the stage fits in 32 bits (cheaper divisions), else long long."""
        sizes = [math.prod(t.dims) for t in stage.input.tiles] + [stage.in_type.sample_numel, stage.out_type.sample_numel]
        return "int" if max(sizes) < 2**31 - 1 else "long long"

    def stage_params(self, stage) -> list:
        return self.plan.stage_args(stage)

    # -- small pieces of C++
    @staticmethod
    def decl(names: list[str]) -> str:
        return ", ".join(f"int {n}" for n in names)

    @staticmethod
    def phase_coords(names: list[str]) -> list[str]:
        return [names[0]] + [f"m{i}" for i in range(len(names) - 1)]

    @staticmethod
    def phase_index(buf: Buffer) -> str:
        expr = "r0"
        for d in range(1, len(buf.phase_stride)):
            expr = f"({expr}) * {buf.phase_stride[d]} + r{d}" if d > 1 else f"r0 * {buf.phase_stride[d]} + r{d}"
        return expr

    @staticmethod
    def named_dims(dims, t: TensorType) -> list[tuple[str, int]]:
        """(coordinate name, size) of dims (indices into t's shape, 1 = channels)."""
        names = dim_names(t.rank - 1)
        return [(names[d - 1], t.shape[d]) for d in dims]

    @staticmethod
    def reduced_coords(reduce, t: TensorType, names: list[str]) -> list[str]:
        """Coordinates of the reduction's output dims, in terms of the kept input dims."""
        out = []
        for d in range(1, t.rank):
            if reduce is not None and d in reduce.dims:
                if d in reduce.kept:
                    out.append("0")
            else:
                out.append(names[d - 1])
        return out

    @staticmethod
    def window_pos(pool, d: int, name: str) -> str:
        expr = f"{name} * {pool.stride[d]}" if pool.stride[d] != 1 else name
        if pool.padding[d]:
            expr += f" - {pool.padding[d]}"
        tap = f"k{d} * {pool.dilation[d]}" if pool.dilation[d] != 1 else f"k{d}"
        return f"{expr} + {tap}"

    def pool_body(self, lv, li: int, names: list[str]) -> str:
        """The window loops of a pool level: acc over the window, then v."""
        p, rank = lv.pool, lv.pool.rank
        is_max = p.kind == "max"
        lines = [f"  float acc = {'-INFINITY' if is_max else '0.f'};"]
        ind = "  "
        unroll = math.prod(p.kernel) <= 512
        for d in range(rank):
            if unroll:
                lines.append(f"{ind}KGEN_UNROLL")
            lines.append(f"{ind}for (int k{d} = 0; k{d} < {p.kernel[d]}; ++k{d}) {{")
            ind += "  "
            lines.append(f"{ind}const int j{d} = {self.window_pos(p, d, names[d + 1])};")
            if self.pool_bounds_check(lv, d):
                lines.append(f"{ind}if (j{d} < 0 || j{d} >= {lv.in_type.spatial[d]}) continue;")
        call = f"level{li - 1}(a, n, c, {', '.join(f'j{d}' for d in range(rank))})"
        lines.append(f"{ind}{'acc = kgen::max_nan(acc, ' + call + ')' if is_max else 'acc += ' + call};")
        for d in range(rank - 1, -1, -1):
            ind = ind[:-2]
            lines.append(f"{ind}}}")
        if is_max:
            lines.append("  float v = acc;")
        elif not any(p.padding) and not p.ceil_mode:
            lines.append(f"  float v = acc / {cfloat(math.prod(p.kernel))};")
        else:  # PyTorch's divisor: the window clipped to the padded input, or to the input
            lines.append("  int pool_size = 1, count = 1;")
            for d in range(rank):
                L, P = lv.in_type.spatial[d], p.padding[d]
                lines.append(
                    f"  {{ const int s = {names[d + 1]} * {p.stride[d]} - {P}; const int e = s + {p.kernel[d]} < {L + P} ? s + {p.kernel[d]} : {L + P};"
                    f" pool_size *= e - s; count *= (e < {L} ? e : {L}) - (s > 0 ? s : 0); }}"
                )
            lines.append(f"  float v = acc / static_cast<float>({'pool_size' if p.count_include_pad else 'count'});")
        return "\n".join(lines)

    @staticmethod
    def linear_reduction(stage) -> bool:
        """No pools, every dim reduced, one dense unpadded tile: element r of a sample lies at r."""
        buf = stage.input
        tile = buf.tiles[0]
        return (
            len(stage.levels) == 1
            and not stage.kept_dims
            and not buf.phased
            and tile.dims == buf.logical
            and not any(tile.offset)
            and [d - 1 for d in stage.reduce_order] == tile.memory_order
        )

    @staticmethod
    def unroll(stage) -> int:
        """Values of the reduction each thread loads before combining them: about
        16 loads in flight per thread (a window pool already issues its own)."""
        loads = math.prod(math.prod(lv.pool.kernel) for lv in stage.levels if lv.pool)
        return max(1, min(8, 16 // loads))

    @staticmethod
    def cpu_chunk(n: int) -> int:
        return max(1, math.isqrt(n))

    @staticmethod
    def cpu_grain(stage) -> int:
        """Outputs per ATen task: about 4096 values of work each."""
        if stage.kind == "norm":
            work = stage.norm.num_channels
        else:
            work = stage.reduced_count * math.prod(math.prod(lv.pool.kernel) for lv in stage.levels if lv.pool)
        return max(1, 4096 // max(1, work))

    @staticmethod
    def shape_expr(t: TensorType) -> str:
        return "{" + ", ".join(["batch"] + [str(d) for d in t.shape[1:]]) + "}"

    def input_dims(self) -> str:
        dims = ["kgen::kAnySize" if isinstance(d, str) else str(d) for d in self.pipe.input.shape]
        return "{" + ", ".join(dims) + "}"

    def precision_enum(self) -> str:
        return {"ieee": "kIeee", "tf32": "kTf32", "tf32x3": "kTf32x3"}[self.pipe.precision]

    def stage_input(self, stage) -> str:
        """C++ expression of what ``stage`` reads: a tensor (conv) or a tensor list (fused)."""
        if stage.index == 0:
            return "x" if stage.kind == "conv" else "{x.contiguous()}"
        prev = self.plan.stages[stage.index - 1]
        tensor = f"t{prev.index}"
        if stage.kind == "conv" or (prev.kind == "conv" and prev.output.phased):
            return tensor
        return "{" + tensor + "}"

    @staticmethod
    def memory_format(stage) -> str:
        if stage.layout == "channels_last":
            return "at::MemoryFormat::ChannelsLast" if stage.conv.rank == 2 else "at::MemoryFormat::ChannelsLast3d"
        return "at::MemoryFormat::Contiguous"

    @staticmethod
    def spatial_dims(conv) -> str:
        return "{" + ", ".join(str(2 + d) for d in range(conv.rank)) + "}"

    def bias_arg(self, conv) -> str:
        """The bias the ATen convolution adds: none when the next stage adds it."""
        if conv.bias and not conv.bias_deferred:
            return f"std::optional<at::Tensor>({self.ident(conv.bias_name)})"
        return "std::nullopt"

    @staticmethod
    def ones(conv) -> str:
        return "{" + ", ".join(["1"] * conv.rank) + "}"

    @staticmethod
    def zeros(conv) -> str:
        return "{" + ", ".join(["0"] * conv.rank) + "}"

    # -- Python
    @staticmethod
    def py_shape(t: TensorType) -> str:
        return "(" + ", ".join(repr(d) for d in t.shape) + ("," if t.rank == 1 else "") + ")"

    def py_out_shape(self) -> str:
        dims = ["x.shape[0]"] + [str(d) for d in self.pipe.output.shape[1:]]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"

    def model_init_lines(self) -> list[str]:
        from .ir import Conv

        lines = []
        rank = len(self.pipe.input.spatial)
        for kind, item in self.pipe.creation_order():
            if kind == "param":
                lines.append(f"self.{item.name} = torch.nn.Parameter(torch.{item.init}({', '.join(map(str, item.shape))}))")
                continue
            cls, kw = item.module_ctor() if isinstance(item, Conv) else item.module_ctor(rank)
            args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
            lines.append(f"self.{item.module} = torch.nn.{cls}({args})")
        return lines


# ------------------------------------------------------------ rendering


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["cfloat"] = cfloat
    env.globals.update(dim_names=dim_names, unravel=unravel, TEMPLATE_MARK=TEMPLATE_MARK, prod=math.prod)
    return env


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


def render_plan(plan: Plan, out_root: Path, spec_shown: str | None = None) -> Rendered:
    env = _environment()
    name = plan.name
    spec_shown = spec_shown or spec_display_path(plan.pipeline.path, out_root)
    ctx = dict(
        plan=plan,
        name=name,
        pipe=plan.pipeline,
        original=plan.original,
        stages=plan.stages,
        fused=plan.fused_stages(),
        cg=Codegen(plan),
        spec_path=spec_shown,
        plan_summary=plan_summary(plan),
        cuda_threads=CUDA_THREADS,
        spec_data=spec_data_literal(plan),
    )
    files = {}
    for out, tpl in MODULE_FILES.items():
        try:
            files[f"{name}/{out}"] = env.get_template(tpl).render(**ctx, template_name=f"templates/{tpl}")
        except jinja2.TemplateError as e:  # a template bug, not a user error: say where
            raise KgenError(f"rendering templates/{tpl} for {name} failed: {type(e).__name__}: {e}") from None
    data = plan.to_json()
    data["spec"] = spec_shown
    files[f"{name}/plan.json"] = json.dumps(data, indent=1) + "\n"
    for f in SHARED_FILES:
        files[f] = (TEMPLATES / f).read_text()
    files["__init__.py"] = env.get_template("package_init.py.j2").render()
    return Rendered(name, files)


def spec_data_literal(plan: Plan) -> str:
    """The module's spec as a Python literal (``spec_to_data``: checked identifiers and numbers only)."""
    spec = plan.original.spec
    if spec is None:
        raise KgenError(f"{plan.name}: the plan's pipeline was not built from a spec")
    data = spec_to_data(spec)  # with the spec's own name: a variant (NAME_norewrite) is the same spec
    lines = ["{"]
    for key, value in data.items():
        if key == "ops":  # one op a line
            lines += [f"    {key!r}: ["] + [f"        {op!r}," for op in value] + ["    ],"]
        else:
            lines.append(f"    {key!r}: {value!r},")
    return "\n".join(lines + ["}"])


def plan_summary(plan: Plan) -> str:
    """One line per stage, for the headers of generated files."""
    return "\n".join(f"stage {s.index} ({s.kind}): " + " -> ".join(o.describe() for o in s.ops) for s in plan.stages)


def render_spec(spec_path, out_root: Path, rewrites: dict | None = None, name: str | None = None) -> Rendered:
    """Load, plan and render one spec (``name`` renames the module, for variants)."""
    pipe = load_pipeline(spec_path)
    if name is not None:
        pipe = replace(pipe, name=name)
    plan = make_plan(pipe, rewrites)
    return render_plan(plan, Path(out_root))


def _same_text(path: Path, content: str) -> bool:
    try:
        return path.is_file() and path.read_text() == content
    except UnicodeDecodeError:  # not what kgen wrote: replace it
        return False


def write_rendered(rendered: Rendered, out_root: Path) -> list[str]:
    """Write the files that changed; returns their paths (relative to out_root).

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
    except OSError as e:
        for tmp, _, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise KgenError(f"{rendered.name}: cannot write {e.filename or out_root}: {e.strerror or e}") from None
    return [rel for _, _, rel in staged]


def stale_files(rendered: Rendered, out_root: Path) -> list[str]:
    """Files whose content on disk differs from what rendering gives now."""
    out_root = Path(out_root)
    return [rel for rel, content in rendered.files.items() if not (out_root / rel).exists() or (out_root / rel).read_text() != content]
