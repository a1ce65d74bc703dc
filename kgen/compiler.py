"""``kgen.compile(model, *example_inputs)``: a live model -> its generated module, from kgen's cache.

The model is imported from the instance (``kgen.importer.import_instance``: traced as a copy on
the meta device, the input shapes and dtype from the example inputs, the batch the run-time
symbol), checked against the instance, rendered, built and loaded. Its spec and sources live in
``kgen_cache()/compiled/<name>-<key>/`` (spec.yaml, the shared headers and the module folder,
its builds under ``<module>/_build/`` as ``kgen build`` makes them), where ``key`` hashes the
spec's text with everything that decides what rendering makes of it (kgen's code and templates,
the target device, torch's version). A folder appears whole (rendered beside it, then renamed
into place), so a later call, in this process or another, that finds it only traces the model,
loads the module (the build is found by its content hash) and takes the weights: no check, no
rendering, no build. ``out="generated"`` renders into the project instead, as ``kgen import`` +
``kgen all`` would (``specs/NAME.yaml`` beside ``generated/``).

The module in the cache is named ``<name>_<key[:8]>``: its op ``kgen::<module>`` is registered once
per process, so two different models of one class can be compiled in one process.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import fx, nn

from .build import build_module, default_variant
from .cache import kgen_cache, mark_used
from .errors import KgenError
from .fields import IDENT, MAX_NAME
from .importer import ImportFailed, check_instance, default_name, import_instance, init_of, instance_source, spec_text
from .names import module_name_reason
from .spec import INTERMEDIATES, PRECISIONS

SPEC_FILE = "spec.yaml"
TRACED_DIR = "traced"  # <folder>/traced/<key>: the graphs (by _traced_key) compiled into the folder
KEYED_BUFFER_NUMEL = 4096  # buffers up to this size are keyed by their values too (_traced_key)


def _say(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"kgen: compile: {msg}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def _code_fingerprint() -> str:
    """What rendering depends on besides the spec: kgen's Python code and its templates (a few ms)."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for root in (package, (package / "templates").resolve()):  # kgen.render.TEMPLATES, without importing jinja2
        for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(text: str) -> str:
    """The cache key of a spec's text: with kgen's code, the target and torch's version."""
    from .target import current

    h = hashlib.sha256()
    for part in (text, _code_fingerprint(), repr(current()), torch.__version__):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def compile(model: nn.Module, *example_inputs: torch.Tensor, out: str | os.PathLike | None = None,
            name: str | None = None, precision: str | None = None, intermediates: str | None = None,
            verbose: bool = True) -> nn.Module:
    """``model`` as a kgen module: a drop-in ``nn.Module`` computing what ``model`` computes.

    ``example_inputs``: tensors of the shapes ``model`` is called with (the batch, their first
    dim, may change at run time; every other size is compiled in) and its dtype (float32,
    bfloat16 or float16). ``out``: a folder of the project to render into (``"generated"``:
    the spec goes to ``specs/NAME.yaml`` beside it, as with ``kgen import``), else kgen's cache.
    ``name``: the module's name (default: from the class's). ``precision``: the spec's
    ``precision`` (``ieee``, ``tf32``, ``tf32x3``; default: the spec's). ``intermediates``: the spec's
    ``intermediates`` (``eager``, the default: eager's bits where a later op would amplify a difference;
    ``float32``: kgen's own, faster where a chain of training-mode batch norms would run as eager's calls).
    ``verbose``: progress on stderr (a cache hit: one line).

    The returned module is the generated ``Model()`` holding the very same Parameter and buffer
    objects as ``model`` (no copies: training either one trains both, and batch norm's running
    statistics are shared), so its ``parameters()``, ``state_dict()`` keys and values are the
    original's, on its device and dtype, in its mode. Its parameters come in the order forward
    first uses them, which is the original's order where __init__ creates members in that order.
    ``.kgen_sources`` is the folder of its generated sources.

    An unsupported call is one ``ImportFailed`` naming it and its file:line.
    """
    module_dir = compile_module(model, *example_inputs, out=out, name=name, precision=precision,
                                intermediates=intermediates, verbose=verbose)
    return _drop_in(module_dir, model)


