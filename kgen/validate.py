"""Check a generated module against the float64 reference built from the same spec.

Two kinds of cases:

- end to end: the module's op against the spec's (unrewritten) ops run by
  PyTorch in float64, on normal data (several seeds, batch 1, an odd batch),
  NaN, large values, ties in max windows, constant input, non-contiguous and
  channels_last inputs;
- per fused stage: adversarial values fed straight into the generated kernel
  (``kgen::NAME_stageK``): +-inf and NaN, ties, data far from zero, constants.
  Non-finite values going through a convolution are left to the conv library;
  here they reach our kernels directly.

Outputs and workspaces are poisoned (``KGEN_POISON_OUTPUTS=1``): an element no
kernel wrote keeps a NaN bit pattern that no computation produces, and fails
the case. NaN and +-inf must sit exactly where the reference has them.

Errors are measured against a float64 *magnitude reference* computed beside
the reference (``run_with_magnitude``): where the pipeline sums or adds, the
size of the terms, not of a result that cancels to (nearly) zero. A mean of a
normalized tensor is 0 up to rounding; its error is judged against the size
of the normalized values, not against that rounding noise.

Besides the op, the generated ``Model`` is exercised as a user calls it:
constructed, ``.eval()``/``.train()``, ``state_dict`` loaded both ways, forward.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .errors import KgenError
from .buffer import Buffer
from .ir import (AdaptivePool, BatchNorm, Capture, Cat, Cumsum, Dropout, Elementwise, Env, Expand, Interpolate, LayerNorm, Linear, Matmul, Norm, Pad,
                 Permute, Pipeline, Pool, Reduce, Reshape, Slice, Softmax, TensorType, blocked_linear, load_pipeline, run_ops)
from .lowering import lowered
from .ops import OPS
from .plan import Selection, choose_plans, stage_op_name
from .reference import ReferenceModel

POISON_BITS = 0x7FDEAD00  # kgen_runtime.h: kPoisonBits
POISON_BITS16 = 0x7FDE  # kgen_runtime.h: kPoisonBits16 (16-bit outputs)

# (relative L2 error, max abs error / max |reference|) allowed per precision
TOLERANCES = {
    "ieee": (1e-5, 1e-4),
    "tf32x3": (2e-5, 2e-4),
    "tf32": (5e-3, 2e-2),
}
# A 16-bit module (its inputs, parameters and output in the dtype) against the float64 reference of
# the same rounded inputs and parameters: the output's own rounding is up to eps/2 of each value
# (eps = 2^-7 for bfloat16's 8-bit significand, 2^-10 for float16's 11), and eager's rounding of every
# intermediate tensor adds a few eps more after sums and norms, so rel L2 2 eps and max abs 4 eps of the
# output's magnitude; or twice eager's own error in the same dtype where that is more (compare), as for
# float32. Beside it, KernelBench's 16-bit check: allclose against eager in the same dtype at
# atol = rtol = 1e-2 (KGEN_EAGER_ATOL).
DTYPE_TOLERANCES = {"bfloat16": (2 * 2**-7, 4 * 2**-7), "float16": (2 * 2**-10, 4 * 2**-10)}
KGEN_EAGER_ATOL = 1e-2
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CaseResult:
    case: str
    max_abs: float
    rel_l2: float
    passed: bool
    problem: str = ""
    eager_rel_l2: float = math.nan  # PyTorch's own float32 eager on the same input
    dtype: str = "float32"  # the dtype the module computed in


@dataclass
class Report:
    name: str
    device: str
    precision: str  # effective: the CPU build always computes in ieee
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    def normal_cases(self) -> list[CaseResult]:
        """End-to-end cases on normal random data: the accuracy to quote."""
        return [c for c in self.cases if c.case.startswith("normal")]

    def worst_rel_l2(self) -> float:
        return max((c.rel_l2 for c in self.normal_cases()), default=math.nan)

    def worst_max_abs(self) -> float:
        return max((c.max_abs for c in self.normal_cases()), default=math.nan)

    def by_dtype(self) -> list[tuple[str, "Report"]]:
        """The cases of each dtype the module computes (float32 first), as reports of their own."""
        dtypes = dict.fromkeys(["float32"] + [c.dtype for c in self.cases])
        return [(d, replace(self, cases=[c for c in self.cases if c.dtype == d])) for d in dtypes
                if d == "float32" or any(c.dtype == d for c in self.cases)]


# ------------------------------------------------------------ comparing


def _errors(o: torch.Tensor, r: torch.Tensor, m_finite: torch.Tensor, finite: torch.Tensor | None) -> tuple[float, float]:
    """(max abs error, L2 error relative to the magnitude) of o against r (float64) over r's finite elements
    (``finite``: torch.isfinite(r), or None where every element is finite; ``m_finite``: the magnitude there,
    0 elsewhere)."""
    if r.numel() == 0 or (finite is not None and not finite.any()):
        return 0.0, 0.0
    # where() rather than boolean indexing, which copies and was most of a large module's validation time;
    # none where all is finite (each pass over a large stage's values is a tenth of a second and more)
    diff = o - r if finite is None else torch.where(finite, o - r, 0.0)
    max_abs = float(diff.abs().max())
    norm = float(m_finite.norm())
    if norm == 0:
        return max_abs, 0.0 if max_abs == 0 else math.inf
    return max_abs, float(diff.norm()) / norm


def _kind(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf, per element (bytes: int64 temporaries of a large stage's
    values took seconds per case)."""
    u8 = torch.uint8
    return torch.isnan(t).to(u8) + torch.isposinf(t).to(u8) * 2 + torch.isneginf(t).to(u8) * 3




