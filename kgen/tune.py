"""`kgen tune`: measure a spec's candidate plans on the GPU and record the fastest per batch.

For each spec and each of its dtypes (``--dtype``: those), at its example batch and the batches asked for:

1. the candidate plans (``kgen.plan.tuned_candidates``: every combination of the
   size-dependent rewrites, each stage's candidates, and the eager pipeline; where a
   batch norm uses running statistics, eval mode's own, each rendered beside the
   cost model's plan for training mode), ranked by the cost model; all of them are measured, or the model's best
   ``max_candidates - 1`` and the eager candidate when there are more;
2. each is rendered as a module of its own under ``generated/_tune/`` (its
   schedules made for the example batch, as `kgen render` makes every plan of
   a module), and all are built at once;
3. each is timed like `kgen bench` times a module (CUDA events, warm-up, the
   median of ``reps`` runs; all candidates and eager PyTorch in turns, in blocks
   of consecutive calls), after a check that it computes what eager PyTorch does (a candidate
   that does not is reported and never chosen);
4. the fastest at each batch wins; batch ranges follow from them
   (``kgen.tunefile.ranges_from``) and the entry for this device is written to
   ``specs/NAME.tune.json``, which `kgen render` reads (one entry per device and dtype:
   ``kgen.tunefile``).

In a 16-bit dtype the candidates are that dtype's plans, the inputs and every model (the
candidates' and eager PyTorch's) are converted to it as `kgen bench` converts them, and each
candidate's check is against eager PyTorch in that dtype.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import cost, target as targets, tunefile
from .bench import _commit, _utc_now, time_in_blocks
from .build import build_modules
from .errors import KgenError
from .ir import Conv, Pipeline, load_pipeline
from .plan import Plan, Selection, Variant, describe_choices, training_plan, tuned_candidates
from .reference import ReferenceModel
from .render import render_plan, rename, write_rendered

TUNE_ROOT = Path("generated") / "_tune"  # candidate modules (not committed)
MAX_CANDIDATES = 8  # plans measured per spec and batch at most (the eager one among them)
CHECK_TOLERANCE = 2e-2  # relative L2 error against eager PyTorch in float32 (TF32 convolutions round)


@dataclass
class Measured:
    plan: Plan  # made at the example batch, as render makes it (its choices name it)
    module: Path = None  # where it is rendered
    model_ms: dict = field(default_factory=dict)  # batch -> the cost model's estimate
    ms: dict = field(default_factory=dict)  # batch -> measured median (inf: it failed its check)
    problem: str = ""


@dataclass
class SpecTuning:
    spec: Path
    pipe: Pipeline  # in the dtype tuned (Pipeline.dtype)
    batches: list[int]
    candidates: list[Plan]  # all of them (for the hash)
    measured: list[Measured]
    eager_pytorch_ms: dict = field(default_factory=dict)  # batch -> the reference model in the dtype


def _log(msg: str) -> None:
    print(f"kgen: {msg}", flush=True)


def _module_name(pipe: Pipeline, plan: Plan) -> str:
    """A candidate module's name: the spec's and a digest of what is rendered (choices and
    stage fields): the same candidate tuned again reuses its build."""
    stages = [{k: v for k, v in s.items() if k != "choice"} for s in plan.to_json()["stages"]]
    what = {"c": plan.choices, "s": stages} | ({"d": pipe.dtype} if pipe.dtype != "float32" else {})
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
    return f"{pipe.name}__t{digest.hexdigest()[:10]}"


# Relative L2 difference from the fp32 call above which eager's convolution counts as TF32: an fp32 cuDNN call reaches
# ~1e-7 (3.6e-8 for maxpool_sum's transposed convolution on an H200), TF32 products ~1e-4 (operands rounded to
# 10 bits); 1e-5 lies a decade from each.
TF32_ERROR_FLOOR = 1e-5


def measure_eager_conv_tf32(pipe: Pipeline, batch: int) -> tuple[tuple[str, bool], ...]:
    """Per convolution module of ``pipe`` as written, whether eager's cuDNN call for it runs TF32 on this GPU
    at ``batch`` with PyTorch's settings: the call on random normal data with TF32 allowed, against the same
    call with TF32 off (fp32 kernels, ~1e-7 from float64, and as fast as cuDNN's fp32 kernels where a float64
    convolution of a large layer takes minutes); a relative L2 difference above TF32_ERROR_FLOOR means TF32
    products (cuDNN picks fp32 kernels for many convolutions even where TF32 is allowed, depending on the sizes,
    the batch, the GPU and the cuDNN version; equal bits would tell nothing: another fp32 kernel sums in
    another order). Empty without a GPU or where PyTorch does not allow cuDNN TF32."""
    if not torch.cuda.is_available() or not torch.backends.cudnn.allow_tf32:
        return ()
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for i, op in enumerate(pipe.ops):
            if not isinstance(op, Conv) or op.module in out:
                continue
            x = torch.randn(pipe.in_type(i).concrete(batch), device="cuda", generator=gen)
            w = torch.randn(op.weight_shape(), device="cuda", generator=gen)
            allowed = op.apply(x, w, None)
            torch.backends.cudnn.allow_tf32 = False
            try:
                fp32 = op.apply(x, w, None)
            finally:
                torch.backends.cudnn.allow_tf32 = True
            error = float((allowed - fp32).double().norm() / fp32.double().norm().clamp_min(torch.finfo(torch.float64).tiny))
            out[op.module] = error > TF32_ERROR_FLOOR
            del x, w, allowed, fp32
    return tuple(sorted(out.items()))


def prepare(spec, batches: list[int], max_candidates: int, root: Path, dtype: str = "float32") -> SpecTuning:
    """Plan, rank and render the candidates of one spec in ``dtype`` (nothing is built or run). On a GPU
    the convolutions' precision in eager's float32 cuDNN calls is measured first (``measure_eager_conv_tf32``,
    at the example batch): the candidates match it, and the entry records it for `kgen render`."""
    pipe = load_pipeline(spec)
    if dtype not in pipe.dtypes:
        raise KgenError(f"{spec}: --dtype {dtype}, but the spec lists {', '.join(pipe.dtypes)} under `dtype:`; "
                        f"add {dtype} there to tune its plans")
    pipe = replace(pipe, dtype=dtype)
    example = pipe.example_batch()
    if dtype == "float32":  # (16-bit convolutions run on 16-bit tensor cores: no TF32 question)
        pipe = replace(pipe, eager_conv_tf32=measure_eager_conv_tf32(pipe, example))
    batches = sorted({example, *batches})
    target = targets.current()
    cands, eval_mode = tuned_candidates(pipe, target)
    # eval mode's candidates run beside training mode's plan (the cost model's), so each module computes both
    train = [Variant(training_plan(pipe, target)[0], mode="train", dtype=dtype)] if eval_mode else []
    ranked = sorted(cands, key=lambda p: cost.estimate_ms(p, example))
    chosen = ranked
    if len(ranked) > max_candidates:
        eager = [p for p in ranked if p.eager]
        chosen = [p for p in ranked if p not in eager][: max_candidates - len(eager)] + eager
    tuning = SpecTuning(Path(spec), pipe, batches, cands, [Measured(p) for p in chosen])
    for m in tuning.measured:
        m.model_ms = {b: cost.estimate_ms(m.plan, b) for b in batches}
        name = _module_name(pipe, m.plan)
        variants = train + [Variant(m.plan, mode="eval" if eval_mode else "any", dtype=dtype)]
        if eval_mode and m.plan.eager and train[0].plan.eager:  # the spec's ops through ATen in both modes
            variants = [Variant(m.plan, dtype=dtype)]
        write_rendered(render_plan(rename(Selection(pipe, variants, "kgen tune"), name), root), root)
        m.module = root / name
    return tuning


def measure(t: SpecTuning, reps: int, device: str = "cuda", failed: dict | None = None) -> None:
    """Time every candidate module of ``t`` at each batch, after checking its output
    (on the CPU by wall time: for tests of the flow, not for choices). At each batch the
    candidates that pass their check and eager PyTorch are timed in turns, in blocks of
    consecutive calls (``time_in_blocks``), so that drift weighs on all of them alike."""
    from .validate import import_module_dir, init_args, run_with_magnitude

    pipe = t.pipe
    dt = getattr(torch, pipe.dtype)
    torch.manual_seed(0)
    reference32 = ReferenceModel(pipe).to(device).eval()
    state = reference32.state_dict()
    # eager PyTorch in the dtype (as bench converts it)
    reference = reference32 if dt == torch.float32 else copy.deepcopy(reference32).to(dt)
    n = len(t.measured) * len(t.batches)
    i = 0
    with torch.no_grad():
        for b in t.batches:
            xs32 = [torch.randn(pipe.inputs[n].concrete(b), device=device) for n in pipe.input_names]  # every input
            xs = [x.to(dt) for x in xs32]
            expected = reference(*xs)
            # the size of what the output sums (validate's magnitude): an output that cancels to ~0 (the
            # mean of a norm's output) is judged by it, not by its own tiny norm
            _, magnitude = run_with_magnitude(pipe.ops, xs32[0], reference32.tensors(), dict(zip(pipe.input_names, xs32)))
            runs = {"eager": lambda: reference(*xs)}
            for m in t.measured:
                if m.module in (failed or {}):
                    m.ms[b], m.problem = math.inf, f"does not build: {failed[m.module]}"
                    continue
                try:
                    mod = import_module_dir(m.module)
                    model = mod.Model(*init_args(mod)).to(device).eval()  # an imported model's constructor arguments
                    model.load_state_dict(state)
                    model.to(dt)
                    err = _rel_l2(model(*xs), expected, magnitude)
                    if not err <= CHECK_TOLERANCE:
                        m.ms[b], m.problem = math.inf, f"output differs from eager PyTorch at batch {b} (rel L2 {err:.2e})"
                    else:
                        runs[m.module] = lambda model=model: model(*xs)
                except RuntimeError as e:  # a launch that fails (resources): this candidate is out
                    m.ms[b], m.problem = math.inf, f"fails at batch {b}: {str(e).splitlines()[0][:160]}"
            _log(f"tune {_shown_name(t)}: timing {len(runs) - 1} candidate(s) and eager PyTorch in turns at batch {b}")
            timed = time_in_blocks(runs, reps, device)
            t.eager_pytorch_ms[b] = timed["eager"]
            for m in t.measured:
                i += 1
                if m.module in timed:
                    m.ms[b] = timed[m.module]
                _log(f"tune {_shown_name(t)}: candidate {i} of {n} (batch {b}): {m.ms[b]:.3f} ms, model {m.model_ms[b]:.3f} ms: "
                     f"{describe_choices(m.plan.choices)}{'  ' + m.problem if m.problem else ''}")


def _rel_l2(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor | None = None) -> float:
    """The L2 error of ``out`` over the L2 norm of ``ref``, or of ``magnitude`` (>= |ref|) where given."""
    out, ref = out.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(out)):
        return math.inf
    size = ref.abs() if magnitude is None else torch.maximum(ref.abs(), magnitude.double().nan_to_num(0.0, 0.0, 0.0))
    return float((out[finite] - ref[finite]).norm() / size[finite].norm().clamp_min(1e-30))


def _versions() -> dict:
    """What measured an entry: torch, CUDA, cuDNN and kgen's commit."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "kgen": _commit()}