def compile_module(model: nn.Module, *example_inputs: torch.Tensor, out: str | os.PathLike | None = None,
                   name: str | None = None, precision: str | None = None, intermediates: str | None = None,
                   verbose: bool = True, build: bool = True) -> Path:
    """``compile`` up to the built module: its folder, rendered and built (or found in the cache), not
    yet loaded. ``build=False``: rendered only (the Dynamo backend, kgen.backend, renders every partition
    of a graph, then builds them together)."""
    start = time.monotonic()
    keys = {}  # the spec's top-level keys the caller sets
    for key, value, allowed in (("precision", precision, PRECISIONS), ("intermediates", intermediates, INTERMEDIATES)):
        if value is not None and value not in allowed:
            raise KgenError(f"kgen.compile: {key}={value!r}; expected one of {', '.join(allowed)}")
        if value is not None:
            keys[key] = value
    src = instance_source(model, example_inputs)
    base = name or default_name(src.stem)
    if not (IDENT.match(base) and len(base) <= MAX_NAME) or module_name_reason(base):
        raise ImportFailed(f"kgen.compile: name={base!r}: "
                           f"{module_name_reason(base) or 'expected [a-z][a-z0-9_]*, at most 64 characters'}")
    traced = _traced_key(model, example_inputs, base, keys) if out is None else None
    if traced is not None and (found := _found_traced(traced)) is not None:
        return _from_cache(*found, build, verbose, start)
    imp, data = import_instance(src, base)
    if keys:
        data = {**{k: v for k, v in data.items() if k != "ops"}, **keys, "ops": data["ops"]}
    shown = (f"{src.shown}: traced for inputs {', '.join(str(list(t.shape)) for t in example_inputs)} "
              f"{str(example_inputs[0].dtype).removeprefix('torch.')} ({time.monotonic() - start:.1f} s)")
    if out is not None:
        _say(verbose, f"{shown}; rendering into {out}")
        module_dir = _render_into_project(Path(out), imp, data, verbose, start)
    else:
        # the description names the file as seen from here: the key leaves it out
        key = cache_key(spec_text({k: v for k, v in data.items() if k != "description"}))
        module_name = _module_name(base, key)
        folder = kgen_cache() / "compiled" / f"{base}-{key}"
        module_dir = folder / module_name
        if _whole(folder, module_name):
            _remember_traced(folder, traced)
            return _from_cache(folder, module_name, build, verbose, start)
        _say(verbose, f"{shown}; compiling it into {folder}")
        _render_into_cache(folder, module_name, imp, {**data, "name": module_name}, verbose, start)
        _remember_traced(folder, traced)
    if not build:
        return module_dir
    result = build_module(module_dir, quiet=not verbose)
    if verbose and not result.built:
        _say(verbose, f"{module_dir.name}: its build was there already ({result.library.parent})")
    _say(verbose, f"{module_dir.name} ready in {time.monotonic() - start:.1f} s; sources in {module_dir}")
    return module_dir


def _module_name(base: str, key: str) -> str:
    return f"{base[:MAX_NAME - 9].rstrip('_')}_{key[:8]}"


def _from_cache(folder: Path, module_name: str, build: bool, verbose: bool, start: float) -> Path:
    """The module of a compiled folder the cache holds, built (found by its content hash, built again if gone)."""
    mark_used(folder)  # (`kgen cache --older-than` removes the folders no compile found for a while)
    module_dir = folder / module_name
    if not build:
        return module_dir
    built = build_module(module_dir, quiet=True)
    _say(verbose, f"{module_name}: {'built' if built.built else 'loaded'} from the cache {folder} "
                  f"in {time.monotonic() - start:.2f} s")
    return module_dir