def compare(
    case: str, out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float], eager: torch.Tensor | None = None,
    magnitude: torch.Tensor | None = None, dtype: torch.dtype = torch.float32, spread: tuple = (),
) -> CaseResult:
    """``out`` (float32) against ``ref`` (float64): shapes, poison, non-finite masks, then errors.

    Errors are relative to ``magnitude`` (``run_with_magnitude``; default |ref|,
    and never less than it): the L2 error over its L2 norm, the max abs error
    over its max. The error may reach the tolerance of the precision mode, or
    twice what PyTorch's own float32 eager (``eager``) makes on this input,
    whichever is larger: on ill-conditioned inputs (data at 1e4 with std 1
    through x * m) no float32 computation gets within a fixed tolerance.
    ``spread``: eager's results on inputs within float32's rounding of this one
    (``_eager_spread``); the largest of their errors and eager's counts.
    """
    if tuple(out.shape) != tuple(ref.shape):
        return CaseResult(case, math.inf, math.inf, False, f"shape {list(out.shape)} != reference {list(ref.shape)}")
    if out.dtype != dtype:
        return CaseResult(case, math.inf, math.inf, False, f"dtype {out.dtype} != {dtype}")
    # On out's device: in float64 on the CPU, the comparison of a large CUDA result took a
    # minute and more of a KernelBench problem's validation.
    dev = out.device
    out, ref = out.detach(), ref.detach().to(dev)
    bits = out.contiguous().view(torch.int32) == POISON_BITS if dtype == torch.float32 else out.contiguous().view(torch.int16) == POISON_BITS16
    unwritten = int(bits.sum())
    if unwritten:
        return CaseResult(case, math.inf, math.inf, False, f"{unwritten} output elements were never written")
    if dtype != torch.float32:  # beyond the dtype's range the exact result rounds to an infinity, as eager's does (float16 overflow)
        rounded = ref.to(dtype)
        ref = torch.where(torch.isinf(rounded) & torch.isfinite(ref), rounded.double(), ref)
    # o and e keep their dtype: float64 arithmetic with r converts them exactly, without a float64 copy each
    o, r = out, ref.double()
    e = None if eager is None else eager.detach().to(dev)
    finite = torch.isfinite(r)  # (each mask once: on a large stage's values every pass is tens of ms)
    all_finite = bool(finite.all())
    e_finite = None if e is None else torch.isfinite(e)
    e_all_finite = e is not None and bool(e_finite.all())
    if e is not None and not (e_all_finite and all_finite):  # (all finite: one kind everywhere)
        # Where PyTorch's own float32 result and the float64 reference differ in kind (finite,
        # NaN, +inf, -inf), float32's range or rounding decided (exp(100) overflows in float32
        # only and may turn into NaN later; silu(-700) is -0 in float32, so its log is -inf
        # there and NaN in float64; the CPU's float32 gelu(inf) is NaN; the sign of a rounding
        # noise under a log): there either answer is PyTorch's, and kgen's is judged against
        # the one of its kind.
        kind_e = _kind(e)
        float32_kind = (kind_e != _kind(r)) & (_kind(o) == kind_e)
        if float32_kind.any():
            r = torch.where(float32_kind, e.double(), r)
            finite = torch.isfinite(r)
            all_finite = bool(finite.all())
    masks = () if all_finite and bool(torch.isfinite(o).all()) else (
        ("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf))
    for what, fn in masks:
        mo, mr = fn(o), fn(r)
        if not torch.equal(mo, mr):
            return CaseResult(
                case, math.inf, math.inf, False,
                f"{what} at {int((mo & ~mr).sum())} places the reference has none and missing at {int((mr & ~mo).sum())}",
            )
    m = r.abs()
    if magnitude is not None:
        mag = magnitude.detach().to(dev).double()
        m = torch.where(torch.isfinite(mag), torch.maximum(mag, m), m)
    m_finite = m if all_finite else torch.where(finite, m, 0.0)  # the magnitude where r is finite, once
    finite_or_all = None if all_finite else finite
    max_abs, rel_l2 = _errors(o, r, m_finite, finite_or_all)
    scale = float(m_finite.max()) if m_finite.numel() and (all_finite or finite.any()) else 0.0
    allowed_rel, allowed_abs = tol[0], tol[1] * scale
    eager_rel = math.nan
    if e is not None:
        if (all_finite and e_all_finite) or torch.equal(e_finite, finite):
            eager_abs, eager_rel = _errors(e, r, m_finite, finite_or_all)
            for other in spread:
                other = other.detach().to(dev)
                if torch.equal(torch.isfinite(other), e_finite):
                    a, rel = _errors(other, r, m_finite, finite_or_all)
                    eager_abs, eager_rel = max(eager_abs, a), max(eager_rel, rel)
            allowed_rel, allowed_abs = max(allowed_rel, 2 * eager_rel), max(allowed_abs, 2 * eager_abs)
    ok = rel_l2 <= allowed_rel and max_abs <= allowed_abs
    problem = "" if ok else (f"error rel L2 {rel_l2:.3g} / max abs {max_abs:.3g} above the allowed rel L2 "
                             f"{allowed_rel:.3g} / max abs {allowed_abs:.3g}")
    return CaseResult(case, max_abs, rel_l2, ok, problem, eager_rel)


def run_with_magnitude(ops, x: torch.Tensor, tensors, inputs: dict | None = None,
                       training: bool = False, outputs: tuple[str, ...] = ()) -> tuple:
    """``ops`` on ``x`` (the reference), and beside it a magnitude m >= |value| that
    rounding errors scale with: sums (reductions, pools, add/sub, products) and scalings
    propagate the magnitudes of their terms, so a result that cancels keeps the
    size of what was summed; a convolution or a norm restarts it from its own
    output (their rounding is relative to that; a norm's affine part still adds
    |w*x| + |b|); relu, clamp and sigmoid keep it where the output depends on the input.

    ``tensors`` holds parameters and buffers (batch norm updates its running
    statistics in it in training mode), ``inputs`` the values the ops read
    (inputs other than x, or, for a stage, the values it takes as tensors). ``outputs``: the
    named values to return (several outputs: a tuple of values and one of magnitudes), else the last.
    """
    env = Env(tensors)
    env.training = training
    env.update(inputs or {})
    menv = _Magnitudes(env)  # |t| of parameters and values, computed where read
    v, m = x, x.abs()
    for op in ops:
        if op.src is not None:
            v, m = env[op.src], menv[op.src]
        out = op.run(v, env)
        if isinstance(op, Capture):
            env[op.name], menv[op.name] = out, m
        elif isinstance(op, Reduce) and op.fn == "min":
            m = replace(op, fn="max").run(m, menv)  # the selected value's size is at most the largest
        elif isinstance(op, (Pool, Reduce, Reshape, Cat, Permute, Slice, Expand, Interpolate, AdaptivePool, Cumsum)):
            m = op.run(m, menv)  # moved values keep their magnitudes; averages, maxima and sums of them bound theirs
        elif isinstance(op, Pad):
            m = op.run(m, menv).abs()  # the padding value where it pads
        elif isinstance(op, Linear):
            bias = env[f"{op.module}.bias"] if op.bias else None
            m = blocked_linear(m, env[f"{op.module}.weight"], bias, absolute=True)
        elif isinstance(op, Matmul):
            m = op.run(m, menv)
        elif lowered(op) is not None or isinstance(op, (Softmax, Dropout)):  # a convolution in any lowering
            m = out.abs()
        elif isinstance(op, (Norm, BatchNorm, LayerNorm)):
            m = _normalized(op, v, env).abs()
            if op.tensor_names():
                w, b = (menv[n] if n in menv else None for n in (list(op.tensor_names()) + [None])[:2])
                shape = (1, -1) + (1,) * (v.dim() - 2) if not isinstance(op, LayerNorm) else w.shape
                m = m * w.reshape(shape) + (b.reshape(shape) if b is not None else 0)
        elif op.fn in ("relu", "clamp", "hardtanh"):
            m = torch.where(out == v, m, out.abs())  # where the op cut the value off, only the bound is left
        elif not OPS[op.fn].operand and OPS[op.fn].relative:  # exp, log: the error grows with the output
            scale = m if op.fn == "exp" else m / v.abs()
            m = torch.where(torch.isfinite(v), out.abs() * (1 + scale), out.abs())
        elif not OPS[op.fn].operand:  # a unary function: the input's rounding times its largest slope
            m = torch.where(torch.isfinite(v), out.abs() + OPS[op.fn].slope * m, out.abs())
        elif op.fn in ("minimum", "maximum"):
            m = torch.maximum(m, torch.as_tensor(_operand_magnitude(op, menv, v.dim()), dtype=m.dtype, device=m.device))
        elif op.fn == "masked_fill":  # a filled value is exact: its size there (0 for an infinity), x's elsewhere
            fill = abs(op.consts[0]) if math.isfinite(op.consts[0]) else 0.0
            m = torch.where(_operand_magnitude(op, menv, v.dim()) != 0, torch.full_like(m, fill), m)
        elif op.fn == "div" and op.reverse:  # operand / x: the quotient's size times x's relative error
            m = out.abs() * (1 + m / v.abs())
        else:  # add/sub/mul/div: the same op on the magnitudes, sub as add
            scalar = None if op.scalar is None else abs(op.scalar)
            m = replace(op, fn="add" if op.fn == "sub" else op.fn, scalar=scalar, reverse=False).run(m, menv)
        v = out
    if outputs:
        return tuple(env[n] for n in outputs), tuple(menv[n] for n in outputs)
    return v, m


def _operand_magnitude(op: Elementwise, menv, rank: int):
    """|operand| of a binary op as it reads it: a value's, a parameter's broadcast to ``rank`` dims, or the scalar's."""
    if op.tensor:
        return menv[op.tensor]
    return abs(op.scalar) if op.param is None else op.aligned_param(menv[op.param], rank)


class _Magnitudes(dict):
    """|t| of each tensor of ``env``, computed the first time it is read."""

    def __init__(self, env):
        super().__init__()
        self.env = env

    def __missing__(self, key):
        value = self.env[key].abs()
        self[key] = value
        return value

    def get(self, key, default=None):
        return self[key] if key in self or key in self.env else default

    def __contains__(self, key):
        return dict.__contains__(self, key) or key in self.env


def _normalized(op, v, env):
    """A norm's output without its affine part (batch norm: statistics as in ``op.run``, no update)."""
    if isinstance(op, Norm):
        return replace(op, affine=False).run(v, {})
    if isinstance(op, LayerNorm):
        return torch.nn.functional.layer_norm(v, op.normalized_shape, eps=op.eps)
    stats = not env.training and op.track_running_stats
    rm, rv = (env[n] for n in op.buffer_names()) if stats else (None, None)
    return torch.nn.functional.batch_norm(v, rm, rv, None, None, not stats, 0.0, op.eps)


# ------------------------------------------------------------ inputs


def _gen(seed: int, device) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(shape, seed, device) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed, device)).to(device)