def entry(t: SpecTuning, reps: int, device: str) -> dict:
    """The tuning file entry of a measured spec for ``device`` (its name, as Target.name)."""
    example = t.pipe.example_batch()
    ok = [m for m in t.measured if all(math.isfinite(v) for v in m.ms.values())]
    if not ok:
        raise KgenError(f"{t.spec}: no candidate passed its check; nothing to choose from")
    ids = {id(m): f"c{i}" for i, m in enumerate(t.measured)}
    best = {b: ids[id(min(ok, key=lambda m: m.ms[b]))] for b in t.batches}
    by_id = {ids[id(m)]: m for m in t.measured}
    ranges = [dict(min=lo, max=hi, tuned_at=at, candidate=c, choices=by_id[c].plan.choices, ms=round(by_id[c].ms[at], 4))
              for lo, hi, at, c in tunefile.ranges_from(best, example)]
    return {
        "device": device,
        **({"dtype": t.pipe.dtype} if t.pipe.dtype != "float32" else {}),  # float32: no key, as before 16-bit tuning
        "versions": _versions(),
        "date": _utc_now(),
        "reps": reps,
        "spec_hash": tunefile.spec_hash(t.pipe),
        "candidates_hash": tunefile.candidates_hash(t.candidates),
        "eager_pytorch_ms": {str(b): round(v, 4) for b, v in t.eager_pytorch_ms.items()},
        "candidates": [dict(id=ids[id(m)], choices=m.plan.choices,
                            model_ms={str(b): round(v, 4) for b, v in m.model_ms.items()},
                            measured_ms={str(b): (round(v, 4) if math.isfinite(v) else None) for b, v in m.ms.items()},
                            **({"problem": m.problem} if m.problem else {}))
                       for m in t.measured],
        "ranges": ranges,
        **({"eager_conv_tf32": dict(t.pipe.eager_conv_tf32)} if t.pipe.eager_conv_tf32 else {}),
    }