def _traced_key(model: nn.Module, example_inputs, base: str, keys: dict) -> str | None:
    """For a torch.fx GraphModule (the Dynamo backend's partitions), a key of all the importer reads from it: its
    code, its submodules' settings and mode, its tensors' names, shapes, dtypes and how they were made (the spec's
    `init`), the inputs', the spec keys set, and what the spec key hashes besides the spec (kgen's code, the
    target, torch's version). A later compile of an equal graph finds its folder by it without tracing the graph
    again (the importer's trace and shape evaluation: ResNet-18's 69 calls in 0.4 s). None for other models: their
    forward is Python code that may read anything."""
    if not isinstance(model, fx.GraphModule):
        return None
    parts = [model.code, base, repr(sorted(keys.items())), cache_key("")]
    parts += [f"{name} {type(m).__qualname__}({m.extra_repr()}) {m.training}" for name, m in model.named_modules()]
    parts += [f"{name} {list(t.shape)} {t.dtype} {t.requires_grad} {init_of(t)}" for name, t in model.named_parameters()]
    # a buffer's values where it is small: the importer takes a constant's (fx's _tensor_constant0, a 0-d buffer) into
    # the spec (a running statistic's values are the call's, and only make the key more particular)
    parts += [f"{name} {list(t.shape)} {t.dtype} " + (_digest(t) if t.numel() <= KEYED_BUFFER_NUMEL and not t.is_meta else "")
              for name, t in model.named_buffers()]
    parts += [f"{list(t.shape)} {t.dtype} {t.device.type}" for t in example_inputs]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _digest(t: torch.Tensor) -> str:
    # bytes through a list, not Tensor.numpy(): torch runs without NumPy installed (t is at most KEYED_BUFFER_NUMEL)
    data = bytes(t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).tolist())
    return hashlib.sha256(data).hexdigest()[:16]


def _whole(folder: Path, module_name: str) -> bool:
    """Whether a compiled folder is all there (it is renamed into place whole; `kgen cache` may remove it)."""
    return (folder / SPEC_FILE).is_file() and (folder / module_name / "__init__.py").is_file()


def _found_traced(traced: str) -> tuple[Path, str] | None:
    """The compiled folder that a graph of key ``traced`` was compiled into (``<folder>/traced/<key>``, written
    when it was) and its module's name, if the folder is whole."""
    for mark in (kgen_cache() / "compiled").glob(f"*/{TRACED_DIR}/{traced}"):
        folder = mark.parent.parent
        base, _, key = folder.name.rpartition("-")
        module_name = _module_name(base, key)
        if not folder.name.startswith("tmp-") and _whole(folder, module_name):
            return folder, module_name
    return None


def _remember_traced(folder: Path, traced: str | None) -> None:
    """Mark ``folder`` as the one a graph of key ``traced`` compiles into (a cache on a read-only disk: not)."""
    if traced is None:
        return
    try:
        (folder / TRACED_DIR).mkdir(exist_ok=True)
        (folder / TRACED_DIR / traced).touch()
    except OSError:
        pass


def tune_module(module_dir: Path, batches: list[int], verbose: bool = True) -> bool:
    """`kgen tune` of a module in the cache (on a CUDA GPU): its candidates are rendered and built under
    ``<folder>/_tune/`` (removed after), the tuning file is written beside the spec (``spec.tune.json``,
    kept: the folder's key is the spec's, so later compiles find the tuned module), and the module is
    rendered again from it and built. A spec with a tuned entry for this device already is left as it is.
    Returns whether it tuned."""
    from . import target as targets, tunefile
    from .ir import load_pipeline
    from .tune import run_tune

    folder = module_dir.parent
    spec = folder / SPEC_FILE
    stored, _ = tunefile.spec_entry(load_pipeline(spec), targets.current())
    if tunefile.tuned(stored):
        _say(verbose, f"{module_dir.name}: tuned already ({tunefile.path_for(spec)})")
        return False
    start = time.monotonic()
    root = folder / "_tune"
    try:
        run_tune([spec], sorted(set(batches)), root=root)
        _plan_and_render(folder, folder.name, module_dir, verbose)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    build_module(module_dir, quiet=not verbose)
    _say(verbose, f"{module_dir.name}: tuned in {time.monotonic() - start:.1f} s ({tunefile.path_for(spec)})")
    return True


def _measure_precision(spec: Path, verbose: bool) -> None:
    """On the CUDA GPU the module is rendered for, eager's float32 cuDNN precision of the spec's convolutions
    (`kgen tune --precision-only`, in its tuning file beside it): a second at most, and the plan then rounds as
    eager's calls do there (untuned, a GPU whose rules kgen has not measured gets fp32-level products for small
    convolutions: slower, and further from eager's TF32 results)."""
    from . import target as targets

    if not torch.cuda.is_available() or targets.current().name != torch.cuda.get_device_name():
        return
    from .tune import run_precision

    run_precision([spec], log=lambda msg: _say(verbose, msg))


def _checked(imp, text: str, path: Path, verbose: bool, start: float):
    pipe = check_instance(text, str(path), imp)
    _say(verbose, f"imported {len(pipe.ops)} ops; the spec computes what the model computes "
                  f"({time.monotonic() - start:.1f} s)")
    return pipe


