"""Shape inference agrees with PyTorch, over many seeded random configurations.

Every configuration becomes a spec text (input ``[N, C, ...]``, one op or a short
chain); kgen's inferred types (``build_pipeline(parse_spec(...)).types``, batch = the
symbol ``N``) are compared with the shapes PyTorch produces running the same ops on
a real batch-2 tensor. Where PyTorch refuses a configuration (output too small,
groups that do not divide, output_padding too large, ...) kgen must refuse it too,
with a SpecError keyed on the op PyTorch failed at; where PyTorch runs it, kgen
must accept it with the same shape after every op.

Finally ReferenceModel (float64) is compared with the same ops written directly
with torch.nn.functional.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kgen.errors import SpecError
from kgen.ir import build_pipeline
from kgen.reference import ReferenceModel
from kgen.spec import parse_spec

BATCH = 2
CONFIGS = 200
PATH = "random/shape_test.yaml"
# per spatial rank: the largest input size, so that random kernels fit often but not always
MAX_SIZE = {1: 14, 2: 9, 3: 6}
TORCH_REFUSES = (RuntimeError, ValueError)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: a thread pool makes each op ~100x slower here; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- spec text


def spec_text(input_shape, ops) -> str:
    """A spec for an input of ``input_shape`` (its batch becomes the symbol N) and ``ops``.

    Written in YAML flow style (JSON), one op a line.
    """
    shape = json.dumps(["N", *input_shape[1:]])
    lines = ["name: shape_test", f'input: {{shape: {shape}, dtype: float32, example: {{N: {BATCH}}}}}', "ops:"]
    lines += [f"  - {json.dumps(op)}" for op in ops]
    return "\n".join(lines) + "\n"


def _field(rng, values):
    """A per-dim field as the spec writes it: a bare int when all dims agree (sometimes), else a list."""
    values = list(values)
    if len(set(values)) == 1 and rng.random() < 0.6:
        return values[0]
    return values


def _maybe(rng, fields, name, value, default):
    """Set ``name`` unless it equals the default and the coin says leave it out."""
    if value != default or rng.random() < 0.5:
        fields[name] = value


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------- op generators
#
# Each takes (rng, shape of the torch tensor it applies to) and returns
# (spec entry, function applying the op to a torch tensor).


def gen_conv(rng, shape, transposed=False):
    rank = len(shape) - 2
    cin = shape[1]
    groups = rng.choice(_divisors(cin)) if rng.random() < 0.9 else rng.randint(1, 4)
    cout = groups * rng.randint(1, 3) if rng.random() < 0.9 else rng.randint(1, 6)
    k = [rng.randint(1, 4) for _ in range(rank)]
    s = [rng.randint(1, 3) for _ in range(rank)]
    p = [rng.randint(0, 2) for _ in range(rank)]
    d = [rng.randint(1, 2) for _ in range(rank)]
    bias = rng.random() < 0.5
    kind = f"conv_transpose{rank}d" if transposed else f"conv{rank}d"
    f = {"out_channels": cout, "kernel_size": _field(rng, k)}
    _maybe(rng, f, "stride", _field(rng, s), 1)
    _maybe(rng, f, "padding", _field(rng, p), 0)
    _maybe(rng, f, "dilation", _field(rng, d), 1)
    _maybe(rng, f, "groups", groups, 1)
    _maybe(rng, f, "bias", bias, True)
    if transposed:
        # mostly legal (< max(stride, dilation)), sometimes exactly the limit PyTorch refuses
        op = [rng.randrange(max(si, di)) if rng.random() < 0.9 else max(si, di) for si, di in zip(s, d)]
        _maybe(rng, f, "output_padding", _field(rng, op), 0)

        def run(x):
            m = getattr(nn, f"ConvTranspose{rank}d")(cin, cout, k, s, p, op, groups, bias, d)
            return m(x)

    else:

        def run(x):
            return getattr(nn, f"Conv{rank}d")(cin, cout, k, s, p, d, groups, bias)(x)

    return {kind: f}, run


def gen_conv_transpose(rng, shape):
    return gen_conv(rng, shape, transposed=True)


def gen_pool(rng, shape, kind):
    rank = len(shape) - 2
    k = [rng.randint(1, 4) for _ in range(rank)]
    stride = None if rng.random() < 0.3 else [rng.randint(1, 3) for _ in range(rank)]
    p = [rng.randint(0, ki // 2) for ki in k]  # PyTorch: padding at most half the kernel
    ceil_mode = rng.random() < 0.5
    if kind == "avg" and rank == 3 and any(ki > li for ki, li in zip(k, shape[2:])):
        # PyTorch's avg_pool3d also refuses an unpadded input smaller than the kernel, which kgen
        # does not check (test_avg_pool3d_input_smaller_than_kernel). Where the kernel is larger,
        # drop the padding and ceil_mode that could make it fit: then both must refuse.
        p = [0 if ki > li else pi for ki, li, pi in zip(k, shape[2:], p)]
        ceil_mode = False
    f = {"kernel_size": _field(rng, k)}
    if stride is not None:
        f["stride"] = _field(rng, stride)
    _maybe(rng, f, "padding", _field(rng, p), 0)
    _maybe(rng, f, "ceil_mode", ceil_mode, False)
    if kind == "max":
        d = [rng.randint(1, 2) for _ in range(rank)]
        _maybe(rng, f, "dilation", _field(rng, d), 1)
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[rank - 1]

        def run(x):
            return fn(x, k, stride, p, d, ceil_mode)

    else:
        cip = rng.random() < 0.5
        _maybe(rng, f, "count_include_pad", cip, True)
        fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[rank - 1]

        def run(x):
            return fn(x, k, stride, p, ceil_mode, cip)

    return {f"{kind}_pool{rank}d": f}, run


def gen_max_pool(rng, shape):
    return gen_pool(rng, shape, "max")


def gen_avg_pool(rng, shape):
    return gen_pool(rng, shape, "avg")


def gen_adaptive(rng, shape):
    rank = len(shape) - 2
    size = rng.choice([1, [1] * rank])
    fn = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[rank - 1]
    return {f"adaptive_avg_pool{rank}d": {"output_size": size}}, lambda x: fn(x, 1)


def gen_reduce(rng, shape):
    rank = len(shape)
    kind = rng.choice(["sum", "mean", "max"])
    dims = rng.sample(range(1, rank), rng.randint(1, rank - 1))  # random order, never the batch
    written = [dim - rank if rng.random() < 0.3 else dim for dim in dims]  # some negative
    keepdim = rng.random() < 0.5
    f = {"dim": written[0] if len(written) == 1 and rng.random() < 0.5 else written}
    _maybe(rng, f, "keepdim", keepdim, False)
    torch_fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax}[kind]
    return {kind: f}, lambda x: torch_fn(x, dim=tuple(written), keepdim=keepdim)


def gen_elementwise(rng, shape):
    kind = rng.choice(["relu", "sigmoid", "add", "mul"])
    if kind in ("relu", "sigmoid"):
        return kind, getattr(torch, kind)
    return {kind: {"scalar": 0.5}}, (lambda x: x + 0.5) if kind == "add" else (lambda x: x * 0.5)


def random_input(rng, rank):
    return (BATCH, rng.randint(1, 6)) + tuple(rng.randint(1, MAX_SIZE[rank]) for _ in range(rank))


# ---------------------------------------------------------------- the comparison


def compare(input_shape, steps):
    """Run ``steps`` (spec entry, torch fn) in PyTorch and through kgen.

    Returns "ok" (both run, same shape after every op), "refused" (both refuse, kgen at
    the op PyTorch failed at, on one line), or else a text describing the disagreement.
    """
    text = spec_text(input_shape, [entry for entry, _ in steps])
    x = torch.zeros(input_shape)
    torch_shapes, refused_at, why = [], None, None
    for i, (_, fn) in enumerate(steps):
        try:
            x = fn(x)
        except TORCH_REFUSES as e:
            refused_at, why = i, str(e).splitlines()[0]
            break
        if x.numel() == 0:  # kgen refuses empty outputs by design; count this as a refusal
            refused_at, why = i, f"empty output {tuple(x.shape)}"
            break
        torch_shapes.append(tuple(x.shape))
    try:
        pipe = build_pipeline(parse_spec(text, PATH))
    except SpecError as e:
        msg = str(e)
        if refused_at is None:
            return f"kgen refuses what PyTorch runs (shapes {torch_shapes}):\n{text}kgen: {msg}"
        if not e.key.startswith(f"ops[{refused_at}]") or "\n" in msg or not msg.startswith(f"{PATH}: ops[{refused_at}]"):
            return f"PyTorch refuses op {refused_at} ({why}) but kgen says:\n{msg}\n{text}"
        return "refused"
    if refused_at is not None:
        return f"kgen accepts what PyTorch refuses at op {refused_at} ({why}):\n{text}kgen types: {[str(t) for t in pipe.types]}"
    kgen_shapes = [t.shape for t in pipe.types[1:]]
    if pipe.types[0].shape != ("N",) + tuple(input_shape[1:]):
        return f"kgen input type {pipe.types[0]} for {input_shape}:\n{text}"
    if len(kgen_shapes) != len(torch_shapes):
        return f"{len(kgen_shapes)} kgen types for {len(torch_shapes)} ops:\n{text}"
    for i, (k, t) in enumerate(zip(kgen_shapes, torch_shapes)):
        if k[0] != "N" or t[0] != BATCH or tuple(k[1:]) != t[1:]:
            return f"op {i}: kgen infers {list(k)}, PyTorch gives {list(t)}:\n{text}"
    return "ok"


def run_family(seed: str, make_config, configs=CONFIGS, min_ok=0.4, min_refused=0):
    rng = random.Random(seed)
    outcomes = {"ok": 0, "refused": 0}
    problems = []
    for _ in range(configs):
        input_shape, steps = make_config(rng)
        result = compare(input_shape, steps)
        if result in outcomes:
            outcomes[result] += 1
        else:
            problems.append(result)
    assert not problems, f"{len(problems)} of {configs} configurations disagree; first ones:\n\n" + "\n\n".join(problems[:3])
    # the generator must exercise both sides of the question, or the test proves little
    assert outcomes["ok"] >= min_ok * configs, outcomes
    assert outcomes["refused"] >= min_refused, outcomes
    return outcomes


def single(gen, rank):
    def make(rng):
        shape = random_input(rng, rank)
        return shape, [gen(rng, shape)]

    return make


# ---------------------------------------------------------------- families

RANKS = [1, 2, 3]


@pytest.mark.parametrize("rank", RANKS)
def test_conv(rank):
    run_family(f"conv{rank}d", single(gen_conv, rank), min_refused=10)


@pytest.mark.parametrize("rank", RANKS)
def test_conv_transpose(rank):
    run_family(f"conv_transpose{rank}d", single(gen_conv_transpose, rank), min_refused=10)


@pytest.mark.parametrize("rank", RANKS)
def test_max_pool(rank):
    run_family(f"max_pool{rank}d", single(gen_max_pool, rank), min_refused=5)


@pytest.mark.parametrize("rank", RANKS)
def test_avg_pool(rank):
    run_family(f"avg_pool{rank}d", single(gen_avg_pool, rank), min_refused=5)


@pytest.mark.parametrize("rank", RANKS)
def test_adaptive_avg_pool(rank):
    outcomes = run_family(f"adaptive{rank}d", single(gen_adaptive, rank))
    assert outcomes["refused"] == 0


@pytest.mark.parametrize("rank", RANKS)
def test_reductions(rank):
    outcomes = run_family(f"reduce{rank}d", single(gen_reduce, rank))
    assert outcomes["refused"] == 0


def _random_chain(rng):
    """2 to 4 ops; each is drawn for the shape PyTorch actually has at that point."""
    rank = rng.choice(RANKS)
    shape = random_input(rng, rank)
    x = torch.zeros(shape)
    steps = []
    for _ in range(rng.randint(2, 4)):
        spatial = x.dim() - 2
        if spatial in RANKS:
            gen = rng.choice([gen_conv, gen_conv_transpose, gen_max_pool, gen_avg_pool, gen_adaptive, gen_reduce, gen_elementwise])
        elif x.dim() >= 2:  # channels left, no spatial op of this rank
            gen = rng.choice([gen_reduce, gen_elementwise])
        else:
            gen = gen_elementwise
        entry, fn = gen(rng, tuple(x.shape))
        (kind, fields), = entry.items() if isinstance(entry, dict) else [(entry, None)]
        if kind.startswith("conv"):
            fields["name"] = f"conv_{len(steps)}"  # two convs would both default to 'conv'
        steps.append((entry, fn))
        try:
            x = fn(x)
        except TORCH_REFUSES:
            break  # the chain ends where PyTorch refuses; kgen must refuse the same op
        if x.numel() == 0:
            break
    return shape, steps


def test_chains():
    run_family("chains", _random_chain, configs=300, min_ok=0.3, min_refused=10)


def test_compare_detects_a_wrong_shape():
    """The harness itself: a torch function that differs from the spec must be reported."""
    shape = (BATCH, 3, 8, 8)
    entry = {"max_pool2d": {"kernel_size": 2}}
    assert compare(shape, [(entry, lambda x: F.max_pool2d(x, 2))]) == "ok"
    assert "kgen infers" in compare(shape, [(entry, lambda x: F.max_pool2d(x, 3))])
    assert "kgen accepts" in compare(shape, [(entry, lambda x: F.max_pool2d(x, 9))])
    assert "kgen refuses" in compare(shape, [({"max_pool2d": {"kernel_size": 9}}, lambda x: F.max_pool2d(x, 2))])
    assert compare(shape, [({"max_pool2d": {"kernel_size": 9}}, lambda x: F.max_pool2d(x, 9))]) == "refused"


# ---------------------------------------------------------------- edges PyTorch draws precisely


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_pool_ceil_mode_edges(ceil_mode):
    """Every small (size, kernel, stride, padding) for max_pool1d and avg_pool1d, exhaustively."""
    problems = []
    for size in range(1, 9):
        for k in range(1, 5):
            for s in range(1, 5):
                for p in range(0, k // 2 + 1):
                    shape = (BATCH, 2, size)
                    for kind, fn in (("max", F.max_pool1d), ("avg", F.avg_pool1d)):
                        entry = {f"{kind}_pool1d": {"kernel_size": k, "stride": s, "padding": p, "ceil_mode": ceil_mode}}
                        r = compare(shape, [(entry, lambda x, fn=fn: fn(x, k, s, p, ceil_mode=ceil_mode))])
                        if r not in ("ok", "refused"):
                            problems.append(r)
    assert not problems, "\n\n".join(problems[:3])


def test_max_pool_padding_limit_matches_pytorch():
    """PyTorch allows padding up to half of the kernel size, dilation or not.

    kgen bug: Pool.infer compares the padding with half of the *dilated* kernel extent
    (2 * p > d * (k - 1) + 1), so e.g. kernel 3, dilation 2, padding 2 passes kgen while
    PyTorch raises "pad should be smaller than or equal to half of kernel size".
    """
    problems = []
    for k in range(1, 5):
        for d in range(1, 4):
            for p in range(0, 4):
                entry = {"max_pool2d": {"kernel_size": k, "stride": 1, "padding": p, "dilation": d}}
                r = compare((BATCH, 2, 12, 12), [(entry, lambda x, k=k, d=d, p=p: F.max_pool2d(x, k, 1, p, d))])
                if r not in ("ok", "refused"):
                    problems.append(f"k={k} d={d} p={p}: " + r.splitlines()[0])
    assert not problems, "\n".join(problems)


def test_avg_pool_padding_limit_matches_pytorch():
    problems = []
    for k in range(1, 6):
        for p in range(0, 4):
            entry = {"avg_pool3d": {"kernel_size": [k, 1, k], "padding": [p, 0, p]}}
            r = compare((BATCH, 2, 7, 3, 7), [(entry, lambda x, k=k, p=p: F.avg_pool3d(x, (k, 1, k), None, (p, 0, p)))])
            if r not in ("ok", "refused"):
                problems.append(f"k={k} p={p}: " + r.splitlines()[0])
    assert not problems, "\n".join(problems)


def test_avg_pool3d_input_smaller_than_kernel():
    """PyTorch's avg_pool3d refuses an input smaller than the kernel, even when padding makes it fit.

    kgen bug: Pool.infer applies only the output-size rule, so this spec passes build_pipeline
    while F.avg_pool3d raises "input image (T: 2 H: 4 W: 4) smaller than kernel size (kT: 3 ...)".
    (avg_pool1d/2d and max_pool3d do not have this rule.)
    """
    shape = (BATCH, 2, 2, 4, 4)
    entry = {"avg_pool3d": {"kernel_size": 3, "stride": 1, "padding": 1}}
    r = compare(shape, [(entry, lambda x: F.avg_pool3d(x, 3, 1, 1))])
    assert r == "refused", r


def test_pool_input_smaller_than_kernel_otherwise_follows_output_size():
    """The same padded-fits case for the pools that have no such rule: both accept."""
    cases = [
        ((BATCH, 2, 2, 4, 4), {"max_pool3d": {"kernel_size": 3, "stride": 1, "padding": 1}}, lambda x: F.max_pool3d(x, 3, 1, 1)),
        ((BATCH, 2, 2, 4), {"avg_pool2d": {"kernel_size": 3, "stride": 1, "padding": 1}}, lambda x: F.avg_pool2d(x, 3, 1, 1)),
        ((BATCH, 2, 2), {"avg_pool1d": {"kernel_size": 3, "stride": 1, "padding": 1}}, lambda x: F.avg_pool1d(x, 3, 1, 1)),
    ]
    for shape, entry, fn in cases:
        assert compare(shape, [(entry, fn)]) == "ok", entry


def test_instance_norm_needs_more_than_one_spatial_element():
    """PyTorch's instance_norm refuses a 1x1 spatial input; kgen must not accept it.

    kgen bug: Norm.infer only checks channels, so instance_norm after a global pool
    passes build_pipeline and the reference model fails at run time with
    "Expected more than 1 spatial element when training".
    """
    shape = (BATCH, 3, 5, 5)
    steps = [
        ({"adaptive_avg_pool2d": {"output_size": 1}}, lambda x: F.adaptive_avg_pool2d(x, 1)),
        ("instance_norm", lambda x: F.instance_norm(x)),
    ]
    assert compare(shape, steps) == "refused"


# ---------------------------------------------------------------- reference model


def _conv(p, name, x, **kw):
    fn = getattr(F, kw.pop("fn"))
    return fn(x, p[f"{name}.weight"], p.get(f"{name}.bias"), **kw)


REFERENCE_CASES = [
    (
        "conv3d_div_pool_gap_bias_sum",
        """
        name: ref_a
        input: {shape: [N, 3, 6, 7, 8], example: {N: 2}}
        params:
          bias: {shape: [4, 1, 1, 1]}
        ops:
          - conv3d: {out_channels: 4, kernel_size: 3, padding: [1, 0, 1]}
          - div: {scalar: 2.0}
          - max_pool3d: {kernel_size: 2}
          - adaptive_avg_pool3d: {output_size: [1, 1, 1]}
          - add: {param: bias}
          - sum: {dim: 1}
        """,
        lambda x, p: (
            F.adaptive_avg_pool3d(
                F.max_pool3d(_conv(p, "conv", x, fn="conv3d", padding=(1, 0, 1)) / 2.0, 2), 1
            )
            + p["bias"]
        ).sum(dim=1),
        {"conv": nn.Conv3d},
    ),
    (
        "conv2d_groups_avgpool_sigmoid_mean",
        """
        name: ref_b
        input: {shape: [N, 4, 11, 9]}
        ops:
          - conv2d: {out_channels: 6, kernel_size: [3, 2], stride: 2, padding: 1, dilation: [2, 1], groups: 2, bias: false}
          - avg_pool2d: {kernel_size: 3, stride: 2, padding: 1, ceil_mode: true, count_include_pad: false}
          - sigmoid
          - mean: {dim: [1, -1], keepdim: true}
        """,
        lambda x, p: torch.sigmoid(
            F.avg_pool2d(
                _conv(p, "conv", x, fn="conv2d", stride=2, padding=1, dilation=(2, 1), groups=2),
                3, 2, 1, ceil_mode=True, count_include_pad=False,
            )
        ).mean(dim=(1, 3), keepdim=True),
        {"conv": nn.Conv2d},
    ),
    (
        "conv_transpose2d_relu_group_norm_max",
        """
        name: ref_c
        input: {shape: [N, 4, 5, 6]}
        ops:
          - conv_transpose2d: {out_channels: 6, kernel_size: 3, stride: 2, padding: 1, output_padding: 1, groups: 2}
          - relu
          - group_norm: {num_groups: 3, eps: 0.001}
          - max: {dim: [3, 2]}
        """,
        lambda x, p: torch.amax(
            F.group_norm(
                torch.relu(
                    _conv(p, "conv_transpose", x, fn="conv_transpose2d", stride=2, padding=1, output_padding=1, groups=2)
                ),
                3, p["group_norm.weight"], p["group_norm.bias"], 1e-3,
            ),
            dim=(2, 3),
        ),
        {"conv_transpose": nn.ConvTranspose2d, "group_norm": nn.GroupNorm},
    ),
    (
        "conv1d_instance_norm_clamp_mul_max",
        """
        name: ref_d
        input: {shape: [N, 2, 13]}
        params:
          scale: {shape: [5, 1], init: randn}
        ops:
          - conv1d: {out_channels: 5, kernel_size: 4, stride: 3}
          - mul: {param: scale}
          - instance_norm: {affine: true}
          - clamp: {min: -0.5, max: 0.5}
          - mul: {param: scale}
          - max: {dim: 1}
        """,
        lambda x, p: torch.amax(
            torch.clamp(
                F.instance_norm(
                    _conv(p, "conv", x, fn="conv1d", stride=3) * p["scale"],
                    weight=p["instance_norm.weight"], bias=p["instance_norm.bias"],
                ),
                -0.5, 0.5,
            )
            * p["scale"],
            dim=1,
        ),
        {"conv": nn.Conv1d, "instance_norm": nn.InstanceNorm1d},
    ),
    (
        "two_named_convs_pool_sum",
        """
        name: ref_e
        input: {shape: [N, 2, 4, 5, 3]}
        ops:
          - conv_transpose3d: {out_channels: 3, kernel_size: [2, 3, 2], stride: [2, 1, 2], dilation: [1, 2, 1], name: up}
          - sub: {scalar: 0.25}
          - conv3d: {out_channels: 2, kernel_size: 2, name: down, bias: false}
          - max_pool3d: {kernel_size: 3, stride: 2, padding: 1, dilation: 2, ceil_mode: true}
          - sum: {dim: [4, 2, 3], keepdim: true}
        """,
        lambda x, p: F.max_pool3d(
            _conv(p, "down", _conv(p, "up", x, fn="conv_transpose3d", stride=(2, 1, 2), dilation=(1, 2, 1)) - 0.25, fn="conv3d"),
            3, 2, 1, 2, ceil_mode=True,
        ).sum(dim=(2, 3, 4), keepdim=True),
        {"up": nn.ConvTranspose3d, "down": nn.Conv3d},
    ),
]


@pytest.mark.parametrize("text, direct, modules", [c[1:] for c in REFERENCE_CASES], ids=[c[0] for c in REFERENCE_CASES])
def test_reference_model_is_the_functional_ops(text, direct, modules):
    import textwrap

    pipe = build_pipeline(parse_spec(textwrap.dedent(text), "ref.yaml"))
    torch.manual_seed(0)
    model = ReferenceModel(pipe).double()
    for name, cls in modules.items():
        assert type(getattr(model, name)) is cls, name
    params = dict(model.named_parameters())
    assert set(params) == {a.name for a in pipe.tensor_args()}
    for a in pipe.tensor_args():
        assert tuple(params[a.name].shape) == a.shape, a.name
    x = torch.randn(pipe.input.concrete(BATCH), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(x)
        want = direct(x, params)
    assert got.dtype == torch.float64
    assert tuple(got.shape) == pipe.output.concrete(BATCH) == tuple(want.shape)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), (got - want).abs().max().item()
