"""The algebraic rewrites (kgen.rewrites): where each fires, where its side
conditions stop it, and that every rewritten pipeline computes what the
original one does, in float64, on normal and adversarial inputs.

Expected values come from PyTorch itself: the original pipeline's ``run`` is
eager ``torch.nn.functional`` (checked against hand-written torch calls below),
and the sub-pixel form is also compared with ``F.conv_transposeNd`` directly.
"""
import itertools
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from kgen.ir import BatchStats, Conv, Elementwise, Pool, Reduce, build_pipeline, load_pipeline
from kgen.lowering import Folded, LoweredConv, PooledProduct, Subpixel, TapSums, TransposedFold
from kgen.reference import ReferenceModel
from kgen.rewrites import DEAD_REGION_MIN_FRACTION, REWRITES, apply_rewrites, batch_norm_batch_stats, batch_norm_eval_affine
from kgen.spec import REWRITE_NAMES, parse_spec

from conftest import NETVLAD_SPEC, PERMUTE_CHAIN_SPEC

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64


# ------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _one_thread(request):
    """Tiny tensors: one intra-op thread is faster than waking the pool (the shipped specs keep all threads)."""
    if "shipped" in request.node.name:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def spec_text(shape, ops, params=None, rewrites=None, batch=2):
    """A spec as YAML text: input [N] + shape with a symbolic batch N (example value ``batch``)."""
    raw = {"name": "t", "input": {"shape": ["N"] + list(shape), "dtype": "float32", "example": {"N": batch}}, "ops": ops}
    if params:
        raw["params"] = params
    if rewrites is not None:
        raw["rewrites"] = rewrites
    return yaml.safe_dump(raw, sort_keys=False)


def build(text):
    return build_pipeline(parse_spec(text, "t.yaml"))


def rewrite(pipe, *names):
    """Apply only ``names`` (enabled = {n: n in names}); returns (rewritten pipeline, decisions of those rewrites)."""
    enabled = {n: n in names for n in REWRITE_NAMES}
    new, decisions = apply_rewrites(pipe, enabled)
    return new, [d for d in decisions if d.rewrite in names]


def fired(decisions, name):
    return [d for d in decisions if d.rewrite == name and d.fired]


def not_fired(decisions, name):
    return [d for d in decisions if d.rewrite == name and not d.fired]


def tensors(pipe, seed=0):
    torch.manual_seed(seed)
    return {k: v.detach() for k, v in ReferenceModel(pipe).double().named_parameters()}


def randn(pipe, seed, batch=None):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(pipe.input.concrete(batch or pipe.example_batch()), dtype=F64, generator=g)


def run(pipe, x, t):
    with torch.no_grad():
        return pipe.run(x, t)