def _plan_and_render(into: Path, shown_folder: str, module_dir: Path, verbose: bool) -> None:
    """Plan the spec in ``into`` (tuning file beside it, else the cost model) and render the module there;
    ``shown_folder``: the cache folder's name, as the module names its spec."""
    from .ir import load_pipeline
    from .plan import choose_plans
    from .render import render_plan, write_rendered

    sel = choose_plans(load_pipeline(into / SPEC_FILE))
    _say_plan(verbose, sel, module_dir)
    # the spec as the module names it: relative to the module folder's grandparent (kgen explain, validate)
    write_rendered(render_plan(sel, into, spec_shown=f"{shown_folder}/{SPEC_FILE}"), into)


def _render_into_cache(folder: Path, module_name: str, imp, data: dict, verbose: bool, start: float) -> None:
    """Check, plan and render into a folder beside ``folder``, then rename it into place (a folder that
    is there is whole); a process that renamed its own first wins, and this one's is removed."""
    text = spec_text(data)
    tmp = folder.parent / f"tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        (tmp / SPEC_FILE).write_text(text)
    except OSError as e:
        raise KgenError(f"kgen.compile: cannot write {e.filename or tmp}: {e.strerror or e}") from None
    try:
        _checked(imp, text, tmp / SPEC_FILE, verbose, start)
        _measure_precision(tmp / SPEC_FILE, verbose)
        _plan_and_render(tmp, folder.name, folder / module_name, verbose)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / SPEC_FILE).is_file():
                raise
    except OSError as e:
        raise KgenError(f"kgen.compile: cannot write {e.filename or folder}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _render_into_project(out: Path, imp, data: dict, verbose: bool, start: float) -> Path:
    """``kgen import`` + ``kgen render`` of the instance: specs/NAME.yaml beside ``out``, ``out/NAME``."""
    from .render import render_spec, write_rendered

    spec_path = out.resolve().parent / "specs" / f"{data['name']}.yaml"
    text = f"# Written by kgen.compile from {imp.src.shown}; compile the model again to change it.\n" + spec_text(data)
    _checked(imp, text, spec_path, verbose, start)
    try:
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = spec_path.with_name(f".{spec_path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, spec_path)
    except OSError as e:
        raise KgenError(f"kgen.compile: cannot write {e.filename or spec_path}: {e.strerror or e}") from None
    _measure_precision(spec_path, verbose)
    rendered = render_spec(spec_path, out)
    written = write_rendered(rendered, out)
    _say(verbose, f"wrote {spec_path} and {out / rendered.name} ({len(written)} files changed)")
    return out / rendered.name


def _say_plan(verbose: bool, sel, module_dir: Path) -> None:
    for i, v in enumerate(sel.variants):
        stages = ", ".join(f"{st.family.name}" for st in v.plan.stages)
        runs = f" ({v.runs})" if len(sel.variants) > 1 else ""
        _say(verbose, f"rendering {module_dir.name}{runs}: {len(v.plan.stages)} stages: {stages}")


def _drop_in(module_dir: Path, model: nn.Module) -> nn.Module:
    """The generated Model() holding ``model``'s own parameters and buffers, in its mode."""
    from .validate import import_module_dir

    tensors = [*model.parameters(), *model.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cuda" and default_variant() != "cuda":
        raise KgenError(f"kgen.compile: the model is on {device}, but kgen builds for the CPU here (no nvcc, "
                        "or KGEN_DEVICE=cpu)")
    mod = import_module_dir(module_dir)
    with torch.device("meta"):  # its members without memory: the model's own take their places
        compiled = mod.Model()
    grads = {id(p): p.requires_grad for p in model.parameters()}
    try:
        compiled.load_state_dict(model.state_dict(keep_vars=True), strict=True, assign=True)
    except RuntimeError as e:
        raise KgenError(f"kgen.compile: {module_dir.name} does not take the model's state_dict: {e}") from None
    finally:
        for p in model.parameters():  # assign=True sets requires_grad to the new member's
            p.requires_grad_(grads[id(p)])
    left = [n for n, t in [*compiled.named_parameters(), *compiled.named_buffers()] if t.is_meta]
    if left:
        raise KgenError(f"kgen.compile: {module_dir.name}: the model's state_dict has no {', '.join(left)}")
    compiled.train(model.training)
    compiled.kgen_sources = module_dir
    return compiled