def run_tune(specs, batches: list[int], reps: int = 30, max_candidates: int = MAX_CANDIDATES,
             root: Path = TUNE_ROOT, dtypes: tuple = ()) -> list[list]:
    """Tune ``specs`` on this GPU in ``dtypes`` (default: each spec's dtypes): write each one's tuning file
    entries; returns the summary table's rows."""
    if not torch.cuda.is_available():
        raise KgenError("kgen tune needs a CUDA GPU: it measures the candidates")
    if reps < 20:
        raise KgenError("--reps must be at least 20 for a meaningful median")
    if max_candidates < 2:
        raise KgenError("--max-candidates must be at least 2 (the eager candidate and one more)")
    tunings = []
    for s in specs:
        for dtype in dtypes or load_pipeline(s).dtypes:
            t = prepare(s, batches, max_candidates, root, dtype)
            _log(f"tune {_shown_name(t)}: {len(t.measured)} of {len(t.candidates)} candidate(s) at batch(es) "
                 f"{', '.join(map(str, t.batches))}")
            tunings.append(t)
    dirs = sorted({m.module for t in tunings for m in t.measured})
    _log(f"tune: building {len(dirs)} candidate module(s) under {root}/ ...")
    failed: dict = {}  # a candidate that does not build is left out, not the end of the tuning
    build_modules(dirs, failures=failed)
    rows = []
    for t in tunings:
        measure(t, reps, failed=failed)
        e = entry(t, reps, torch.cuda.get_device_name())
        path = tunefile.write_entry(t.spec, e)
        _log(f"tune {_shown_name(t)}: wrote {path}")
        rows += _rows(t, e)
    return rows


