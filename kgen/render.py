"""Render a plan through the Jinja2 templates into a module directory.

``generated/NAME/`` gets ``stages.h`` (the math of each fused stage, shared by
both backends), ``kernel.cu`` (CUDA schedules), ``kernel_cpu.cpp`` (C++
schedules), ``binding.cpp`` (the torch op), ``__init__.py`` and ``plan.json``;
``generated/`` itself gets the shared headers and the package ``__init__.py``,
so the output root is an importable package wherever it lies.

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
from .ir import dropout_refusal, load_pipeline
from .plan import Plan, make_plan
from .spec import NO_DEFAULT, spec_to_data

# The templates ship inside the package: kgen/templates links to the
# repository's templates/ folder, and wheels carry copies (pyproject.toml).
TEMPLATES = Path(str(importlib.resources.files("kgen") / "templates"))
SHARED_FILES = ("kgen_math.h", "kgen_runtime.h")  # copied verbatim into the output root
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
    env.globals.update(cexpr.FUNCTIONS, TEMPLATE_MARK=TEMPLATE_MARK, prod=math.prod, dropout_refusal=dropout_refusal,
                       fail=_fail, NO_DEFAULT=NO_DEFAULT, constructor_call=constructor_call)
    return env


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


def render_plan(plan: Plan, out_root: Path, spec_shown: str | None = None) -> Rendered:
    env = _environment()
    name = plan.name
    spec_shown = spec_shown or spec_display_path(plan.pipeline.path, out_root)
    tensors = {a.name: a for a in plan.pipeline.tensor_args() + plan.pipeline.buffer_args()}
    def pieces(piece: str) -> list:
        """(stage, template) of each stage whose family renders ``piece``, in stage order."""
        return [(st, st.family.template(piece)) for st in plan.stages if piece in st.family.pieces]

    ctx = dict(
        plan=plan,
        name=name,
        pipe=plan.pipeline,
        stages=plan.stages,
        kernels=plan.kernel_stages(),
        pieces=pieces,
        spec_path=spec_shown,
        plan_summary=plan_summary(plan),
        ident=lambda n: tensors[n].ident,
        ew=lambda op, act, coords: cexpr.elementwise(op, act, coords, tensors, plan.pipeline.values),
        summed=lambda ops: cexpr.summed_params(ops, tensors),
        spec_data=spec_data_literal(plan),
        op_args_cpp=lambda: ", ".join(a[0] for a in op_arguments(plan.pipeline)),
        op_schema_args=lambda: ", ".join(a[1] for a in op_arguments(plan.pipeline)),
        op_args_py=[a[2] for a in op_arguments(plan.pipeline)],
    )
    files = {}
    for out, tpl in MODULE_FILES.items():
        try:
            files[f"{name}/{out}"] = env.get_template(tpl).render(**ctx, template_name=f"templates/{tpl}")
        except jinja2.TemplateError as e:  # a template bug, not a user error: say where
            where = getattr(e, "filename", None) or tpl
            raise KgenError(f"rendering templates/{tpl} for {name} failed in {where}: {type(e).__name__}: {e}") from None
    data = plan.to_json()
    data["spec"] = spec_shown
    files[f"{name}/plan.json"] = json.dumps(data, indent=1) + "\n"
    for f in SHARED_FILES:
        files[f] = (TEMPLATES / f).read_text()
    files["__init__.py"] = env.get_template("package_init.py.j2").render()
    return Rendered(name, files)


def constructor_call(args) -> list[str]:
    """The positional arguments (reprs) that rebuild the reference model: every argument up to
    the last one without a default or with a value other than its default."""
    n = max((i + 1 for i, a in enumerate(args) if a.default is NO_DEFAULT or a.value != a.default), default=0)
    return [repr(a.value) for a in args[:n]]


def op_arguments(pipe) -> list[tuple[str, str, str]]:
    """(C++ parameter, schema argument, Python name) of each argument of the op kgen::NAME:
    the inputs (the first is x), parameters, running statistics, then the mode
    (pipelines with batch norm or dropout) and the running statistics' update weights."""
    args = [(f"const at::Tensor& {n}", f"Tensor {n}", n) for n in ["x"] + pipe.input_names[1:]]
    args += [(f"const at::Tensor& {t.ident}", f"Tensor {t.ident}", t.ident) for t in pipe.tensor_args() + pipe.buffer_args()]
    if pipe.training_dependent:
        args.append(("bool training", "bool training", "training"))
    if pipe.buffer_args():
        args.append(("at::ArrayRef<double> factors", "float[] factors", "factors"))
    return args


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