def scale_of(y):
    finite = y[torch.isfinite(y)]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def assert_same(got, want, exact=False):
    """Equal shapes, NaN at the same places, +-inf at the same places with the same sign, finite values close."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN masks differ"
    assert torch.equal(torch.isposinf(got), torch.isposinf(want)), "+inf masks differ"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf masks differ"
    tol = 0.0 if exact else 1e-10
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale_of(want), equal_nan=True)


def inject(x, value, count, seed, second=None):
    """Copy of x with ``value`` at flat index 0 (read by every op here) and at ``count`` random places;
    ``second`` (if given) goes to another ``count`` random places."""
    g = torch.Generator().manual_seed(2000 + seed)
    y = x.clone().reshape(-1)
    y[0] = value
    idx = torch.randperm(y.numel(), generator=g)
    y[idx[:count]] = value
    if second is not None:
        y[idx[count : 2 * count]] = second
    return y.reshape(x.shape)


def check_equivalent(orig, new, seeds=(0, 1, 2), nan=True, inf=True, ties=True, exact=False, must_reach=True):
    """The rewritten pipeline ``new`` against ``orig`` on random normal data and adversarial inputs.

    ``must_reach``: the injected NaN / inf must show up in the output (off where flat index 0 may be unread)."""
    for seed in seeds:
        t = tensors(orig, seed)
        x = randn(orig, seed)
        want = run(orig, x, t)
        assert torch.isfinite(want).all()
        assert_same(run(new, x, t), want, exact)
    t = tensors(orig, 0)
    x = randn(orig, 0)
    n = max(2, x.numel() // 40)
    if nan:
        for seed in range(2):
            xn = inject(x, math.nan, n, seed)
            want = run(orig, xn, t)
            assert torch.isnan(want).any() or not must_reach, "the injected NaN reaches no output; the case tests nothing"
            assert_same(run(new, xn, t), want, exact)
    if inf:
        reached = False
        for seed in range(2):
            for a, b in ((math.inf, -math.inf), (-math.inf, None), (math.inf, None)):
                xi = inject(x, a, n, seed, b)
                want = run(orig, xi, t)
                reached |= bool((~torch.isfinite(want)).any())
                assert_same(run(new, xi, t), want, exact)
        assert reached or not must_reach, "no inf reaches the output; the cases test nothing"
    if ties:
        g = torch.Generator().manual_seed(3000)
        shape = x.shape
        cases = [
            torch.randint(-2, 3, shape, generator=g).to(F64),  # many equal values
            torch.full(shape, 1.25, dtype=F64),  # all equal
            # piecewise constant: blocks of 2 along the last dim
            torch.randint(-3, 4, shape[:-1] + ((shape[-1] + 1) // 2,), generator=g).to(F64).repeat_interleave(2, -1)[..., : shape[-1]],
        ]
        for xt in cases:
            assert_same(run(new, xt, t), run(orig, xt, t), exact)


def ops_of(pipe, cls):
    return [o for o in pipe.ops if isinstance(o, cls)]


def crop_of(op):
    """The crop of a lowered convolution; None for a convolution as written."""
    return op.crop if isinstance(op, LoweredConv) else None


def is_subpixel(op):
    return isinstance(op, LoweredConv) and isinstance(op.lowering, Subpixel)


def conv_fn(rank, transposed=False):
    if transposed:
        return (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[rank - 1]
    return (F.conv1d, F.conv2d, F.conv3d)[rank - 1]


def check_input_extent(conv, cropped, x, t):
    """The input prefix a cropped conv reads (``input_extent``) suffices and is no larger than needed:
    NaN past it leaves the kept outputs of the uncropped ``conv`` finite, NaN in its last row reaches them."""
    L = tuple(x.shape[2:])
    ext = cropped.input_extent(L)
    assert all(1 <= e <= l for e, l in zip(ext, L)), (ext, L)
    kept = (slice(None), slice(None)) + tuple(slice(0, c) for c in cropped.crop)
    with torch.no_grad():
        xs = x.clone()
        for d, (e, l) in enumerate(zip(ext, L)):
            xs.narrow(2 + d, e, l - e).fill_(math.nan)
        assert torch.isfinite(conv.run(xs, t)[kept]).all(), "the conv reads past input_extent"
        for d, (e, l) in enumerate(zip(ext, L)):
            if e < l:
                xm = x.clone()
                xm.select(2 + d, e - 1).fill_(math.nan)
                assert torch.isnan(conv.run(xm, t)[kept]).any(), f"input_extent {ext} is larger than needed in dim {d}"


# ------------------------------------------------------------------ the driver and the reference


def test_original_pipeline_run_is_eager_torch():
    """The equivalence tests below trust the original pipeline's run; check it against hand-written torch."""
    text = spec_text(
        [3, 9, 9],
        [
            {"conv2d": {"out_channels": 4, "kernel_size": 3, "padding": 1}},
            {"div": {"scalar": 2.0}},
            {"max_pool2d": {"kernel_size": 2}},
            {"adaptive_avg_pool2d": {"output_size": 1}},
            {"add": {"param": "bias"}},
            {"sum": {"dim": 1}},
        ],
        params={"bias": {"shape": [4, 1, 1], "init": "randn"}},
    )
    p = build(text)
    t = tensors(p, 3)
    x = randn(p, 3)
    y = F.conv2d(x, t["conv.weight"], t["conv.bias"], padding=1) / 2.0
    y = F.adaptive_avg_pool2d(F.max_pool2d(y, 2), 1) + t["bias"]
    torch.testing.assert_close(run(p, x, t), y.sum(dim=1), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ dropout of zero


@pytest.mark.parametrize("p, gone", [(0.0, True), (0.2, False)])
def test_a_dropout_of_zero_is_gone(p, gone):
    """DenseNet's layers end in nn.Dropout(0.0): the identity in both modes, so the op goes and the convolution's
    output is the value named after it (a dropout of p > 0 stays: it is random in training mode)."""
    ops = [{"conv2d": {"out_channels": 4, "kernel_size": 3, "padding": 1}}, {"dropout": {"p": p}},
           {"relu": {"as": "f"}}, {"mul": {"scalar": 2.0}}]
    pipe = build(spec_text([3, 6, 6], ops))
    new, ds = rewrite(pipe, "dropout_of_zero")
    assert bool(fired(ds, "dropout_of_zero")) == gone
    assert [o.op_name for o in new.ops][:2] == (["conv2d", "relu"] if gone else ["conv2d", "dropout"])
    check_equivalent(pipe, new)


# ------------------------------------------------------------------ elementwise chains around permutes

def run_inputs(pipe, inputs, params=None):
    """The pipeline's outputs (a tuple) on ``inputs`` by name."""
    with torch.no_grad():
        names = pipe.input_names
        out = pipe.run(inputs[names[0]], params or {}, {n: inputs[n] for n in names[1:]})
    return out if isinstance(out, tuple) else (out,)


def check_equivalent_inputs(orig, new, params=None, seed=0):
    """``new`` against ``orig`` on normal inputs, then with NaN, +inf or -inf in each input in turn (a NaN must
    reach an output)."""
    g = torch.Generator().manual_seed(seed)
    inputs = {n: torch.randn(t.concrete(3), dtype=F64, generator=g) for n, t in orig.inputs.items()}
    for n, value in [(None, None)] + [(n, v) for n in inputs for v in (math.nan, math.inf, -math.inf)]:
        case = inputs if n is None else dict(inputs, **{n: inject(inputs[n], value, 4, seed)})
        want = run_inputs(orig, case, params)
        assert value == value or any(torch.isnan(w).any() for w in want), n
        for a, b in zip(run_inputs(new, case, params), want):
            assert_same(a, b)


def test_a_permute_moves_before_the_elementwise_chain_it_splits():
    """m / transpose(exp(s)): the quotient continues from the exponential (``reverse``: m stays the numerator), and
    the transpose moves before the exponential, which reads s through it; the chain after the second matmul moves
    after the transpose (w permuted as a view, r computed inside it), and fuses with the sum. The same values in
    float64, NaN and infinities in any input included, and the plan's elementwise ops in two stages (were four)."""
    from kgen.plan import make_plan
    from kgen.target import DEFAULT

    pipe = build(PERMUTE_CHAIN_SPEC)
    names = ("commute_operand_chain", "permute_before_elementwise")
    new, ds = rewrite(pipe, *names)
    assert [d.site for d in fired(ds, "commute_operand_chain")] == ["ops[3].div"]
    assert [d.site for d in fired(ds, "permute_before_elementwise")] == ["ops[2].transpose", "ops[8].transpose"]
    assert [o.describe() for o in new.ops] == [
        "matmul(x, y)", "as m", "transpose(1, 2)", "exp", "div(m, x)", "as p",
        "matmul(x, y)", "as permute_source", "transpose(1, 2)", "as w_permuted", "transpose(1, 2)",
        "relu", "as r", "mul(x, w_permuted)", "sub(x, r)", "add(x, z)", "as q"]
    check_equivalent_inputs(pipe, new, seed=5)
    before = make_plan(pipe, target=DEFAULT, rewrites={n: n not in names for n in REWRITE_NAMES})
    after = make_plan(pipe, target=DEFAULT)
    assert [st.kind for st in before.stages].count("pool_reduce") == 4
    assert [st.kind for st in after.stages].count("pool_reduce") == 2


def test_a_permute_moves_with_the_view_its_chain_continues_from_and_a_mask_it_leaves_in_place():
    """Mamba2's segment sums, ``exp(masked_fill(c[..., :, None] - d, mask))`` transposed before the product
    reads it: the chain continues from an expand of a named value, which moves with it to just before the permute
    (a view of a view), and its [T, T] mask lies along dims the permute leaves, so it is read as it is. One stage
    then computes it all; the same values in float64 (a mask of zeros and ones), NaN and infinities included. A
    transpose of a named value before the chain moves so too."""
    from kgen.plan import make_plan
    from kgen.target import DEFAULT

    pipe = build("""
name: segsum
inputs:
  c: {shape: [N, 3, 2, 5, 1]}
  d: {shape: [N, 3, 2, 1, 5]}
  y: {shape: [N, 2, 3, 5, 5]}
example: {N: 2}
params:
  m: {shape: [5, 5], init: randn}
ops:
  - expand: {shape: [3, 2, 5, 5], from: c}
  - sub: {tensor: d}
  - masked_fill: {param: m, value: -.inf}
  - exp
  - permute: {dims: [0, 2, 1, 3, 4]}
  - mul: {tensor: y}
""")
    new, ds = rewrite(pipe, "permute_before_elementwise")
    assert [d.site for d in fired(ds, "permute_before_elementwise")] == ["ops[4].permute"]
    assert [o.describe() for o in new.ops] == [
        "permute([0, 2, 1, 3, 4])", "as d_permuted", "x.expand([N, 3, 2, 5, 5])", "permute([0, 2, 1, 3, 4])",
        "sub(x, d_permuted)", "masked_fill(x, m, -inf)", "exp", "mul(x, y)"]
    mask = {"m": torch.tril(torch.ones(5, 5, dtype=F64)) - torch.eye(5, dtype=F64)}  # zeros on and above the diagonal
    check_equivalent_inputs(pipe, new, params=mask, seed=3)
    plan = make_plan(pipe, target=DEFAULT)
    assert [st.kind for st in plan.stages if st.kind != "aten"] == ["pool_reduce"]
    views = build("""
name: t
inputs:
  y: {shape: [N, 4, 3]}
  u: {shape: [N, 3, 4]}
example: {N: 2}
ops:
  - transpose: {dim0: 1, dim1: 2, from: y}
  - relu
  - mul: {tensor: u}
  - transpose: {dim0: 1, dim1: 2}
  - add: {tensor: y}
""")
    new, ds = rewrite(views, "permute_before_elementwise")
    assert [o.describe() for o in new.ops] == [
        "transpose(1, 2)", "as u_permuted", "transpose(1, 2)", "transpose(1, 2)", "relu", "mul(x, u_permuted)", "add(x, y)"]
    check_equivalent_inputs(views, new, seed=4)


@pytest.mark.parametrize("ops, why", [
    # the chain reads a parameter along the dims the permute moves
    ([{"relu": {"from": "x"}}, {"add": {"param": "b"}}, {"transpose": {"dim0": 1, "dim1": 2}}, {"add": {"tensor": "y"}}],
     "reads a parameter"),
    # the chain's result is read again after the transpose
    ([{"relu": {"from": "x", "as": "r"}}, {"transpose": {"dim0": 1, "dim1": 2, "from": "r"}}, {"add": {"tensor": "y"}},
      {"add": {"from": "r", "tensor": "u"}}], "read by other ops"),
    # a view of an unnamed result before the chain, whose operands' permutes would need it named
    ([{"sum": {"from": "x", "dim": 1, "keepdim": True}}, {"expand": {"shape": [3, 4]}}, "relu", {"mul": {"tensor": "u"}},
      {"transpose": {"dim0": 1, "dim1": 2}}, {"add": {"tensor": "y"}}], "a view"),
])
def test_a_permute_stays_where_moving_it_would_change_the_values_or_copy(ops, why):
    text = f"""
name: t
inputs:
  x: {{shape: [N, 3, 4]}}
  y: {{shape: [N, 4, 3]}}
  u: {{shape: [N, 3, 4]}}
example: {{N: 2}}
params:
  b: {{shape: [4], init: randn{"" if "reads a parameter" == why else ", unused: true"}}}
ops: {ops!r}
"""
    pipe = build(text.replace("'", '"'))
    new, ds = rewrite(pipe, "permute_before_elementwise")
    assert not fired(ds, "permute_before_elementwise") and list(new.ops) == list(pipe.ops)
    assert why in not_fired(ds, "permute_before_elementwise")[-1].reason


def test_an_operand_chain_computed_earlier_moves_to_the_op_reading_it():
    """NetVLAD's ``(x^T y)^T - sum(x) * c``: the broadcast product's chain (from the input's sum on) moves to just
    before the sub, which continues from it with the transposed product named as its operand (reverse: the operand
    minus the chain's value): the product and the sub in one stage, the [N, 5, 4] product never written. The same
    values in float64, NaN and infinities included; the plan moves fewer bytes."""
    from kgen.cost import estimate
    from kgen.plan import make_plan
    from kgen.target import DEFAULT

    pipe = build(NETVLAD_SPEC)
    new, ds = rewrite(pipe, "commute_operand_chain")
    assert [d.site for d in fired(ds, "commute_operand_chain")] == ["ops[6].sub"]
    assert [o.describe() for o in new.ops] == [
        "transpose(1, 2)", "matmul(x, y)", "transpose(1, 2)", "as sub_operand", "sum(dims=[1], keepdim)",
        "x.expand([N, 5, 4])", "mul(c)", "sub(sub_operand, x)", "relu"]
    assert new.ops[4].src == "x"  # (the chain's first op read the input implicitly)
    check_equivalent_inputs(pipe, new, tensors(pipe), seed=3)
    bytes_of = lambda plan: sum(e.bytes for e in estimate(plan, 64))  # noqa: E731
    before = make_plan(pipe, target=DEFAULT, rewrites={n: n != "commute_operand_chain" for n in REWRITE_NAMES})
    assert bytes_of(make_plan(pipe, target=DEFAULT)) < bytes_of(before)


@pytest.mark.parametrize("edit, why", [
    # t is also what the op continues from (KernelBench #22's `x * 2` named, then `x + x`): nothing to commute
    (lambda t: t.replace("  - sub: {tensor: m}\n", "  - sub: {tensor: m}\n  - mul: {scalar: 2.0, as: twice}\n"
                         "  - add: {tensor: twice}\n"), "both of its operands"),
    # sub continues an elementwise chain (relu): its input is a register, which an operand would write
    (lambda t: t.replace("  - sub: {tensor: m}", "  - relu\n  - sub: {tensor: m}"), "continues an elementwise chain"),
    # the chain computing m names a value read between it and the sub
    (lambda t: t.replace("  - expand: {shape: [5, 4]}", "  - expand: {shape: [5, 4], as: e}")
     .replace("  - transpose: {dim0: 1, dim1: 2, from: x}", "  - relu: {from: e, as: er}\n  - transpose: {dim0: 1, dim1: 2, from: x}"),
     "is read before"),
])
def test_an_operand_chain_stays_where_moving_it_would_cost_or_break(edit, why):
    pipe = build(edit(NETVLAD_SPEC))
    new, ds = rewrite(pipe, "commute_operand_chain")
    site = next(o.key for o in reversed(pipe.ops) if getattr(o, "tensor", None))  # the last op with a tensor operand
    assert not [d for d in fired(ds, "commute_operand_chain") if d.site == site]
    assert why in next(d.reason for d in not_fired(ds, "commute_operand_chain") if d.site == site)


def test_an_operand_that_broadcasts_stays_the_operand():
    """f(x, t) with t smaller than the result: t cannot be what the op continues from."""
    text = """
name: t
inputs:
  x: {shape: [N, 3, 4]}
  s: {shape: [N, 1, 4]}
example: {N: 2}
ops:
  - relu: {from: x, as: rx}
  - exp: {from: s, as: e}
  - mul: {tensor: e, from: rx}
"""
    pipe = build(text)
    new, ds = rewrite(pipe, "commute_operand_chain")
    assert not fired(ds, "commute_operand_chain") and list(new.ops) == list(pipe.ops)
    assert "broadcasts to the result" in not_fired(ds, "commute_operand_chain")[0].reason


# ------------------------------------------------------------------ softmax through reshape

SPANNED_OPS = [{"add": {"param": "b"}}, {"reshape": {"shape": [4, 90]}}, {"softmax": {"dim": 2}},
               {"reshape": {"shape": [4, 3, 5, 6]}}, {"mul": {"scalar": 2.0}}]


@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
def test_softmax_through_reshape_takes_the_merged_dims_as_one(fn):
    """KernelBench #38's form: x.view(b, c, -1), softmax(dim=2), view back -> a softmax over dims 2-4, the ops around
    it adjacent to it (one stage); the same values, NaN and infinities included. (Merging the channels with the
    dims after them is the same: softmax over dims 1-2.)"""
    ops = [dict(o) if o != {"softmax": {"dim": 2}} else {fn: {"dim": 2}} for o in SPANNED_OPS]
    pipe = build(spec_text([4, 3, 5, 6], ops, params={"b": {"shape": [4, 1, 1, 1]}}))
    new, ds = rewrite(pipe, "softmax_through_reshape")
    assert len(fired(ds, "softmax_through_reshape")) == 1
    assert [o.describe() for o in new.ops][1:] == [f"{fn}(dims=[2, 3, 4])", "mul(2)"]
    check_equivalent(pipe, new, ties=False)


@pytest.mark.parametrize("shape, views, why", [
    ([4, 6, 5], ([4, 30], 1, [4, 6, 5]), "does not merge"),  # merges two dims, the softmax is over a third
    ([4, 6, 5], ([4, 30], 2, [4, 5, 6]), "does not restore"),  # reshaped back to another shape
])
def test_softmax_through_reshape_needs_the_merge_and_its_inverse(shape, views, why):
    first, dim, back = views
    ops = [{"reshape": {"shape": first}}, {"softmax": {"dim": dim}}, {"reshape": {"shape": back}}]
    pipe = build(spec_text(shape, ops))
    new, ds = rewrite(pipe, "softmax_through_reshape")
    assert not fired(ds, "softmax_through_reshape") and list(new.ops) == list(pipe.ops)
    assert why in not_fired(ds, "softmax_through_reshape")[0].reason


# ------------------------------------------------------------------ scalar_through_max


def _conv_scalar_max(scalar_op, value, max_op):
    return build(
        spec_text(
            [3, 8, 8],
            [{"conv2d": {"out_channels": 4, "kernel_size": 3}}, {scalar_op: {"scalar": value}}, max_op, {"sum": {"dim": 1}}],
        )
    )


@pytest.mark.parametrize(
    "scalar_op,value,max_op",
    [
        ("div", 2.5, {"max_pool2d": {"kernel_size": 2}}),
        ("mul", 3.0, {"max_pool2d": {"kernel_size": 3, "stride": 2, "padding": 1}}),
        ("mul", 0.37, {"max_pool2d": {"kernel_size": 2, "ceil_mode": True, "stride": 2}}),
        ("div", 7.0, {"max": {"dim": [2, 3], "keepdim": True}}),
    ],
)
def test_scalar_through_max_fires(scalar_op, value, max_op):
    p = _conv_scalar_max(scalar_op, value, max_op)
    q, ds = rewrite(p, "scalar_through_max")
    assert len(fired(ds, "scalar_through_max")) == 1 and not not_fired(ds, "scalar_through_max")
    kinds = [type(o) for o in q.ops]
    assert kinds[:3] == [Conv, Pool if isinstance(p.ops[2], Pool) else Reduce, Elementwise]
    assert q.ops[2].fn == scalar_op and q.ops[2].scalar == value
    assert q.ops[1] == p.ops[2] and q.ops[0] == p.ops[0] and q.ops[3:] == p.ops[3:]
    check_equivalent(p, q, exact=True)


def test_scalar_through_max_on_the_input_with_ties():
    """No conv in front: ties in the max windows come straight from the input."""
    p = build(spec_text([2, 6, 6], [{"mul": {"scalar": 0.1}}, {"max_pool2d": {"kernel_size": 2}}, {"max": {"dim": 1}}]))
    q, ds = rewrite(p, "scalar_through_max")
    # the mul moves past the pool and then past the max reduction
    assert [type(o) for o in q.ops] == [Pool, Reduce, Elementwise]
    assert fired(ds, "scalar_through_max")
    check_equivalent(p, q, exact=True)


def test_scalar_through_max_then_pool_composition():
    """max_pool, x/2, max_pool -> max_pool, max_pool, x/2 -> one max_pool(k=4), x/2."""
    p = build(
        spec_text(
            [2, 8, 8],
            [{"max_pool2d": {"kernel_size": 2}}, {"div": {"scalar": 2.0}}, {"max_pool2d": {"kernel_size": 2}}],
        )
    )
    q, ds = rewrite(p, "scalar_through_max", "pool_composition")
    assert fired(ds, "scalar_through_max") and fired(ds, "pool_composition")
    assert [type(o) for o in q.ops] == [Pool, Elementwise]
    assert q.ops[0].kernel == (4, 4) and q.ops[0].stride == (4, 4)
    x = randn(p, 0)
    torch.testing.assert_close(run(q, x, {}), F.max_pool2d(x, 4) / 2.0, rtol=0, atol=0)
    check_equivalent(p, q, exact=True)


@pytest.mark.parametrize("scalar_op,value", [("div", -2.0), ("mul", -1.5), ("mul", 0.0)])
@pytest.mark.parametrize("max_op", [{"max_pool2d": {"kernel_size": 2}}, {"max": {"dim": [2, 3]}}])
def test_scalar_through_max_does_not_fire_for_non_positive_scalars(scalar_op, value, max_op):
    p = _conv_scalar_max(scalar_op, value, max_op)
    q, ds = rewrite(p, "scalar_through_max")
    assert not fired(ds, "scalar_through_max")
    (d,) = not_fired(ds, "scalar_through_max")
    assert "not positive" in d.reason and p.ops[1].key in d.site
    assert q.ops == p.ops
    if value < 0:  # and moving it would indeed be wrong: max(c*x) != c*max(x)
        t, x = tensors(p), randn(p, 0)
        swapped = p.with_ops([p.ops[0], p.ops[2], p.ops[1]] + list(p.ops[3:]))
        assert not torch.allclose(run(swapped, x, t), run(p, x, t))


def test_scalar_through_max_mul_by_zero_would_change_inf():
    """Why c = 0 must not move: max(0 * [-inf, 1]) = NaN, 0 * max([-inf, 1]) = 0."""
    p = build(spec_text([1, 2], [{"mul": {"scalar": 0.0}}, {"max_pool1d": {"kernel_size": 2}}]))
    q, ds = rewrite(p, "scalar_through_max")
    assert not fired(ds, "scalar_through_max") and q.ops == p.ops
    x = torch.tensor([[[-math.inf, 1.0]]], dtype=F64)
    assert torch.isnan(run(q, x, {})).all()
    assert run(p.with_ops(p.ops[::-1]), x, {}).item() == 0.0


def test_scalar_through_max_ignores_a_parameter_factor():
    p = build(
        spec_text(
            [3, 6, 6],
            [{"mul": {"param": "m"}}, {"max_pool2d": {"kernel_size": 2}}],
            params={"m": {"shape": [3, 1, 1], "init": "randn"}},
        )
    )
    q, ds = rewrite(p, "scalar_through_max")
    assert not fired(ds, "scalar_through_max") and q.ops == p.ops


# ------------------------------------------------------------------ pool_composition


@pytest.mark.parametrize(
    "kind,shape,k1,k2",
    [
        ("max", [2, 12, 12], 2, 3),
        ("max", [2, 13, 11], 2, 3),  # floors drop trailing rows
        ("avg", [2, 12, 12], 3, 2),
        ("avg", [3, 13, 9], 2, 2),
        ("max", [2, 7], 2, 2),
        ("avg", [2, 17], 3, 2),
        ("max", [2, 8, 7, 9], [2, 1, 2], [1, 3, 2]),
        ("avg", [2, 6, 9, 5], [1, 3, 2], [3, 1, 2]),
    ],
)
def test_pool_composition_fires(kind, shape, k1, k2):
    r = len(shape) - 1
    fn = f"{kind}_pool{r}d"
    p = build(spec_text(shape, [{fn: {"kernel_size": k1}}, {fn: {"kernel_size": k2}}, {"mul": {"scalar": 1.5}}]))
    q, ds = rewrite(p, "pool_composition")
    (d,) = fired(ds, "pool_composition")
    assert d.site == f"{p.ops[0].key} + {p.ops[1].key}"
    pools = ops_of(q, Pool)
    assert len(pools) == 1 and len(q.ops) == 2
    k1t = (k1,) * r if isinstance(k1, int) else tuple(k1)
    k2t = (k2,) * r if isinstance(k2, int) else tuple(k2)
    k = tuple(a * b for a, b in zip(k1t, k2t))
    assert pools[0].kind == kind and pools[0].kernel == k and pools[0].stride == k
    assert pools[0].sources == (p.ops[0].key, p.ops[1].key)
    # independent expectation: one torch pool with the product kernel
    x = randn(p, 5)
    pool = getattr(F, fn)
    torch.testing.assert_close(run(q, x, {}), pool(x, k) * 1.5, rtol=1e-12, atol=1e-12)
    check_equivalent(p, q, exact=(kind == "max"))


def test_pool_composition_after_a_conv():
    p = build(
        spec_text(
            [2, 5, 11, 10],
            [{"conv3d": {"out_channels": 3, "kernel_size": 2}}, {"max_pool3d": {"kernel_size": 2}}, {"max_pool3d": {"kernel_size": [1, 2, 2]}}],
        )
    )
    q, ds = rewrite(p, "pool_composition")
    assert fired(ds, "pool_composition") and ops_of(q, Pool)[0].kernel == (2, 4, 4)
    check_equivalent(p, q, exact=True)


def test_pool_composition_chains_three_pools():
    p = build(spec_text([2, 16], [{"max_pool1d": {"kernel_size": 2}}] * 3))
    q, ds = rewrite(p, "pool_composition")
    assert len(fired(ds, "pool_composition")) == 2
    (pool,) = q.ops
    assert pool.kernel == (8,)
    check_equivalent(p, q, exact=True)


@pytest.mark.parametrize(
    "first,second,why",
    [
        ({"max_pool2d": {"kernel_size": 3, "stride": 2}}, {"max_pool2d": {"kernel_size": 2}}, "overlaps"),
        ({"max_pool2d": {"kernel_size": 2}}, {"max_pool2d": {"kernel_size": 3, "stride": 2}}, "overlaps"),
        ({"avg_pool2d": {"kernel_size": 3, "stride": 2}}, {"avg_pool2d": {"kernel_size": 2}}, "overlaps"),
        ({"max_pool2d": {"kernel_size": 2, "padding": 1}}, {"max_pool2d": {"kernel_size": 2}}, "pads"),
        ({"avg_pool2d": {"kernel_size": 2}}, {"avg_pool2d": {"kernel_size": 2, "padding": 1}}, "pads"),
        ({"max_pool2d": {"kernel_size": 2, "ceil_mode": True}}, {"max_pool2d": {"kernel_size": 2}}, "ceil_mode True"),
        ({"avg_pool2d": {"kernel_size": 2}}, {"avg_pool2d": {"kernel_size": 2, "ceil_mode": True}}, "ceil_mode True"),
        ({"max_pool2d": {"kernel_size": 2, "dilation": 2}}, {"max_pool2d": {"kernel_size": 2}}, "overlaps"),
        ({"max_pool2d": {"kernel_size": 2}}, {"avg_pool2d": {"kernel_size": 2}}, "max pool then avg pool"),
        ({"avg_pool2d": {"kernel_size": 2}}, {"max_pool2d": {"kernel_size": 2}}, "avg pool then max pool"),
    ],
)
def test_pool_composition_does_not_fire(first, second, why):
    p = build(spec_text([2, 13, 13], [first, second]))
    q, ds = rewrite(p, "pool_composition")
    assert not fired(ds, "pool_composition")
    (d,) = not_fired(ds, "pool_composition")
    assert why in d.reason
    assert q.ops == p.ops


# ------------------------------------------------------------------ avg_pool_folding


@pytest.mark.parametrize(
    "shape,conv,pool",
    [
        ([3, 10, 10], {"conv2d": {"out_channels": 4, "kernel_size": 3}}, {"avg_pool2d": {"kernel_size": 2}}),
        ([3, 13, 12], {"conv2d": {"out_channels": 4, "kernel_size": 3, "stride": 2, "padding": 1}}, {"avg_pool2d": {"kernel_size": 2}}),
        ([2, 11, 11], {"conv2d": {"out_channels": 3, "kernel_size": [3, 2], "bias": False}}, {"avg_pool2d": {"kernel_size": 3, "stride": 2}}),
        ([4, 9, 10], {"conv2d": {"out_channels": 6, "kernel_size": 3, "groups": 2}}, {"avg_pool2d": {"kernel_size": [2, 3]}}),
        ([3, 17], {"conv1d": {"out_channels": 2, "kernel_size": 4, "stride": 3, "padding": 2}}, {"avg_pool1d": {"kernel_size": 2}}),
        ([2, 6, 7, 8], {"conv3d": {"out_channels": 3, "kernel_size": 2}}, {"avg_pool3d": {"kernel_size": [2, 3, 2]}}),
    ],
)
def test_avg_pool_folding_fires(shape, conv, pool):
    p = build(spec_text(shape, [conv, pool, {"sigmoid": None}, {"sum": {"dim": 1}}]))
    q, ds = rewrite(p, "avg_pool_folding")
    (d,) = fired(ds, "avg_pool_folding")
    assert d.site == f"{p.ops[0].key} + {p.ops[1].key}"
    assert not ops_of(q, Pool) and len(q.ops) == len(p.ops) - 1
    c, pl = q.ops[0], p.ops[1]
    assert isinstance(c.lowering, Folded) and c.lowering.pool_kernel == pl.kernel and c.lowering.pool_stride == pl.stride
    assert c.conv == p.ops[0]  # the convolution as written stays as it was
    assert c.kernel == tuple((kp - 1) * s + k for k, s, kp in zip(p.ops[0].kernel, p.ops[0].stride, pl.kernel))
    assert c.stride == tuple(s * sp for s, sp in zip(p.ops[0].stride, pl.stride))
    # independent expectation for the conv + pool part
    t, x = tensors(p, 4), randn(p, 4)
    r = len(shape) - 1
    pc = p.ops[0]
    y = conv_fn(r)(x, t["conv.weight"], t.get("conv.bias"), pc.stride, pc.padding, 1, pc.groups)
    y = getattr(F, f"avg_pool{r}d")(y, pl.kernel, pl.stride)
    torch.testing.assert_close(run(q, x, t), torch.sigmoid(y).sum(dim=1), rtol=1e-10, atol=1e-10)
    check_equivalent(p, q, inf=False)


@pytest.mark.parametrize(
    "ops,why",
    [
        ([{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"relu": None}, {"avg_pool2d": {"kernel_size": 2}}], "relu between"),
        ([{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"sigmoid": None}, {"avg_pool2d": {"kernel_size": 2}}], "sigmoid between"),
        ([{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"avg_pool2d": {"kernel_size": 2, "padding": 1}}], "pool pads"),
        ([{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"avg_pool2d": {"kernel_size": 2, "ceil_mode": True}}], "ceil_mode"),
        ([{"conv2d": {"out_channels": 3, "kernel_size": 3, "dilation": 2}}, {"avg_pool2d": {"kernel_size": 2}}], "dilat"),
        ([{"conv_transpose2d": {"out_channels": 3, "kernel_size": 3, "stride": 2}}, {"avg_pool2d": {"kernel_size": 3}}], "not a multiple"),
        ([{"conv_transpose2d": {"out_channels": 3, "kernel_size": 3, "stride": 2}}, {"avg_pool2d": {"kernel_size": 4, "stride": 2}}], "differs from its kernel"),
        ([{"conv_transpose2d": {"out_channels": 4, "kernel_size": 3, "stride": 2, "groups": 2}}, {"avg_pool2d": {"kernel_size": 2}}], "groups=2"),
        ([{"conv_transpose2d": {"out_channels": 3, "kernel_size": 2, "stride": 2, "dilation": 2}}, {"avg_pool2d": {"kernel_size": 2}}], "dilat"),
    ],
)
def test_avg_pool_folding_does_not_fire(ops, why):
    p = build(spec_text([2, 11, 11], ops))
    q, ds = rewrite(p, "avg_pool_folding")
    assert not fired(ds, "avg_pool_folding")
    (d,) = not_fired(ds, "avg_pool_folding")
    assert why in d.reason
    assert q.ops == p.ops
    assert not ops_of(q, LoweredConv)


def _random_transposed_fold(rng, rank):
    """A transposed convolution and an average pool of whole stride periods (kernel = stride * 1 or 2)."""
    while True:
        k = [rng.randint(1, 5) for _ in range(rank)]
        s = [rng.randint(1, 3) for _ in range(rank)]
        p = [rng.randint(0, kk - 1) for kk in k]
        op = [rng.randint(0, ss - 1) if rng.random() < 0.3 else 0 for ss in s]
        L = [rng.randint(2, 6 if rank < 3 else 4) for _ in range(rank)]
        kp = [ss * rng.randint(1, 2) for ss in s]
        out = [(l - 1) * ss - 2 * pp + kk + o for l, ss, pp, kk, o in zip(L, s, p, k, op)]
        folds = [TransposedFold.of(kk, ss, pp, q) for kk, ss, pp, q in zip(k, s, p, kp)]
        # the folded convolution pads both sides alike: an output_padding may need more on the right (not folded)
        reach = [(l + 2 * f.padding - f.taps) // (q // ss) + 1 >= o // q for l, f, q, ss, o in zip(L, folds, kp, s, out)]
        if all(o >= q for o, q in zip(out, kp)) and all(reach):
            return dict(cin=rng.randint(1, 3), cout=rng.randint(1, 4), k=k, s=s, p=p, op=op, L=L, kp=kp, bias=rng.random() < 0.7)


TRANSPOSED_FOLDS = [_random_transposed_fold(random.Random(20261127 + i), rank) for rank in (1, 2, 3) for i in range((12, 12, 8)[rank - 1])]


@pytest.mark.parametrize("c", TRANSPOSED_FOLDS, ids=lambda c: f"k{c['k']}s{c['s']}p{c['p']}op{c['op']}pool{c['kp']}L{c['L']}".replace(" ", ""))
def test_avg_pool_folds_into_a_transposed_convolution(c):
    """Pooled windows of whole stride periods: one ordinary convolution with stride pool / stride, equal in
    float64 to conv_transposeNd then avg_poolNd (an independent expectation) and to the pipeline as written."""
    rank = len(c["k"])
    conv = {f"conv_transpose{rank}d": {"out_channels": c["cout"], "kernel_size": c["k"], "stride": c["s"], "padding": c["p"],
                                       "output_padding": c["op"], "bias": c["bias"]}}
    p = build(spec_text([c["cin"]] + c["L"], [conv, {f"avg_pool{rank}d": {"kernel_size": c["kp"]}}, "relu"]))
    q, ds = rewrite(p, "avg_pool_folding")
    (d,) = fired(ds, "avg_pool_folding")
    assert "transposed kernel" in d.reason
    f = q.ops[0]
    assert isinstance(f.lowering, Folded) and not f.transposed and not ops_of(q, Pool)
    assert f.stride == tuple(kp // s for kp, s in zip(c["kp"], c["s"]))
    t, x = tensors(p, 5), randn(p, 5)
    y = conv_fn(rank, True)(x, t["conv_transpose.weight"], t.get("conv_transpose.bias"), c["s"], c["p"], c["op"])
    want = torch.relu(getattr(F, f"avg_pool{rank}d")(y, c["kp"]))
    torch.testing.assert_close(run(q, x, t), want, rtol=1e-10, atol=1e-10)
    check_equivalent(p, q, inf=False)


def test_avg_pool_does_not_fold_where_the_transposed_output_padding_needs_more_right_padding():
    conv = {"conv_transpose1d": {"out_channels": 4, "kernel_size": 5, "stride": 2, "padding": 1, "output_padding": 1}}
    p = build(spec_text([3, 3], [conv, {"avg_pool1d": {"kernel_size": 2}}]))
    q, ds = rewrite(p, "avg_pool_folding")
    (d,) = not_fired(ds, "avg_pool_folding")
    assert "folded output size [3] differs from the pool's [4]" in d.reason and q.ops == p.ops


def test_transposed_fold_is_kernelbench_50s_pattern():
    """KernelBench #50: ConvTranspose3d(3 -> 16, k3, s2, p1), x * scale, avg_pool3d(2), + bias, * scale: the factor moves
    past the pool and the pool folds in: a 2 x 2 x 2 convolution of stride 1 over the input (the transposed
    convolution's 31 x 63 x 63 output is never computed); the rewritten pipeline equals the written one in float64."""
    ops = [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}}, {"mul": {"param": "scale1"}},
           {"avg_pool3d": {"kernel_size": 2}}, {"add": {"param": "b"}}, {"mul": {"param": "scale2"}}]
    params = {"scale1": {"shape": [], "init": 0.5}, "b": {"shape": [16, 1, 1, 1], "init": "randn"}, "scale2": {"shape": [], "init": 1.0}}
    p = build(spec_text([3, 4, 6, 6], ops, params=params))
    q, ds = apply_rewrites(p)
    assert {d.rewrite for d in ds if d.fired} == {"affine_through_pooling", "avg_pool_folding"}
    f = q.ops[0]
    assert isinstance(f.lowering, Folded) and f.kernel == (2, 2, 2) and f.stride == (1, 1, 1) and f.padding == (0, 0, 0)
    assert [o.op_name for o in q.ops] == ["conv_transpose3d", "mul", "add", "mul"]
    check_equivalent(p, q, inf=False)


@pytest.mark.parametrize(
    "ops,params",
    [
        ([{"mul": {"scalar": -1.5}}, {"add": {"scalar": 2.0}}], None),
        ([{"div": {"param": "fa"}}, {"sub": {"param": "fb"}}], {"fa": {"shape": [3, 1, 1], "init": "randn"}, "fb": {"shape": [1], "init": "randn"}}),
    ],
)
def test_affine_through_pooling_fires(ops, params):
    conv = {"conv2d": {"out_channels": 3, "kernel_size": 3}}
    p = build(spec_text([2, 11, 10], [conv] + ops + [{"avg_pool2d": {"kernel_size": 2}}, "tanh"], params=params))
    q, ds = rewrite(p, "affine_through_pooling")
    (d,) = fired(ds, "affine_through_pooling")
    assert [o.op_name for o in q.ops] == ["conv2d", "avg_pool2d"] + [o.op_name for o in p.ops[1:-2]] + ["tanh"]
    check_equivalent(p, q, inf=False)


BN_CONVT = {"conv_transpose3d": {"out_channels": 5, "kernel_size": 3, "stride": 2, "padding": 1}}


def _training(ops, shape=(2, 4, 5, 6)):
    """The pipeline as training mode plans it: each batch norm as its batch statistics and an affine."""
    return batch_norm_batch_stats(build(spec_text(list(shape), ops)))


@pytest.mark.parametrize("pools", [[{"avg_pool3d": {"kernel_size": 2}}, {"avg_pool3d": {"kernel_size": 2}}],
                                   [{"avg_pool3d": {"kernel_size": 2}}, "relu"]], ids=["two_pools", "pool_relu"])
def test_batch_stats_pass_fires(pools):
    """KernelBench #72's pattern: the statistics from a pass of their own, the pooled values from the convolution
    again on the input (its src), folded with the pool; equal in float64 to the batch statistics over the full
    output, NaN and inf included (they reach every output through the statistics either way)."""
    p = _training([BN_CONVT, {"batch_norm": {}}] + pools)
    names = ("pool_composition", "batch_stats_pass", "affine_through_pooling", "avg_pool_folding")
    q, ds = rewrite(p, *names)
    (d,) = fired(ds, "batch_stats_pass")
    assert "stores nothing" in d.reason and fired(ds, "avg_pool_folding") and fired(ds, "affine_through_pooling")
    first, stats, again = q.ops[:3]
    assert isinstance(first, Conv) and first.key.endswith(".for_stats") and isinstance(stats, BatchStats)
    assert isinstance(again, LoweredConv) and isinstance(again.lowering, Folded) and again.src == "x"
    assert not ops_of(q, Pool)  # folded: the full output of the second pass is never computed
    check_equivalent(p, q)


@pytest.mark.parametrize("ops, why", [
    ([{"conv3d": {"out_channels": 5, "kernel_size": 3}}, {"batch_norm": {}}, {"avg_pool3d": {"kernel_size": 2}}],
     "not a transposed convolution"),
    (["relu", BN_CONVT, {"batch_norm": {}}, {"avg_pool3d": {"kernel_size": 2}}], "not a named value"),
    ([BN_CONVT, {"batch_norm": {}}, {"avg_pool3d": {"kernel_size": 2, "padding": 1}}], "pool pads"),
    ([BN_CONVT, {"batch_norm": {}}, {"avg_pool3d": {"kernel_size": 3}}], "not a multiple"),
    ([BN_CONVT, {"batch_norm": {}}, {"mul": {"scalar": 2.0}}, "relu", {"avg_pool3d": {"kernel_size": 2}}],
     "not a factor or an offset"),
])
def test_batch_stats_pass_does_not_fire(ops, why):
    """A forward convolution (eager's TF32 rounding is not known), an input the second pass cannot read again,
    a pool that does not fold, a nonlinear op between the statistics and the pool."""
    q, ds = rewrite(_training(ops), "batch_stats_pass")
    (d,) = not_fired(ds, "batch_stats_pass")
    assert why in d.reason and not fired(ds, "batch_stats_pass"), d.reason


def test_affine_through_pooling_before_spatial_reductions():
    """A factor passes a spatial sum (and a mean, with offsets too), kept dims or not for a scalar; an offset does
    not pass a sum; a parameter does not pass a reduction that drops its dims (it would broadcast differently)."""
    conv = {"conv2d": {"out_channels": 3, "kernel_size": 3}}
    per_channel = {"fa": {"shape": [3, 1, 1], "init": "randn"}}
    cases = [
        ([{"mul": {"param": "fa"}}, {"sub": {"scalar": 0.5}}], {"mean": {"dim": [2, 3], "keepdim": True}}, per_channel, True),
        ([{"div": {"scalar": 3.0}}], {"sum": {"dim": [3]}}, None, True),
        ([{"add": {"scalar": 1.0}}], {"sum": {"dim": [2, 3], "keepdim": True}}, None, "an offset"),
        ([{"mul": {"param": "fa"}}], {"mean": {"dim": [2, 3]}}, per_channel, "drops its dims"),
    ]
    for between, red, params, expect in cases:
        p = build(spec_text([2, 9, 8], [conv] + between + [red, "tanh"], params=params))
        q, ds = rewrite(p, "affine_through_pooling")
        (d,) = ds
        if expect is True:
            assert d.fired and [o.op_name for o in q.ops[:2]] == ["conv2d", p.ops[len(between) + 1].op_name], d
            check_equivalent(p, q, inf=False)
        else:
            assert not d.fired and expect in d.reason and q.ops == p.ops, d


@pytest.mark.parametrize(
    "between,pool,params,why",
    [
        ([{"mul": {"param": "fa"}}], {"kernel_size": 2}, {"fa": {"shape": [3, 1, 8], "init": "randn"}}, "varies along the pooled dims"),
        (["relu"], {"kernel_size": 2}, None, "not a factor or an offset"),
        ([{"add": {"scalar": 1.0}}], {"kernel_size": 2, "padding": 1}, None, "pool pads"),
    ],
)
def test_affine_through_pooling_does_not_fire(between, pool, params, why):
    p = build(spec_text([2, 11, 10], [{"conv2d": {"out_channels": 3, "kernel_size": 3}}] + between + [{"avg_pool2d": pool}], params=params))
    q, ds = rewrite(p, "affine_through_pooling")
    (d,) = not_fired(ds, "affine_through_pooling")
    assert why in d.reason and q.ops == p.ops


def _random_summed_conv(rng, rank):
    """A convolution (forward with stride 1 along the summed dims, or transposed without dilation) whose
    output is summed or averaged over a random non-empty subset of its spatial dims, keepdim."""
    while True:
        transposed = rng.random() < 0.5
        k = [rng.randint(1, 4) for _ in range(rank)]
        dims = sorted(rng.sample(range(rank), rng.randint(1, rank)))
        L = [rng.randint(2, 7 if rank < 3 else 5) for _ in range(rank)]
        if transposed:
            s = [rng.randint(1, 3) for _ in range(rank)]
            conv = {"stride": s, "padding": [rng.randint(0, kk - 1) for kk in k],
                    "output_padding": [rng.randint(0, ss - 1) if rng.random() < 0.3 else 0 for ss in s]}
        else:
            conv = {"stride": [1 if d in dims else rng.randint(1, 2) for d in range(rank)],
                    "padding": [rng.randint(0, kk) for kk in k], "dilation": [rng.randint(1, 2) for _ in range(rank)]}
        conv.update(out_channels=rng.randint(1, 4), kernel_size=k, bias=rng.random() < 0.7)
        op = {f"conv{'_transpose' if transposed else ''}{rank}d": conv}
        try:
            p = build(spec_text([rng.randint(1, 3)] + L, [op, {rng.choice(["sum", "mean"]): {"dim": [2 + d for d in dims], "keepdim": True}}, "tanh"]))
        except Exception:
            continue  # an empty output
        return p


SUMMED_CONVS = [_random_summed_conv(random.Random(7100 + i), rank) for rank in (1, 2, 3) for i in range((10, 12, 8)[rank - 1])]


@pytest.mark.parametrize("p", SUMMED_CONVS, ids=lambda p: f"{p.ops[0].describe()}-{p.ops[1].describe()}".replace(" ", ""))
def test_sum_before_conv_random_configurations(p):
    """A sum / mean over spatial dims of a convolution as a convolution of the input's per-tap sums: equal in
    float64 to the pipeline as written on normal data, ties and NaN (inf meets in the input's sums instead)."""
    q, ds = rewrite(p, "sum_before_conv")
    (d,) = fired(ds, "sum_before_conv")
    c = q.ops[0]
    assert isinstance(c.lowering, TapSums) and c.lowering.dims == tuple(x - 2 for x in p.ops[1].dims)
    assert [o.op_name for o in q.ops[1:]] == (["div"] if p.ops[1].fn == "mean" else []) + ["tanh"]
    check_equivalent(p, q, inf=False, must_reach=False)  # a strided or padded convolution may read no injected NaN


def test_sum_before_conv_is_kernelbench_42s_pattern():
    """KernelBench #42 (ConvTranspose2d 64 -> 128 k3 over 512 x 512, then a global mean) in small: the mean becomes
    9 input sums per channel and a matrix product; #44's factor between the convolution and the mean moves after it."""
    conv = {"conv_transpose2d": {"out_channels": 5, "kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1}}
    p = build(spec_text([4, 9, 11], [conv, {"mul": {"scalar": 0.5}}, {"mean": {"dim": [2, 3], "keepdim": True}},
                                      {"mean": {"dim": [2, 3], "keepdim": True}}]))
    q, ds = apply_rewrites(p)
    assert {d.rewrite for d in ds if d.fired} == {"affine_through_pooling", "sum_before_conv"}
    assert isinstance(q.ops[0].lowering, TapSums) and q.ops[0].lowering.rest(q.ops[0].conv) == ()
    check_equivalent(p, q, inf=False)


@pytest.mark.parametrize(
    "conv,red,why",
    [
        ({"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"sum": {"dim": [2, 3]}}, "keepdim false"),
        ({"conv2d": {"out_channels": 4, "kernel_size": 3, "groups": 2}}, {"mean": {"dim": [2], "keepdim": True}}, "groups=2"),
        ({"conv2d": {"out_channels": 3, "kernel_size": 3, "stride": 2}}, {"mean": {"dim": [3], "keepdim": True}}, "stride [2, 2] along a summed dim"),
        ({"conv_transpose2d": {"out_channels": 3, "kernel_size": 2, "dilation": 2}}, {"sum": {"dim": [2], "keepdim": True}}, "dilated transposed"),
    ],
)
def test_sum_before_conv_does_not_fire(conv, red, why):
    p = build(spec_text([2, 11, 10], [conv, red]))
    q, ds = rewrite(p, "sum_before_conv")
    (d,) = not_fired(ds, "sum_before_conv")
    assert why in d.reason and q.ops == p.ops


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_plans_keep_products_that_have_16_bit_kernels(dtype):
    """The convolution of tap sums and the product with summed weight rows run in float32 only: in a 16-bit pipeline
    neither rewrite fires (the decision says why) and the plan is kgen's, not eager's (KernelBench #44 and #14 in
    bfloat16 were eager plans for want of a family that computes the rewritten op)."""
    from kgen.plan import make_plan

    conv = {"conv_transpose2d": {"out_channels": 5, "kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1}}
    mean = {"mean": {"dim": [2, 3], "keepdim": True}}
    linear = [{"linear": {"out_features": 16}}, {"div": {"scalar": 2.0}}, {"sum": {"dim": [1], "keepdim": True}}]
    for text, name in ((spec_text([4, 9, 11], [conv, mean]), "sum_before_conv"),
                       (spec_text([32], linear), "pool_into_linear")):
        p = replace(build(text), dtype=dtype)
        q, ds = rewrite(p, name)
        (d,) = not_fired(ds, name)
        assert f"no {dtype} form" in d.reason or "no 16-bit form" in d.reason
        assert q.ops == p.ops
        plan = make_plan(p)
        assert not plan.eager and plan.stages[0].family.name in ("conv_aten", "linear_aten", "linear_gemm")
        assert fired(rewrite(replace(p, dtype="float32"), name)[1], name)  # (float32 rewrites it)


def test_sum_before_conv_leaves_a_channel_sum_alone():
    p = build(spec_text([2, 8, 8], [{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"sum": {"dim": [1, 2], "keepdim": True}}]))
    q, ds = rewrite(p, "sum_before_conv")
    assert not ds and q.ops == p.ops


# ------------------------------------------------------------------ pool into linear


def _random_summed_product(rng):
    """A linear (bias or not) or a matmul with a parameter (transposed or not) over a rank-2 or rank-3 input,
    random affine ops the sum passes, then a sum or mean over its output features, keepdim."""
    rank = rng.choice([2, 3])
    shape = [rng.randint(1, 4)] * (rank - 2) + [rng.randint(1, 9)]
    k, f = shape[-1], rng.randint(1, 9)
    params = {}
    if rng.random() < 0.5:
        product = {"linear": {"out_features": f, "bias": rng.random() < 0.7}}
    else:
        transpose = rng.random() < 0.5
        params["w"] = {"shape": [f, k] if transpose else [k, f], "init": "randn"}
        product = {"matmul": {"param": "w", "transpose": transpose}}
    between = []
    for n in range(rng.randint(0, 3)):
        fn = rng.choice(["mul", "div", "add", "sub"])
        if fn in ("add", "sub") and rng.random() < 0.5:
            params[f"p{n}"] = {"shape": [f], "init": "randn"}  # a per-feature offset: enters summed
            between.append({fn: {"param": f"p{n}"}})
        elif fn in ("mul", "div") and rank == 3 and rng.random() < 0.5:
            params[f"p{n}"] = {"shape": [shape[0], 1], "init": "randn"}  # a factor constant along the features
            between.append({fn: {"param": f"p{n}"}})
        else:
            between.append({fn: {"scalar": rng.choice([0.5, -1.5, 3.0])}})
    red = {rng.choice(["sum", "mean"]): {"dim": rank - 1 if rng.random() < 0.5 else -1, "keepdim": True}}
    return build(spec_text(shape, [product] + between + [red, "tanh"], params=params))


SUMMED_PRODUCTS = [_random_summed_product(random.Random(8300 + i)) for i in range(16)]


@pytest.mark.parametrize("p", SUMMED_PRODUCTS, ids=lambda p: "-".join(o.describe() for o in p.ops).replace(" ", ""))
def test_pool_into_linear_random_configurations(p):
    """A sum / mean over a product's output features as the product with its weight's rows summed: equal in
    float64 to the pipeline as written on normal data, ties and NaN (an inf input meets the summed weights
    instead of the outputs' inf - inf, so inf cases are left out)."""
    q, ds = rewrite(p, "pool_into_linear")
    (d,) = fired(ds, "pool_into_linear")
    assert isinstance(q.ops[0], PooledProduct) and q.ops[0].window == p.types[1].shape[-1]
    assert q.types[1].shape[-1] == 1
    check_equivalent(p, q, inf=False)


@pytest.mark.parametrize("features,window,tail", [(32, 4, True), (30, 4, True), (12, 3, False), (8, 8, True)])
def test_pool_into_linear_average_pool(features, window, tail):
    """KernelBench #98's form, reshape [N, 1, F], avg_pool1d(k), reshape [N, F // k]: a product with F // k outputs
    (a trailing partial window dropped, as the floor-mode pool drops it); without the second reshape one is kept."""
    ops = [{"linear": {"out_features": features}}, {"reshape": {"shape": [1, features]}}, {"avg_pool1d": {"kernel_size": window}}]
    ops += [{"reshape": {"shape": [features // window]}}, "gelu", {"max": {"dim": 1}}] if tail else ["gelu"]
    p = build(spec_text([10], ops))
    q, ds = rewrite(p, "pool_into_linear")
    (d,) = fired(ds, "pool_into_linear")
    assert isinstance(q.ops[0], PooledProduct) and q.ops[0].window == window
    assert [o.op_name for o in q.ops[1:]] == ["div"] + (["gelu", "max"] if tail else ["reshape", "gelu"])
    check_equivalent(p, q, inf=False)


def test_pool_into_linear_is_kernelbench_51s_pattern():
    """#51: linear, a per-feature subtraction, a mean over the features (keepdim), logsumexp, then a residual add
    of the input: one output per row, the subtraction's parameter summed after it."""
    ops = [{"linear": {"out_features": 24}}, {"sub": {"param": "s"}}, {"mean": {"dim": 1, "keepdim": True}},
           {"logsumexp": {"dim": 1, "keepdim": True}}, {"gelu": {"as": "g"}}, {"add": {"tensor": "g", "from": "x"}}]
    p = build(spec_text([16], ops, params={"s": {"shape": [24], "init": "randn"}}))
    q, ds = apply_rewrites(p)
    assert [d.rewrite for d in ds if d.fired] == ["pool_into_linear"]
    assert [o.describe() for o in q.ops[1:3]] == ["sub(sum over dims [1] of s)", "div(24)"]
    check_equivalent(p, q, inf=False)


@pytest.mark.parametrize(
    "between,red,params,why",
    [
        ([], {"sum": {"dim": 1}}, None, "keepdim false"),
        ([{"mul": {"param": "fa"}}], {"sum": {"dim": 1, "keepdim": True}}, {"fa": {"shape": [6], "init": "randn"}},
         "factor that varies along the features"),
    ],
)
def test_pool_into_linear_does_not_fire(between, red, params, why):
    p = build(spec_text([5], [{"linear": {"out_features": 6}}] + between + [red], params=params))
    q, ds = rewrite(p, "pool_into_linear")
    (d,) = not_fired(ds, "pool_into_linear")
    assert why in d.reason and q.ops == p.ops


@pytest.mark.parametrize("ops", [
    [{"linear": {"out_features": 6}}, "relu", {"sum": {"dim": 1, "keepdim": True}}],  # not affine: no site
    [{"linear": {"out_features": 6}}, {"max": {"dim": 1, "keepdim": True}}],
    [{"linear": {"out_features": 6}}, {"reshape": {"shape": [1, 6]}}, {"max_pool1d": {"kernel_size": 2}}],
    [{"linear": {"out_features": 6}}, {"reshape": {"shape": [1, 6]}}, {"avg_pool1d": {"kernel_size": 2, "padding": 1}}],
    [{"linear": {"out_features": 6}}, {"reshape": {"shape": [1, 6]}}, {"avg_pool1d": {"kernel_size": 3, "stride": 2}}],
])
def test_pool_into_linear_leaves_other_patterns_alone(ops):
    p = build(spec_text([5], ops))
    q, ds = rewrite(p, "pool_into_linear")
    assert not fired(ds, "pool_into_linear") and q.ops == p.ops


def test_avg_pool_folding_ignores_a_max_pool():
    p = build(spec_text([2, 8, 8], [{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"max_pool2d": {"kernel_size": 2}}]))
    q, ds = rewrite(p, "avg_pool_folding")
    assert not fired(ds, "avg_pool_folding") and q.ops == p.ops


# ------------------------------------------------------------------ subpixel_conv_transpose


def _random_conv_transpose(rng, rank):
    while True:
        k = [rng.randint(1, 5) for _ in range(rank)]
        s = [rng.randint(1, kk) for kk in k]
        p = [rng.randint(0, kk - 1) for kk in k]
        L = [rng.randint(3, 7 if rank < 3 else 5) for _ in range(rank)]
        out = [(l - 1) * ss - 2 * pp + kk for l, ss, pp, kk in zip(L, s, p, k)]
        if all(o >= ss for o, ss in zip(out, s)):  # the rewrite's side condition: every phase has outputs
            return dict(
                cin=rng.randint(1, 3), cout=rng.randint(1, 3), k=k, s=s, p=p, L=L, bias=rng.random() < 0.8, out=out
            )


_RNG = random.Random(20240611)
SUBPIXEL_CONFIGS = [_random_conv_transpose(_RNG, rank) for rank in (1, 2, 3) for _ in range((30, 30, 16)[rank - 1])]


def _convt_pipeline(c, tail=(), rewrites=None):
    rank = len(c["k"])
    op = {
        f"conv_transpose{rank}d": {
            "out_channels": c["cout"],
            "kernel_size": c["k"],
            "stride": c["s"],
            "padding": c["p"],
            "bias": c["bias"],
        }
    }
    return build(spec_text([c["cin"]] + c["L"], [op] + list(tail), rewrites=rewrites))


def _check_phases(conv, L, out):
    """Independent invariants of the phase split: every output written once, every kernel tap used once per dim."""
    phases = conv.phases(tuple(L))
    written = conv.conv
    assert sorted(ph.residue for ph in phases) == sorted(itertools.product(*(range(s) for s in written.stride)))
    for d, (k, s, e) in enumerate(zip(written.kernel, written.stride, out)):
        by_r = {ph.residue[d]: ph for ph in phases}
        assert sum(by_r[r].taps[d] for r in range(s)) == k
        for r in range(s):
            assert by_r[r].count[d] == len(range(r, e, s))
    assert sum(math.prod(ph.count) for ph in phases) == math.prod(out)


@pytest.mark.parametrize("c", SUBPIXEL_CONFIGS, ids=lambda c: f"k{c['k']}s{c['s']}p{c['p']}L{c['L']}".replace(" ", ""))
def test_subpixel_random_configurations(c):
    rank = len(c["k"])
    p = _convt_pipeline(c)
    q, ds = rewrite(p, "subpixel_conv_transpose")
    (d,) = fired(ds, "subpixel_conv_transpose")
    n = math.prod(c["s"])
    assert (f"{n} phase" in d.reason) if n > 1 else ("one convolution" in d.reason)
    (conv,) = q.ops
    assert is_subpixel(conv) and conv.crop is None
    assert q.output == p.output and list(q.output.spatial) == c["out"]
    _check_phases(conv, c["L"], c["out"])
    # against torch's transposed convolution directly
    for seed in range(2):
        t, x = tensors(p, seed), randn(p, seed)
        want = conv_fn(rank, True)(x, t["conv_transpose.weight"], t.get("conv_transpose.bias"), tuple(c["s"]), tuple(c["p"]))
        assert_same(run(q, x, t), want)
    check_equivalent(p, q, seeds=(0,), ties=True)


def _pool_after(c, rng):
    """A max pool over the transposed conv's output that usually drops trailing rows."""
    k = [rng.randint(2, min(3, o)) if o >= 2 else 1 for o in c["out"]]
    return {f"max_pool{len(k)}d": {"kernel_size": k}}, k


CROP_CONFIGS = []
_RNG2 = random.Random(77)
while len(CROP_CONFIGS) < 30:
    _c = _random_conv_transpose(_RNG2, _RNG2.choice((1, 2, 2, 3)))
    _pool, _k = _pool_after(_c, _RNG2)
    _c["pool"], _c["pk"] = _pool, _k
    CROP_CONFIGS.append(_c)


@pytest.mark.parametrize("c", CROP_CONFIGS, ids=lambda c: f"k{c['k']}s{c['s']}p{c['p']}L{c['L']}pk{c['pk']}".replace(" ", ""))
def test_subpixel_with_dead_region_crop(c):
    p = _convt_pipeline(c, tail=[c["pool"], {"sum": {"dim": 1}}])
    q, ds = rewrite(p, "subpixel_conv_transpose", "dead_region")
    assert fired(ds, "subpixel_conv_transpose")
    conv = q.ops[0]
    assert is_subpixel(conv)
    # independently: a floor-mode pool with stride = kernel reads the first (out // k) * k rows,
    # and the crop keeps at least one output per phase (stride rows)
    keep = tuple(min(o, max((o // k) * k, s)) for o, k, s in zip(c["out"], c["pk"], c["s"]))
    full = tuple(c["out"])
    dead = 1 - math.prod(keep) / math.prod(full)
    should = keep != full and dead >= DEAD_REGION_MIN_FRACTION
    assert bool(fired(ds, "dead_region")) == should, (keep, full, ds)
    assert conv.crop == (keep if should else None)
    if should:
        _check_phases(conv, c["L"], keep)
        check_input_extent(p.ops[0], conv, randn(p, 0), tensors(p))
    check_equivalent(p, q, seeds=(0, 1))


def test_subpixel_crop_never_below_the_stride():
    """Consumers read (3, 2) of (4, 5) with stride (4, 5): cropping below the stride would
    leave phases with no output, so the crop stops at the stride (here: no crop at all)."""
    c = dict(cin=2, cout=2, k=[4, 5], s=[4, 5], p=[0, 0], L=[1, 1], bias=True)
    p = _convt_pipeline(c, tail=[{"max_pool2d": {"kernel_size": [3, 2]}}])
    assert p.types[1].spatial == (4, 5)
    q, ds = rewrite(p, "subpixel_conv_transpose", "dead_region")
    conv = q.ops[0]
    assert is_subpixel(conv) and conv.crop is None
    assert not fired(ds, "dead_region")
    check_equivalent(p, q)


def test_subpixel_does_not_fire_when_a_phase_would_have_no_output():
    # output size 1 < stride 3: phases 1 and 2 would have nothing to compute
    p_ = _convt_pipeline(dict(cin=2, cout=2, k=[5], s=[3], p=[2], L=[1], bias=True))
    q, ds = rewrite(p_, "subpixel_conv_transpose", "dead_region")
    (d,) = not_fired(ds, "subpixel_conv_transpose")
    assert "shorter than the stride" in d.reason and isinstance(q.ops[0], Conv)
    check_equivalent(p_, q)


def test_dead_region_keeps_one_output_per_subpixel_phase():
    # 9 outputs of which consumers read 1: the crop stops at the stride (3), so every phase keeps one
    tail = [{"max_pool1d": {"kernel_size": 1, "stride": 9}}]
    p_ = _convt_pipeline(dict(cin=2, cout=2, k=[4], s=[3], p=[2], L=[4], bias=True), tail=tail)
    q, ds = rewrite(p_, "subpixel_conv_transpose", "dead_region")
    assert is_subpixel(q.ops[0]) and q.ops[0].crop == (3,)
    check_equivalent(p_, q)


@pytest.mark.parametrize(
    "extra,why",
    [
        ({"output_padding": 1}, "output_padding"),
        ({"dilation": 2}, "dilation"),
        ({"groups": 2}, "groups=2"),
        ({"stride": [2, 4], "kernel_size": [3, 3]}, "exceeds kernel"),
    ],
)
def test_subpixel_does_not_fire(extra, why):
    args = {"out_channels": 4, "kernel_size": 3, "stride": 2, "padding": 1}
    args.update(extra)
    p = build(spec_text([4, 5, 5], [{"conv_transpose2d": args}, {"relu": None}]))
    q, ds = rewrite(p, "subpixel_conv_transpose")
    assert not fired(ds, "subpixel_conv_transpose")
    (d,) = not_fired(ds, "subpixel_conv_transpose")
    assert why in d.reason
    assert q.ops == p.ops and isinstance(q.ops[0], Conv)


def test_subpixel_leaves_ordinary_convs_alone():
    p = build(spec_text([2, 6, 6], [{"conv2d": {"out_channels": 3, "kernel_size": 3, "stride": 2}}]))
    q, ds = rewrite(p, "subpixel_conv_transpose")
    assert not ds and q.ops == p.ops


# ------------------------------------------------------------------ dead_region


@pytest.mark.parametrize(
    "shape,ops,keep",
    [
        ([2, 9, 9], [{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"max_pool2d": {"kernel_size": 2}}], (6, 6)),
        ([2, 10, 12], [{"conv2d": {"out_channels": 3, "kernel_size": 2}}, {"relu": None}, {"avg_pool2d": {"kernel_size": [2, 3]}}], (8, 9)),
        ([3, 23], [{"conv1d": {"out_channels": 2, "kernel_size": 3, "stride": 2}}, {"max_pool1d": {"kernel_size": 3}}], (9,)),
        ([2, 19], [{"conv1d": {"out_channels": 2, "kernel_size": 1}}, {"max_pool1d": {"kernel_size": 2}}], (18,)),  # 5.3% dead
        ([2, 7, 8, 9], [{"conv3d": {"out_channels": 2, "kernel_size": 2, "padding": 1}}, {"max_pool3d": {"kernel_size": [3, 2, 4]}}], (6, 8, 8)),
        (
            [2, 12, 12],
            [{"conv2d": {"out_channels": 3, "kernel_size": 3, "padding": 1}}, {"max_pool2d": {"kernel_size": 3, "stride": 3, "padding": 1}}],
            (11, 11),
        ),
    ],
)
def test_dead_region_fires(shape, ops, keep):
    p = build(spec_text(shape, ops + [{"sum": {"dim": 1}}]))
    q, ds = rewrite(p, "dead_region")
    (d,) = fired(ds, "dead_region")
    assert d.site == p.ops[0].key
    assert q.ops[0].crop == keep and q.ops[1:] == p.ops[1:]
    full = p.types[1].spatial
    assert 1 - math.prod(keep) / math.prod(full) >= DEAD_REGION_MIN_FRACTION
    # the rows past the crop really are dead: poisoning them in the original's conv output changes nothing
    t, x = tensors(p), randn(p, 0)
    with torch.no_grad():
        y = p.ops[0].run(x, t)
        poisoned = y.clone()
        for dim, e in enumerate(keep):
            poisoned.narrow(2 + dim, e, y.shape[2 + dim] - e).fill_(math.nan)
        for op in p.ops[1:]:
            poisoned = op.run(poisoned, t)
    assert torch.isfinite(poisoned).all()
    check_input_extent(p.ops[0], q.ops[0], x, t)
    check_equivalent(p, q)


def test_dead_region_below_the_threshold():
    p = build(spec_text([2, 21], [{"conv1d": {"out_channels": 2, "kernel_size": 1}}, {"max_pool1d": {"kernel_size": 2}}]))
    dead = 1 - 20 / 21
    assert 0 < dead < DEAD_REGION_MIN_FRACTION
    q, ds = rewrite(p, "dead_region")
    assert not fired(ds, "dead_region")
    (d,) = not_fired(ds, "dead_region")
    assert "threshold" in d.reason and q.ops == p.ops and crop_of(q.ops[0]) is None


@pytest.mark.parametrize(
    "tail",
    [
        [{"relu": None}, {"sum": {"dim": [1, 2, 3]}}],
        [{"group_norm": {"num_groups": 1}}, {"max_pool2d": {"kernel_size": 2}}],
        [{"instance_norm": None}, {"avg_pool2d": {"kernel_size": 2}}],
        [{"max": {"dim": [2, 3]}}],
        [{"max_pool2d": {"kernel_size": 3, "stride": 2}}],  # 7 = 3*2 + 1: every row read
        [{"avg_pool2d": {"kernel_size": 2, "ceil_mode": True}}],
    ],
)
def test_dead_region_does_not_fire_when_everything_is_read(tail):
    p = build(spec_text([2, 9, 9], [{"conv2d": {"out_channels": 4, "kernel_size": 3}}] + tail))
    assert p.types[1].spatial == (7, 7)
    q, ds = rewrite(p, "dead_region")
    assert not fired(ds, "dead_region")
    (d,) = not_fired(ds, "dead_region")
    assert "whole output" in d.reason
    assert q.ops == p.ops


def test_dead_region_skips_a_transposed_conv_not_in_subpixel_form():
    c = dict(cin=2, cout=2, k=[3, 3], s=[2, 2], p=[1, 1], L=[4, 4], bias=True)
    p = _convt_pipeline(c, tail=[{"max_pool2d": {"kernel_size": 2}}])
    assert p.types[1].spatial == (7, 7)
    q, ds = rewrite(p, "dead_region")
    (d,) = not_fired(ds, "dead_region")
    assert "sub-pixel" in d.reason and q.ops == p.ops
    q, ds = rewrite(p, "dead_region", "subpixel_conv_transpose")
    assert fired(ds, "dead_region") and q.ops[0].crop == (6, 6)
    check_equivalent(p, q)


def test_dead_region_with_a_folded_conv():
    """avg_pool folding first, then the folded conv is cropped to what a later pool reads."""
    p = build(
        spec_text(
            [2, 11, 11],
            [{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"avg_pool2d": {"kernel_size": 2}}, {"max_pool2d": {"kernel_size": 3}}],
        )
    )
    q, ds = rewrite(p, "avg_pool_folding", "dead_region")
    assert fired(ds, "avg_pool_folding") and fired(ds, "dead_region")
    assert isinstance(q.ops[0].lowering, Folded) and q.ops[0].crop == (3, 3)
    # 3 folded outputs with stride 1*2 and kernel (2-1)*1 + 3 = 4 read the first (3-1)*2 + 4 = 8 input rows
    assert q.ops[0].input_extent((11, 11)) == (8, 8)
    check_input_extent(replace(q.ops[0], crop=None), q.ops[0], randn(p, 0), tensors(p))
    check_equivalent(p, q, inf=False)


def _needed_extent_by_probing(p, t):
    """Per spatial dim of the first op's output: 1 + the last index whose hyperplane, set to NaN, reaches the output."""
    with torch.no_grad():
        x = randn(p, 0)
        y = p.ops[0].run(x, t)
        extents = []
        for d in range(2, y.dim()):
            last = -1
            for j in range(y.shape[d]):
                z = y.clone()
                z.select(d, j).fill_(math.nan)
                for op in p.ops[1:]:
                    z = op.run(z, t)
                if torch.isnan(z).any():
                    last = j
            extents.append(last + 1)
    return tuple(extents)


def _random_pool(rng, rank):
    kind = rng.choice(("max", "avg"))
    k = [rng.randint(1, 4) for _ in range(rank)]
    args = {"kernel_size": k, "stride": [rng.randint(1, 4) for _ in range(rank)]}
    if rng.random() < 0.4:
        args["padding"] = [rng.randint(0, kk // 2) for kk in k]
    if rng.random() < 0.3:
        args["ceil_mode"] = True
    if kind == "max" and rng.random() < 0.3:
        args["dilation"] = [rng.randint(1, 2) for _ in range(rank)]
    if kind == "avg" and rng.random() < 0.5:
        args["count_include_pad"] = False
    return {f"{kind}_pool{rank}d": args}


def _random_dead_region_case(rng):
    rank = rng.choice((1, 2))
    L = [rng.randint(6, 16) for _ in range(rank)]
    conv = {
        f"conv{rank}d": {
            "out_channels": 2,
            "kernel_size": [rng.randint(1, 3) for _ in range(rank)],
            "stride": [rng.randint(1, 2) for _ in range(rank)],
            "padding": [rng.randint(0, 1) for _ in range(rank)],
        }
    }
    ops = [conv]
    if rng.random() < 0.3:
        ops.append({"relu": None})
    ops.append(_random_pool(rng, rank))
    if rng.random() < 0.5:
        ops.append(_random_pool(rng, rank))
    return [2] + L, ops


def _dead_region_cases(n, seed):
    rng, out = random.Random(seed), []
    while len(out) < n:
        shape, ops = _random_dead_region_case(rng)
        try:
            build(spec_text(shape, ops))
        except Exception:
            continue  # the pools do not fit this size
        out.append((shape, ops))
    return out


@pytest.mark.parametrize("shape,ops", _dead_region_cases(40, 5), ids=lambda v: None)
def test_dead_region_random_pool_chains(shape, ops):
    p = build(spec_text(shape, ops))
    t = tensors(p)
    keep = _needed_extent_by_probing(p, t)
    full = p.types[1].spatial
    dead = 1 - math.prod(keep) / math.prod(full)
    should = keep != full and dead >= DEAD_REGION_MIN_FRACTION
    q, ds = rewrite(p, "dead_region")
    crop = crop_of(q.ops[0])
    assert bool(fired(ds, "dead_region")) == (crop is not None)
    if all(all(d == 1 for d in o.dilation) for o in ops_of(p, Pool)):
        # contiguous windows: the extent the pass computes is exactly what the consumers read
        assert bool(fired(ds, "dead_region")) == should, (keep, full, ds)
        assert crop == (keep if should else None)
    elif crop is not None:
        # dilated windows: the pass may keep more (a last tap past the end), never less
        assert all(c >= k for c, k in zip(crop, keep)), (crop, keep)
    check_equivalent(p, q, seeds=(0,), ties=False, must_reach=False)


def test_dead_region_with_a_spatially_varying_parameter():
    p = build(
        spec_text(
            [2, 9, 9],
            [{"conv2d": {"out_channels": 3, "kernel_size": 3}}, {"add": {"param": "b"}}, {"max_pool2d": {"kernel_size": 2}}],
            params={"b": {"shape": [3, 7, 7], "init": "randn"}},
        )
    )
    q, ds = rewrite(p, "dead_region")
    (d,) = not_fired(ds, "dead_region")
    assert "parameter 'b' varies along the spatial dims" in d.reason
    check_equivalent(p, q)


def test_dead_region_does_not_fire_when_a_consumer_refuses_the_cropped_size():
    """Found by the random pipelines: the pool reads 2 of 3 rows (its window starts in the
    padding), but avg_pool3d refuses an input smaller than its kernel."""
    pool = {"avg_pool3d": {"kernel_size": [3, 2, 2], "stride": [3, 1, 1], "padding": [1, 0, 0]}}
    p = build(spec_text([5, 5, 4, 4], [{"conv3d": {"out_channels": 2, "kernel_size": 1, "stride": 2}}, pool, {"mean": {"dim": [2, 3, 4]}}]))
    q, ds = rewrite(p, "dead_region")
    (d,) = not_fired(ds, "dead_region")
    assert "refuses the cropped size" in d.reason and "smaller than the kernel" in d.reason
    assert q.ops == p.ops


def test_dead_region_crop_that_reads_only_padding():
    p = build(spec_text([2, 5], [{"conv1d": {"out_channels": 2, "kernel_size": 1, "padding": 2}}, {"max_pool1d": {"kernel_size": 1, "stride": 9}}]))
    q, ds = rewrite(p, "dead_region")
    assert fired(ds, "dead_region") and q.ops[0].crop == (1,)
    check_equivalent(p, q, must_reach=False)


# ------------------------------------------------------------------ reduction_algebra


@pytest.mark.parametrize(
    "shape,ops,params,union",
    [
        (
            [4, 5, 5],
            [{"adaptive_avg_pool2d": {"output_size": 1}}, {"add": {"param": "bias"}}, {"sum": {"dim": 1}}],
            {"bias": {"shape": [4, 1, 1], "init": "randn"}},
            (1, 2, 3),
        ),
        ([3, 4, 6], [{"mean": {"dim": [2, 3], "keepdim": True}}, {"sum": {"dim": 1, "keepdim": True}}], None, (1, 2, 3)),
        (
            [3, 4, 6],
            [
                {"mean": {"dim": 3, "keepdim": True}},
                {"mul": {"scalar": 3.0}},
                {"add": {"scalar": 1.5}},
                {"sub": {"param": "b"}},
                {"div": {"scalar": -2.0}},
                {"sum": {"dim": [1, 2], "keepdim": True}},
            ],
            {"b": {"shape": [3, 4, 1], "init": "randn"}},
            (1, 2, 3),
        ),
        (
            [5, 3, 4, 2],
            [{"adaptive_avg_pool3d": {"output_size": 1}}, {"sub": {"scalar": 0.25}}, {"add": {"param": "c"}}, {"sum": {"dim": 1}}],
            {"c": {"shape": [5, 1, 1, 1], "init": "randn"}},
            (1, 2, 3, 4),
        ),
        ([6, 5], [{"mean": {"dim": 2, "keepdim": True}}, {"div": {"scalar": 4.0}}, {"sum": {"dim": 1}}], None, (1, 2)),
    ],
)
def test_reduction_algebra_fires(shape, ops, params, union):
    p = build(spec_text(shape, [{"relu": None}] + ops, params=params))
    q, ds = rewrite(p, "reduction_algebra")
    (d,) = fired(ds, "reduction_algebra")
    reduces = ops_of(q, Reduce)
    assert len(ops_of(p, Reduce)) == 2 and len(reduces) == 1
    assert reduces[0].fn == "sum" and reduces[0].dims == union
    assert q.output == p.output
    for e in ops_of(q, Elementwise):
        if e.param is not None:
            assert e.param_sum_dims  # a parameter now enters summed over the sum's dims
    check_equivalent(p, q, inf=False)


@pytest.mark.parametrize(
    "ops,params,why",
    [
        ([{"mean": {"dim": [2, 3]}}, {"sum": {"dim": 1}}], None, "keepdim"),
        (
            [{"mean": {"dim": [2, 3], "keepdim": True}}, {"mul": {"param": "m"}}, {"sum": {"dim": 1}}],
            {"m": {"shape": [4, 1, 1], "init": "randn"}},
            "not a scalar factor",
        ),
        ([{"mean": {"dim": [2, 3], "keepdim": True}}, {"sigmoid": None}, {"sum": {"dim": 1}}], None, "not affine"),
        ([{"adaptive_avg_pool2d": {"output_size": 1}}, {"relu": None}, {"sum": {"dim": 1}}], None, "not affine"),
        (
            [{"mean": {"dim": 3, "keepdim": True}}, {"add": {"param": "b"}}, {"sum": {"dim": 1}}],
            {"b": {"shape": [5, 1], "init": "randn"}},
            "varies along dims [2]",
        ),
        ([{"mean": {"dim": [1, 2], "keepdim": True}}, {"sum": {"dim": [2, 3]}}], None, "share dims"),
    ],
)
def test_reduction_algebra_does_not_fire(ops, params, why):
    p = build(spec_text([4, 5, 6], ops, params=params))
    q, ds = rewrite(p, "reduction_algebra")
    assert not fired(ds, "reduction_algebra")
    (d,) = not_fired(ds, "reduction_algebra")
    assert why in d.reason
    assert q.ops == p.ops


@pytest.mark.parametrize(
    "pshape,sum_dims",
    [([1, 1, 1], [1]), ([4, 1, 1], [1, 2])],
)
def test_reduction_algebra_with_a_parameter_broadcast_along_the_summed_dims(pshape, sum_dims):
    p = build(
        spec_text(
            [4, 5, 6],
            [{"mean": {"dim": 3, "keepdim": True}}, {"add": {"param": "b"}}, {"sum": {"dim": sum_dims}}],
            params={"b": {"shape": pshape, "init": "randn"}},
        )
    )
    q, ds = rewrite(p, "reduction_algebra")
    assert fired(ds, "reduction_algebra")
    check_equivalent(p, q, inf=False)


# ------------------------------------------------------------------ the shipped specs


SHIPPED_FIRED = {
    "maxpool_sum": {"pool_composition", "subpixel_conv_transpose", "dead_region"},
    "div_max_gap_bias_sum": {"scalar_through_max", "reduction_algebra"},
    "avgpool_sigmoid_sum": {"avg_pool_folding"},
    "relu_group_norm": {"subpixel_conv_transpose"},
    "instnorm_clamp_max": set(),
}


@pytest.mark.parametrize("name", sorted(SHIPPED_FIRED))
def test_shipped_spec_rewrites(name):
    p = load_pipeline(ROOT / "specs" / f"{name}.yaml")
    assert all(p.rewrites.values())
    q, ds = apply_rewrites(p)
    assert {d.rewrite for d in ds if d.fired} == SHIPPED_FIRED[name]
    assert q.output == p.output
    if not SHIPPED_FIRED[name]:
        assert q.ops == p.ops
    if name == "relu_group_norm":
        conv = q.ops[0]
        assert conv.conv.stride == (1, 1, 1) and is_subpixel(conv)
        (phase,) = conv.phases(p.types[0].spatial)
        assert phase.taps == conv.conv.kernel
    if name == "maxpool_sum":
        conv, pool = q.ops[0], q.ops[1]
        full = (32 - 1) * 2 - 2 * 2 + 5  # conv_transpose3d k=5 s=2 p=2 on 32: 63
        keep = (full // 2 // 3) * 3 * 2  # max_pool 2 then 3 (floor) read 60 of the 63
        assert p.types[1].spatial == (full,) * 3
        assert is_subpixel(conv) and conv.crop == (keep,) * 3
        assert pool.kernel == (6, 6, 6)
    # float64 equivalence at batch 1
    with torch.no_grad():
        t, x = tensors(p, 0), randn(p, 0, batch=1)
        want = run(p, x, t)
        assert torch.isfinite(want).all()
        assert_same(run(q, x, t), want)


# ------------------------------------------------------------------ switching rewrites off


_FOLD_THEN_POOLS = dict(
    shape=[3, 10, 10],
    ops=[
        {"conv2d": {"out_channels": 4, "kernel_size": 3}},
        {"avg_pool2d": {"kernel_size": 2}},
        {"max_pool2d": {"kernel_size": 2}},
        {"max_pool2d": {"kernel_size": 2}},
    ],
)


def test_all_rewrites_switched_off():
    p = build(spec_text(**_FOLD_THEN_POOLS, rewrites=False))
    assert not any(p.rewrites.values())
    q, ds = apply_rewrites(p)
    assert not any(d.fired for d in ds)
    assert {d.rewrite for d in ds} == {n for n, _ in REWRITES}
    assert all("switched off" in d.reason for d in ds)
    assert q.ops == p.ops


def test_one_rewrite_switched_off():
    on = build(spec_text(**_FOLD_THEN_POOLS))
    _, ds_on = apply_rewrites(on)
    assert {d.rewrite for d in ds_on if d.fired} == {"avg_pool_folding", "pool_composition"}

    p = build(spec_text(**_FOLD_THEN_POOLS, rewrites={"avg_pool_folding": False}))
    assert p.rewrites == {n: n != "avg_pool_folding" for n in REWRITE_NAMES}
    q, ds = apply_rewrites(p)
    (off,) = [d for d in ds if d.rewrite == "avg_pool_folding"]
    assert not off.fired and "switched off" in off.reason and "avg_pool_folding" in off.reason
    assert {d.rewrite for d in ds if d.fired} == {"pool_composition"}
    assert q.ops[0] == p.ops[0] and isinstance(q.ops[0], Conv)
    assert q.ops[1] == p.ops[1]  # the avg pool is still there
    assert [o.kernel for o in ops_of(q, Pool)] == [(2, 2), (4, 4)]
    check_equivalent(p, q, inf=True)


# ------------------------------------------------------------------ batch norm in eval mode


@pytest.mark.parametrize("shape, affine, conv", [
    ([6], True, None),  # BatchNorm1d over [N, C]
    ([5, 7], False, None),  # BatchNorm1d over [N, C, L], no affine
    ([3, 9, 9], True, {"conv2d": {"out_channels": 4, "kernel_size": 3}}),
    ([2, 5, 6, 6], True, {"conv3d": {"out_channels": 3, "kernel_size": 2}}),
])
def test_batch_norm_eval_affine_is_eval_mode(shape, affine, conv):
    """The per-channel affine over the running statistics is eval mode's batch norm, in float64, for
    every rank; then the other rewrites move it through an average pool (it is per channel)."""
    ops = ([conv] if conv else []) + [{"batch_norm": {"eps": 1e-3, "affine": affine}}]
    pooled = conv is not None
    if pooled:
        ops.append({"avg_pool2d" if len(shape) == 3 else "avg_pool3d": {"kernel_size": 2}})
    p = build(spec_text(shape, ops))
    t = tensors(p, 5)
    g = torch.Generator().manual_seed(7)
    c = next(op for op in p.ops if op.op_name == "batch_norm").num_features
    t["batch_norm.running_mean"] = torch.randn(c, dtype=F64, generator=g)
    t["batch_norm.running_var"] = torch.rand(c, dtype=F64, generator=g) + 0.1
    if affine:
        t["batch_norm.weight"] = torch.randn(c, dtype=F64, generator=g)
        t["batch_norm.bias"] = torch.randn(c, dtype=F64, generator=g)
    e = batch_norm_eval_affine(p)
    assert [op.fn for op in e.ops if isinstance(op, Elementwise)] == ["sub", "mul"] + (["add"] if affine else [])
    assert e.members() == p.members() and e.tensor_args() == p.tensor_args() and e.buffer_args() == p.buffer_args()
    x = randn(p, 5)
    want = run(p, x, t)
    torch.testing.assert_close(run(e, x, t), want, rtol=1e-12, atol=1e-12)
    if pooled:
        r, decisions = rewrite(e, "affine_through_pooling", "avg_pool_folding")
        assert fired(decisions, "affine_through_pooling")
        torch.testing.assert_close(run(r, x, t), want, rtol=1e-10, atol=1e-10)
    # the derived scale as the generated binding computes it (kgen_runtime.h: batch_norm_scale)
    scale = e.with_derived(t)["batch_norm.eval_scale"]
    w = t["batch_norm.weight"] if affine else 1.0
    torch.testing.assert_close(scale, w / torch.sqrt(t["batch_norm.running_var"] + 1e-3), rtol=0, atol=0)


def test_batch_norm_eval_affine_needs_running_statistics():
    """A batch norm without running statistics uses the batch's in both modes: nothing to rewrite."""
    p = build(spec_text([4, 5, 5], [{"batch_norm": {"track_running_stats": False}}]))
    assert batch_norm_eval_affine(p) is None
    q = build(spec_text([4, 5, 5], [{"relu": {}}]))
    assert batch_norm_eval_affine(q) is None


def _drawn_chain_spec(rng) -> str:
    """A pipeline over [N, 3, 4, 4] of elementwise ops, names and their reuse as operands (``x + x`` right after a
    name too), restarts from earlier names, sums broadcast back and transposes: the sites the operand and permute
    rewrites look for, and their near misses."""
    ops, names = [], []
    for k in range(rng.randint(4, 9)):
        roll = rng.random()
        if roll < 0.12:  # NetVLAD's form: a chain computed aside, read once after a view of the value before it
            ops.append({"neg": {"as": f"before{k}"}})
            ops.append({rng.choice(("exp", "tanh", "relu")): {"from": rng.choice(("x", "y")), "as": f"aside{k}"}})
            if rng.random() < 0.5:
                ops.append({"mul": {"scalar": 0.5}})
                ops[-2] = {next(iter(ops[-2])): {"from": next(iter(ops[-2].values()))["from"]}}
                ops[-1]["mul"]["as"] = f"aside{k}"
            ops.append({"transpose": {"dim0": 2, "dim1": 3, "from": f"before{k}"}})
            ops.append({rng.choice(("add", "mul", "sub", "div")): {"tensor": f"aside{k}"}})
            continue
        if roll < 0.3 and names:
            ops.append({rng.choice(("add", "mul", "sub", "div", "maximum")): {"tensor": rng.choice(names)}})
        elif roll < 0.35 and names:
            ops.append({rng.choice(("relu", "exp", "tanh", "neg")): {"from": rng.choice(names + ["x", "y"])}})
        elif roll < 0.45:
            ops.append({"transpose": {"dim0": 2, "dim1": 3}})
        elif roll < 0.52:
            ops.append({"sum": {"dim": rng.choice(([2], [3], [2, 3])), "keepdim": True}})
            ops.append({"expand": {"shape": [3, 4, 4]}})
        elif roll < 0.6:
            ops.append({rng.choice(("add", "mul")): {"tensor": "y"}})
        else:
            ops.append(rng.choice(("relu", "tanh", "sigmoid", "neg", {"mul": {"scalar": 1.5}}, {"add": {"scalar": -0.5}})))
        if rng.random() < 0.4:
            name = f"v{k}"
            ops[-1] = {ops[-1]: {}} if isinstance(ops[-1], str) else ops[-1]
            next(iter(ops[-1].values()))["as"] = name
            names.append(name)
    return yaml.safe_dump({"name": "drawn", "inputs": {"x": {"shape": ["N", 3, 4, 4]}, "y": {"shape": ["N", 3, 4, 4]}},
                           "example": {"N": 2}, "ops": ops}, sort_keys=False)


def test_drawn_chains_compute_the_same_values_after_the_operand_and_permute_rewrites():
    """Seeded draws of named values reused as operands around transposes and broadcast sums: wherever
    commute_operand_chain or permute_before_elementwise fires, the rewritten pipeline computes the original's
    values in float64 (a rewrite that read the wrong value, as x + x once did, fails here). The draws must fire
    each rewrite."""
    names = ("commute_operand_chain", "permute_before_elementwise")
    rng, counts = random.Random(4242), dict.fromkeys(names, 0)
    for i in range(300):
        text = _drawn_chain_spec(rng)
        try:
            pipe = build(text)
        except Exception:  # noqa: BLE001 - a draw that does not fit (a name read before it is made, ...)
            continue
        new, ds = rewrite(pipe, *names)
        if not any(d.fired for d in ds):
            continue
        for n in names:
            counts[n] += bool(fired(ds, n))
        g = torch.Generator().manual_seed(i)
        x, y = (torch.randn(2, 3, 4, 4, dtype=F64, generator=g) for _ in range(2))
        with torch.no_grad():
            want, got = pipe.run(x, {}, {"y": y}), new.run(x, {}, {"y": y})
        assert_same(got, want), text
    assert all(c >= 5 for c in counts.values()), counts