PRECISION_HEADERS = ["spec", "convolution", "eager's cuDNN call"]


def run_precision(specs, log=_log) -> list[list]:
    """`kgen tune --precision-only`: measure eager's float32 cuDNN precision of each spec's convolutions on this
    GPU (``measure_eager_conv_tf32``, at the example batch; seconds, nothing rendered or built) and store it in the
    spec's tuning file, where the cost model's plans take it as a full tuning's do. An entry this device already
    has keeps its measured plans (its measurement replaced); else a precision-only entry (no candidates: the cost
    model still chooses the plans). Returns the summary table's rows."""
    if not torch.cuda.is_available():
        raise KgenError("kgen tune --precision-only needs a CUDA GPU: it measures eager's cuDNN calls")
    device, rows = torch.cuda.get_device_name(), []
    for s in specs:
        pipe = load_pipeline(s)
        if "float32" not in pipe.dtypes:
            continue
        pipe = replace(pipe, dtype="float32")
        measured = measure_eager_conv_tf32(pipe, pipe.example_batch())
        if not measured:
            continue
        stored, _ = tunefile.spec_entry(pipe, targets.current())
        e = dict(stored) if stored is not None else {"device": device, "spec_hash": tunefile.spec_hash(pipe),
                                                     "versions": _versions()}
        e["eager_conv_tf32"] = dict(measured)
        e["precision_date"] = _utc_now()
        path = tunefile.write_entry(s, e)
        log(f"tune {pipe.name}: eager's convolution precision written to {path}")
        rows += [[pipe.name, module, "TF32" if tf32 else "fp32"] for module, tf32 in measured]
    return rows


def _shown_name(t: SpecTuning) -> str:
    """The spec's name, and the dtype where it is not float32."""
    return t.pipe.name if t.pipe.dtype == "float32" else f"{t.pipe.name} [{t.pipe.dtype}]"


def _rows(t: SpecTuning, e: dict) -> list[list]:
    """Per batch: the fastest candidate, its time, eager's (the candidate and PyTorch), the model's pick."""
    rows = []
    eager = next((m for m in t.measured if m.plan.eager), None)
    for b in t.batches:
        r = next(r for r in e["ranges"] if r["min"] <= b and (r["max"] is None or b <= r["max"]))
        best = min((m for m in t.measured if math.isfinite(m.ms[b])), key=lambda m: m.ms[b])
        model_pick = min(t.measured, key=lambda m: m.model_ms[b])
        rows.append([
            _shown_name(t), b, len(t.measured), f"{best.ms[b]:.3f}", f"{t.eager_pytorch_ms[b]:.3f}",
            "-" if eager is None else f"{eager.ms[b]:.3f}", f"{t.eager_pytorch_ms[b] / best.ms[b]:.2f}x",
            f"{model_pick.ms[b]:.3f}", f"{r['min']}..{'' if r['max'] is None else r['max']}",
            describe_choices(best.plan.choices),
        ])
    return rows


TABLE_HEADERS = ["spec", "batch", "measured", "best ms", "eager PyTorch ms", "eager candidate ms", "vs eager",
                 "model's pick ms", "range", "best plan"]