def _inject(x: torch.Tensor, values, seed: int) -> torch.Tensor:
    """x with each of ``values`` written at a random position."""
    x = x.clone()
    flat = x.view(-1)
    pos = torch.randint(0, flat.numel(), (len(values),), generator=_gen(seed, "cpu"))
    for p, v in zip(pos.tolist(), values):
        flat[p] = v
    return x


def _ties(shape, seed, device) -> torch.Tensor:
    """Piecewise-constant data (2x blocks): equal values side by side, so max windows tie."""
    coarse = [shape[0], shape[1]] + [max(1, -(-s // 2)) for s in shape[2:]]
    x = _randn(coarse, seed, device)
    for d in range(2, len(shape)):
        x = x.repeat_interleave(2, dim=d).narrow(d, 0, shape[d])
    return x.contiguous()


def end_to_end_cases(t: TensorType, device, full: bool, batch: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """(label, input) pairs; ``full`` adds more seeds; ``batch`` puts every case at that batch
    (no odd-batch case), which keeps a huge model's CPU validation short."""
    S = t.spatial
    shape = lambda n: (n,) + tuple(t.shape[1:])  # noqa: E731
    two = batch or 2
    cases = [
        (f"normal N={two} seed 0", _randn(shape(two), 0, device)),
        ("normal N=1 (batch 1)", _randn(shape(1), 1, device)),
        ("normal N=3 (odd batch)", _randn(shape(3), 2, device)),
        ("NaN in the input", _inject(_randn(shape(two), 3, device), [math.nan] * 3, 3)),
        ("large values (x 1e3)", _randn(shape(1 if batch is None else batch), 4, device) * 1e3),
        ("ties (2x blocks)", _ties(shape(two), 5, device)),
        ("non-contiguous input", _randn(shape(two)[:-1] + (2 * t.shape[-1],), 6, device)[..., ::2]),
    ]
    if batch is not None:
        cases = [c for c in cases if "batch 1" not in c[0] and "odd batch" not in c[0]]
    if len(S) in (2, 3):
        fmt = torch.channels_last if len(S) == 2 else torch.channels_last_3d
        cases.append(("channels_last input", _randn(shape(two), 7, device).contiguous(memory_format=fmt)))
    if full:
        cases += [(f"normal N={two} seed {s}", _randn(shape(two), s, device)) for s in (10, 11, 12)]
    return cases


def stage_cases(t: TensorType, device) -> list[tuple[str, torch.Tensor]]:
    shape = (2,) + tuple(t.shape[1:])
    return [
        ("normal", _randn(shape, 20, device)),
        ("+-inf and NaN", _inject(_randn(shape, 21, device), [math.inf, -math.inf, math.nan, math.inf], 21)),
        ("+inf and -inf", _inject(_randn(shape, 22, device), [math.inf, -math.inf] * 2, 22)),
        ("ties (multiples of 1/4)", torch.round(_randn(shape, 23, device) * 4) / 4),
        ("far from zero (1e4 + N(0,1))", 1e4 + _randn(shape, 24, device)),
        ("constant", torch.full(shape, -1.25, device=device)),
    ]


def broadcast_as_read(buf: Buffer, x: torch.Tensor) -> torch.Tensor:
    """``x`` repeating its first values along the dims ``buf`` broadcasts (an expand read in place: stride 0),
    the only logical tensors such a buffer holds; ``x`` itself for any other buffer."""
    if buf.layout != "strided":
        return x
    for d, s in enumerate(buf.tiles[0].strides):
        if s == 0:
            x = x.narrow(d + 1, 0, 1).expand_as(x)
    return x.contiguous()


def pack_buffer(buf: Buffer, x: torch.Tensor) -> list[torch.Tensor]:
    """The physical tile(s) a stage reads, holding the logical tensor ``x``.

    Tile elements outside the logical region are NaN: a kernel that reads
    them shows up as a wrong NaN in the output.
    """
    n = x.shape[0]
    tiles = []
    for tile in buf.tiles:
        t = torch.empty_strided((n,) + tile.dims, (tile.sample_stride,) + tile.strides, device=x.device, dtype=x.dtype)
        t.fill_(math.nan)
        if buf.layout == "strided":  # a view read in place: its broadcast dims (stride 0) hold x's first values
            one = tuple(slice(0, 1) if s == 0 else slice(None) for s in tile.strides)
            t[(slice(None),) + one] = x[(slice(None),) + one]
            tiles.append(t)
            continue
        src, dst = [slice(None), slice(None)], [slice(None), slice(None)]
        for d in range(len(tile.dims) - 1):
            L = buf.logical[d + 1]
            if buf.phased:
                s, r = buf.phase_stride[d], tile.residue[d]
                count = len(range(r, L, s))
                src.append(slice(r, L, s))
            else:
                count = L
                src.append(slice(None))
            dst.append(slice(tile.offset[d], tile.offset[d] + count))
        t[tuple(dst)] = x[tuple(src)]
        tiles.append(t)
    return tiles


# ------------------------------------------------------------ running


def import_module_dir(module_dir: Path):
    """Import a generated module from its directory, wherever it lies."""
    module_dir = Path(module_dir).resolve()
    name = f"_kgen_module_{module_dir.name}_{abs(hash(str(module_dir))) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, module_dir / "__init__.py")
    if spec is None:
        raise KgenError(f"{module_dir} is not a generated module (no __init__.py); run `kgen render`")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


@contextlib.contextmanager
def poisoned_outputs():
    old = os.environ.get("KGEN_POISON_OUTPUTS")
    os.environ["KGEN_POISON_OUTPUTS"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KGEN_POISON_OUTPUTS"]
        else:
            os.environ["KGEN_POISON_OUTPUTS"] = old


def effective_precision(pipe: Pipeline, device: str) -> str:
    return pipe.precision if device.startswith("cuda") else "ieee"


def init_args(mod) -> list:
    """The constructor arguments a generated module was rendered for (none for a spec without a constructor)."""
    return list(mod.get_init_inputs()) if hasattr(mod, "get_init_inputs") else []


def modes(pipe: Pipeline) -> list[bool | None]:
    """The modes to validate: None when the pipeline computes alike in both; else training
    (unless a dropout refuses it) and eval."""
    if not pipe.training_dependent:
        return [None]
    refuses = any(isinstance(op, Dropout) and op.p > 0 for op in pipe.ops)
    return ([] if refuses else [True]) + [False]


def other_inputs(pipe: Pipeline, batch: int, seed: int, device) -> dict[str, torch.Tensor]:
    """Normal random values for the inputs after the first, with ``batch`` samples."""
    return {n: _randn(pipe.inputs[n].concrete(batch), seed + 100 * (i + 1), device)
            for i, n in enumerate(pipe.input_names[1:])}


def op_call(op, pipe: Pipeline, x, inputs: dict, params: dict, training: bool | None = None):
    """Call the module's op (or a stand-in with its arguments) the way the generated Model does: the
    inputs, then the parameters and the buffers as lists; ``params`` holds both by state_dict name. Returns (output, new buffers); several
    outputs are a tuple."""
    buffers = pipe.buffer_args()
    norms = [o for o in pipe.ops if isinstance(o, BatchNorm) and o.track_running_stats]
    counts = [params.get(f"{o.module}.num_batches_tracked") for o in norms]  # as nn.BatchNorm counts this batch
    named = {"x": x, **inputs, "params": [params[a.name] for a in pipe.tensor_args()],
             "buffers": [params[b.name] for b in buffers], "training": bool(training),
             "factors": [o.factor(None if c is None else c + 1) if training else 0.0 for o, c in zip(norms, counts)]}
    result = pipe.op_result()
    out, stats = result.split(op(*[named[n] for n in pipe.op_signature()]))
    return out, dict(zip(result.buffers, stats))


def validate(
    spec_path, module_dir: Path, device: str = "cpu", full: bool = False, stages: bool = True,
    selection: Selection | None = None, example_batch: bool = False, batch: int | None = None,
) -> Report:
    """Run every case of one module on ``device``; returns the report (it does not raise on failure).

    ``selection``: the plans the module was rendered from (default: as `kgen render`
    chooses them); each plan of a batch dispatch runs once at least.
    A pipeline that computes differently in training and eval mode (batch norm,
    dropout) is checked in both (dropout with p > 0: eval only); in training mode the
    running statistics the op returns are checked against PyTorch's update too.
    ``example_batch`` adds a case at the spec's example batch (a model's own size);
    ``batch`` runs the end-to-end cases at that batch only (batch norm's training mode
    over a batch alone needs 2).
    """
    pipe = load_pipeline(spec_path)
    sel = selection or choose_plans(pipe)
    mod = import_module_dir(module_dir)
    op = getattr(torch.ops.kgen, Path(module_dir).name)
    precision = effective_precision(pipe, device)
    report = Report(Path(module_dir).name, device, precision)
    torch.manual_seed(0)
    model = mod.Model(*init_args(mod)).to(device)
    reference = _sharing(pipe, model.state_dict())  # the reference's tensors are the model's: no copy
    _randomize_running_stats(reference)
    state = {k: v.detach() for k, v in reference.state_dict().items()}
    buffers = {k for k, _ in reference.named_buffers()}
    params64 = {k: _to64(v) for k, v in state.items() if k not in buffers}  # once: the cases share them
    with torch.no_grad(), poisoned_outputs():
        for dtype in pipe.dtypes:  # each dtype the module computes: its own cases (kgen validate reports each)
            dt = TORCH_DTYPES[dtype]
            tol = TOLERANCES[precision] if dtype == "float32" else DTYPE_TOLERANCES[dtype]
            # the parameters and running statistics in the dtype (model.to(dtype)); the reference is the
            # float64 computation on those rounded values
            st = state if dtype == "float32" else {k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()}
            p64 = params64 if dtype == "float32" else {k: _to64(v) for k, v in st.items() if k not in buffers}
            variants = [(i, v) for i, v in enumerate(sel.variants) if v.dtype == dtype]
            prefix = "" if dtype == "float32" else f"{dtype}: "
            cases = []
            for mode in modes(pipe):
                suffix = "" if mode is None else (" (training mode)" if mode else " (eval mode)")
                b = batch
                refused = bool(mode) and bool(pipe.one_value_batch_norms())  # at batch 1, as eager refuses
                if refused and b == 1:
                    b = 2
                cases = end_to_end_cases(pipe.input, device, full, b)
                if len(variants) > 1 and batch is None:  # each plan of the batch dispatch runs once at least
                    cases += [(f"normal N={v.lo} (plan {i}: batches {v.batches})", _randn(pipe.input.concrete(v.lo), 40 + i, device))
                              for i, v in variants]
                if example_batch:
                    b = pipe.example_batch()
                    cases.append((f"normal N={b} (the example batch)", _randn(pipe.input.concrete(b), 8, device)))
                if refused:
                    report.cases.append(replace(check_refusal(mod, model, pipe, device, dt), dtype=dtype))
                for label, x in cases:
                    if refused and x.shape[0] == 1:
                        continue  # checked by check_refusal
                    inputs = {n: t.to(dt) for n, t in other_inputs(pipe, x.shape[0], len(label), device).items()}
                    results = _end_to_end(prefix + label + suffix, op, pipe, st, p64, buffers, x.to(dt), inputs, bool(mode), tol)
                    report.cases += [replace(r, dtype=dtype) for r in results]
            report.cases.append(replace(check_model(mod, model, pipe, device, op, tol, dt), dtype=dtype))
        if stages:
            report.cases += check_stages(sel, report.name, model, device)
    return report


def check_refusal(mod, validated, pipe: Pipeline, device: str, dtype: torch.dtype) -> CaseResult:
    """At batch 1 in training mode, where a batch norm sees one value per channel, eager PyTorch raises
    ValueError: so must the module's Model, before it changes any running statistic."""
    label = "batch 1, training mode: refused as eager refuses (a batch norm of one value per channel)"
    with torch.device("meta"):
        model = mod.Model(*init_args(mod))
    model.load_state_dict(validated.state_dict(), assign=True)  # the validated model's tensors, not copies
    model.train()
    x = _randn(pipe.input.concrete(1), 31, device).to(dtype)
    inputs = {n: t.to(dtype) for n, t in other_inputs(pipe, 1, 31, device).items()}
    counts = {k: v.clone() for k, v in validated.state_dict().items() if k.endswith("num_batches_tracked")}
    try:
        model(x, *inputs.values())
        return CaseResult(label, math.inf, math.inf, False, "returned an output where eager raises ValueError")
    except ValueError as e:
        if "Expected more than 1 value per channel when training" not in str(e):
            return CaseResult(label, math.inf, math.inf, False, f"raised another ValueError: {e}")
    except Exception as e:  # noqa: BLE001 - whatever else breaks, it is this case's failure
        return CaseResult(label, math.inf, math.inf, False, f"raised {type(e).__name__} where eager raises ValueError")
    state = validated.state_dict()
    if any(not torch.equal(state[k], v) for k, v in counts.items()):
        return CaseResult(label, math.inf, math.inf, False, "counted the refused batch in num_batches_tracked")
    return CaseResult(label, 0.0, 0.0, True)


def _randomize_running_stats(model: torch.nn.Module) -> None:
    """Running statistics other than the initial zeros and ones, so eval mode uses them visibly."""
    g = _gen(99, "cpu")
    for name, b in model.named_buffers():
        if name.endswith("running_mean"):
            b.copy_(torch.randn(b.shape, generator=g))
        elif name.endswith("running_var"):
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)


LARGE_MODEL = 2**26  # parameter elements above which check_model builds its Models on the meta device
LARGE = 2**24  # elements of a parameter kept in float32 for the float64 reference (converted in blocks where used)


def _to64(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.numel() <= LARGE or not t.is_floating_point() else t


def _sharing(pipe: Pipeline, state: dict) -> ReferenceModel:
    """The reference model holding ``state``'s tensors themselves (built on the meta device, then assigned)."""
    with torch.device("meta"):
        reference = ReferenceModel(pipe)
    reference.load_state_dict(state, assign=True)
    return reference


def _end_to_end(label, op, pipe, state, params64, buffers, x, inputs, training, tol) -> list[CaseResult]:
    """One input case: the op against the float64 reference (and, in training mode, the running
    statistics it returns against PyTorch's update of them)."""
    fresh = {k: (v.clone() if k in buffers else v) for k, v in state.items()}  # each case starts from the same statistics
    tensors64 = {**params64, **{k: fresh[k].double() for k in buffers}}
    eager = _sharing(pipe, {k: (v.clone() if k in buffers else v) for k, v in fresh.items()})  # float32, PyTorch's defaults
    eager.train(training)
    new = {}

    def run():
        out, stats = op_call(op, pipe, x, inputs, fresh, training)
        new.update(stats)
        return out

    outs = {}

    def run_eager():
        outs["eager"] = eager(x, *inputs.values())  # in x's dtype, as eager PyTorch computes the model converted to it
        return outs["eager"]

    case = _case if not pipe.several_outputs else lambda *a, **k: _output_cases(pipe.outputs, *a, **k)

    def run_reference():
        if "reference" not in outs:  # (once: in training mode it updates tensors64's statistics)
            outs["reference"] = run_with_magnitude(pipe.ops, x.double(), tensors64,
                                                   {pipe.input_names[0]: x.double(), **{n: t.double() for n, t in inputs.items()}},
                                                   training, pipe.outputs if pipe.several_outputs else ())
        return outs["reference"]

    results = case(label, lambda: outs.setdefault("out", run()), run_reference, run_eager, tol, x.dtype)
    results = results if pipe.several_outputs else [results]
    spread = []  # eager on inputs within float32's rounding of x: only where kgen's error is past eager's on x
    if x.dtype == torch.float32 and "eager" in outs and any(r.problem.startswith("error") for r in results):
        spread = _eager_spread(pipe, state, buffers, x, inputs, training)
        results = case(label, lambda: outs["out"], run_reference, run_eager, tol, x.dtype, spread=[y for y, _ in spread])
        results = results if pipe.several_outputs else [results]
    if x.dtype != torch.float32 and "out" in outs and "eager" in outs:
        several = pipe.several_outputs
        for n, a, e in zip(pipe.outputs if several else ("",), *((outs[k] if several else (outs[k],)) for k in ("out", "eager"))):
            if a.dtype != x.dtype:
                continue
            a, e = a.double(), e.double()
            ok, worst = _kernelbench_close(a, e), _finite_max_diff(a, e)
            which = f": output {n}" if several else ""
            note = "" if ok or several else _eager_off_reference(a, e, outs.get("reference"), x.dtype)
            results.append(CaseResult(f"{label}{which}: vs eager {str(x.dtype).removeprefix('torch.')} (allclose at 1e-2){note}", worst,
                                      math.nan, ok or bool(note), "" if ok or note else f"not allclose to eager at atol = rtol = {KGEN_EAGER_ATOL}"))
    if new:
        eager_state = eager.state_dict()
        for name, value in new.items():
            # at the pipeline's precision: the statistics are sums of the (TF32) convolution's output
            case_ = compare(f"{label}: {name}", value, tensors64[name], tol, eager_state[name], dtype=value.dtype)
            if case_.problem.startswith("error") and x.dtype == torch.float32:
                spread = spread or _eager_spread(pipe, state, buffers, x, inputs, training)
                case_ = compare(f"{label}: {name}", value, tensors64[name], tol, eager_state[name], dtype=value.dtype,
                                spread=tuple(st[name] for _, st in spread))
            results.append(case_)
    return results


SPREAD_DRAWS = 8  # inputs moved within float32's rounding (below), besides the same input channels_last


def _eager_spread(pipe, state, buffers, x, inputs, training) -> list[tuple]:
    """(output, state_dict) of PyTorch's float32 eager on inputs within float32's rounding of ``x``: x channels_last
    (another summation order in the convolutions) and x with each value moved by one unit in the last place or not
    (SPREAD_DRAWS draws), each from the case's starting statistics. Where the problem amplifies rounding (a batch
    norm over two nearly equal values per channel, EfficientNetB2 at batch 2: eager's own float32 output is 25-80%
    off float64, and its running statistics' error varies 4x between such inputs), eager's error on the one input
    is a single draw of that spread; kgen's is judged against the largest. (With 3 draws B2's worst running
    variance there was 2.8x eager's largest error, with 8 and 12 within 2x: the spread's tail is long.)"""
    g = torch.Generator().manual_seed(7)
    moved = [torch.nextafter(x, torch.where(torch.randint(0, 2, x.shape, generator=g).bool().to(x.device), math.inf, -math.inf)
                             .to(x.dtype)) for _ in range(SPREAD_DRAWS)]
    keep = [torch.rand(x.shape, generator=g).to(x.device) < 0.5 for _ in range(SPREAD_DRAWS)]
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    variants = ([x.contiguous(memory_format=layout)] if layout else []) + [
        torch.where(k, x, mv) for k, mv in zip(keep, moved)]
    out = []
    for xx in variants:
        model = _sharing(pipe, {k: (v.clone() if k in buffers else v) for k, v in state.items()})
        model.train(training)
        y = model(xx, *inputs.values())
        out.append((y, model.state_dict()))
    return out


def check_model(mod, validated, pipe: Pipeline, device: str, op, tol, dtype: torch.dtype = torch.float32) -> CaseResult:
    """The module's ``Model`` used as a user would: construct (with the constructor arguments
    it was rendered for), move, ``.train()`` and ``.eval()``, load the validated model's
    ``state_dict``, forward (eval mode); its output must match the (validated) op on the
    same parameters, and a second Model loaded from the first one's ``state_dict`` must
    compute the same."""
    label = "Model(): construct, eval, state_dict, forward"
    if dtype != torch.float32:  # converted as a user converts it; its state_dict then holds 16-bit tensors
        label = f"{str(dtype).removeprefix('torch.')}: Model().to({dtype}): construct, eval, state_dict, forward"
    big = sum(p.numel() for p in validated.parameters()) > LARGE_MODEL

    def construct():
        """A Model; a large one on the meta device, to take the validated model's tensors (no copy)."""
        if not big:
            return mod.Model(*init_args(mod)).to(device).to(dtype)
        with torch.device("meta"):
            return mod.Model(*init_args(mod))

    try:
        model = construct()
        if model.train() is not model or model.eval() is not model or model.training:
            return CaseResult(label, math.inf, math.inf, False, ".train()/.eval() do not behave like torch.nn.Module's")
        expected = {k: tuple(v.shape) for k, v in validated.state_dict().items()}
        if {k: tuple(v.shape) for k, v in model.state_dict().items()} != expected:
            return CaseResult(label, math.inf, math.inf, False, "state_dict keys or shapes differ from the reference model's")
        given = {k: v.to(dtype) if v.is_floating_point() else v for k, v in validated.state_dict().items()}
        model.load_state_dict(given, assign=big)
        wrong = [k for k, v in model.state_dict().items() if v.is_floating_point() and v.dtype != dtype]
        if wrong:
            return CaseResult(label, math.inf, math.inf, False, f"state_dict entries not {dtype}: {', '.join(wrong[:3])}")
        x = _randn(pipe.input.concrete(1), 30, device).to(dtype)
        inputs = {n: t.to(dtype) for n, t in other_inputs(pipe, 1, 30, device).items()}
        out = model(x, *inputs.values())
        if pipe.several_outputs and not (isinstance(out, tuple) and len(out) == len(pipe.outputs)):
            return CaseResult(label, math.inf, math.inf, False, f"Model() returned {type(out).__name__}, not a tuple of "
                              f"{len(pipe.outputs)} outputs")
        again = construct().eval()
        again.load_state_dict(model.state_dict(), assign=big)
        # (within the tolerance: cuDNN may pick another algorithm, or reduce in another order, on a second call)
        def agrees(result) -> bool:
            return all(compare(label, a, o.double(), tol, dtype=dtype).passed for a, o in zip(_tuple(result), _tuple(out)))

        if not agrees(again(x, *inputs.values())):
            return CaseResult(label, math.inf, math.inf, False, "a Model loaded from another's state_dict computes differently")
        # a second and third call: on a GPU a CUDA-graph capture and its replay, where that pays
        model(_randn(pipe.input.concrete(1), 32, device).to(dtype), *inputs.values())
        if not agrees(model(x, *inputs.values())):
            return CaseResult(label, math.inf, math.inf, False, "a third call on the first call's input computes differently")
        tensors = dict(validated.named_parameters())
        tensors.update(validated.named_buffers())
        reference, _ = op_call(op, pipe, x, inputs, {k: v.detach().to(dtype) if v.is_floating_point() else v.detach()
                                                     for k, v in tensors.items()}, False)
    except Exception as e:  # noqa: BLE001 - whatever breaks, it is this case's failure
        first = (str(e).splitlines() or [""])[0]
        return CaseResult(label, math.inf, math.inf, False, f"raised {type(e).__name__}: {first}")
    if not pipe.several_outputs:
        return compare(label, out, reference.double(), tol, dtype=dtype)
    each = [compare(f"{label}: output {n}", o, r.double(), tol, dtype=dtype) for n, o, r in zip(pipe.outputs, out, reference)]
    return next((c for c in each if not c.passed), max(each, key=lambda c: c.rel_l2))


def _tuple(out) -> tuple:
    """A module's result as a tuple of its outputs."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def stage_tensors_in(plan, tensors: dict, dtype: str) -> dict:
    """``tensors`` (a plan's stage tensors by name) as the stage ops of its ``dtype`` plan take them: floating ones
    in the dtype, but for the statistics a 16-bit plan keeps float (a batch norm's: TensorArg.dtype; eager's run of
    the ops rounds them to the dtype)."""
    if dtype == "float32":
        return tensors
    floats = {a.name for a in plan.pipeline.stage_tensors() if a.dtype == "float32"}
    dt = TORCH_DTYPES[dtype]
    return {n: p.to(dt) if p.is_floating_point() and n not in floats else p for n, p in tensors.items()}


def check_stages(sel: Selection, name: str, model, device: str, reference_device: str | None = None) -> list[CaseResult]:
    """The per-stage adversarial cases: each fused stage's op ``kgen::NAME_stageK`` (of each
    plan) on ``device`` against its ops run by PyTorch on ``reference_device`` (default: the
    same); the values a stage reads as tensors are normal random data."""
    ref_device = reference_device or device
    state = {n: p.detach().to(ref_device) for n, p in model.state_dict().items()}  # parameters and buffers
    results = []
    count = len(sel.variants)
    stages = [(i, plan, st) for i, plan in enumerate(sel.plans) for st in plan.kernel_stages()]
    with torch.no_grad():
        tensors = [plan.pipeline.with_stage_tensors(state) for plan in sel.plans]  # and the tensors each plan's op derives or makes
        for i, plan, st in stages:
            # a 16-bit plan's stage: its input, parameters and values in the dtype, the reference on the same rounded
            # values, 16-bit tolerances (DTYPE_TOLERANCES)
            dtype = sel.variants[i].dtype
            dt = TORCH_DTYPES[dtype]
            params = stage_tensors_in(plan, tensors[i], dtype)
            stage_op = getattr(torch.ops.kgen, stage_op_name(name, i, count, st.index))
            args = [params[a.name].to(device) for a in plan.stage_args(st)]
            names = plan.stage_values(st)
            # values that are the stage's input itself: named inside it, or the value it starts from
            inside = {op.name for op in st.ops if isinstance(op, Capture)} | ({st.ops[0].src} if st.ops and st.ops[0].src else set())
            views = plan.view_values()  # values read in place through their strides: given so
            for label, x in stage_cases(st.in_type, ref_device):
                x = broadcast_as_read(st.input, x.to(dt))
                vals = {n: x if n in inside else _randn(plan.pipeline.values[n].concrete(x.shape[0]), 40 + k, ref_device).to(dt)
                        for k, n in enumerate(names)}
                vals = {n: broadcast_as_read(views[n], v) if n in views else v for n, v in vals.items()}
                source = {st.ops[0].src: x} if st.ops and st.ops[0].src else {}  # the value the stage reads
                # packed where they are read: a copy to another device would make a broadcast tile (stride 0) contiguous
                tiles = pack_buffer(st.input, x.to(device))
                vargs = [pack_buffer(views[n], vals[n].to(device))[0] if n in views else vals[n].to(device) for n in names]
                results.append(replace(_case(
                    f"stage {st.index}{'' if count == 1 else f' of plan {i}'}: {label}",
                    lambda: stage_op(tiles, args, vargs),
                    lambda: run_with_magnitude(st.ops, x.double(), {n: _to64(p) for n, p in params.items()},
                                               {n: v.double() for n, v in {**vals, **source}.items()}),
                    lambda: _run_ops(st.ops, x, params, dt, {**vals, **source}),
                    TOLERANCES[stage_precision(st, device)] if dtype == "float32" else DTYPE_TOLERANCES[dtype],
                    dt,
                ), dtype=dtype))
    return results


def stage_precision(st, device: str) -> str:
    """The precision a stage computes in: a generated convolution's products on the GPU (its
    direct loop's fp32 FMAs: ieee; split TF32 of an input rounded to TF32 as eager's call rounds it,
    ConvGemmStage.eager_products: TF32's), else fp32."""
    mma = getattr(getattr(st, "schedule", None), "mma", None)
    if getattr(st, "eager_products", False) and device.startswith("cuda"):
        return "tf32"
    return mma if mma and mma != "fp32" and device.startswith("cuda") else "ieee"


def _run_ops(ops, x, params, dtype, values=None):
    env = Env({n: p.detach().to(dtype) for n, p in params.items()})
    env.update({n: v.to(dtype) for n, v in (values or {}).items()})
    return run_ops(ops, x, env)


def _output_cases(names, label, run, run_reference, run_eager, tol, dtype=torch.float32, spread=()) -> list[CaseResult]:
    """``_case`` for a graph with several outputs (``names``): ``run``, ``run_eager`` and ``run_reference``
    give one tensor (reference: and one magnitude) per output; a result per output."""
    try:
        outs = run()
    except RuntimeError as e:
        return [CaseResult(label, math.inf, math.inf, False, f"raised: {str(e).splitlines()[0]}")]
    if len(outs) != len(names):
        return [CaseResult(label, math.inf, math.inf, False, f"{len(outs)} outputs, expected {len(names)}")]
    refs, magnitudes = run_reference()
    eager = run_eager()
    return [compare(f"{label}: output {n}", o, r, tol, e, m, dtype, tuple(y[i] for y in spread))
            for i, (n, o, r, e, m) in enumerate(zip(names, outs, refs, eager, magnitudes))]


def _eager_off_reference(out, eager, reference, dtype) -> str:
    """Where kgen's 16-bit output is not allclose to eager's: a note (the case passes) if kgen is at least as
    accurate as eager, else "". Measured against the float64 reference rounded to the dtype: kgen allclose to it
    (atol = rtol = 1e-2) and eager not (ATen's CPU batch norm over [N, C] in bfloat16 rounds its statistics where
    eager CUDA and kgen keep them float), or kgen's largest difference from it no larger than eager's. The second:
    two roundings of the same value to the dtype differ by an ulp where the value lies at a rounding midpoint (a
    batch norm's statistics summed in another order), and a later op can grow that past 1e-2 (one element of 67M
    after GELU in a GEMM + batch norm), as it could between two eager runs with different reduction orders."""
    if reference is None:
        return ""
    exact = reference[0].to(dtype).double()
    ours, theirs = _finite_max_diff(out, exact), _finite_max_diff(eager, exact)
    if _kernelbench_close(out, exact) and not _kernelbench_close(eager, exact):
        return f" [eager is off the float64 result by {theirs:.3g}, kgen within 1e-2 of it]"
    if ours <= theirs and _nonfinite_agree(out, eager):
        return f" [kgen is off the float64 result by {ours:.3g}, eager by {theirs:.3g}: as accurate as eager]"
    return ""


def _nonfinite_agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b have NaN, +inf and -inf at the same places."""
    return all(torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf, torch.isneginf))


def _kernelbench_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """KernelBench's 16-bit criterion: allclose at atol = rtol = KGEN_EAGER_ATOL, NaN equal to NaN."""
    return bool(torch.allclose(a, b, rtol=KGEN_EAGER_ATOL, atol=KGEN_EAGER_ATOL, equal_nan=True))


def _finite_max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| where both are finite (0 for empty tensors)."""
    diff = torch.where(torch.isfinite(a) & torch.isfinite(b), a - b, 0.0).abs()
    return float(diff.max()) if diff.numel() else 0.0


def _case(label, run, run_reference, run_eager, tol, dtype=torch.float32, spread=()) -> CaseResult:
    """``run_reference`` gives (float64 reference, magnitude) (``run_with_magnitude``); the output must be ``dtype``;
    ``spread``: eager's outputs on inputs within float32's rounding of this one (compare)."""
    try:
        out = run()
    except RuntimeError as e:  # a check or a launch failed: report it as this case's failure
        return CaseResult(label, math.inf, math.inf, False, f"raised: {str(e).splitlines()[0]}")
    ref, magnitude = run_reference()
    return compare(label, out, ref, tol, run_eager(), magnitude, dtype, tuple(spread))

