"""Seeded random pipelines through render, the CPU build and validation.

Each pipeline is a small spec drawn from a fixed seed: an optional leading
convolution (plain, strided, transposed; generated or ATen's), then one or two fused segments of
elementwise ops (drawn from the op table), window pools, a norm, and a
reduction at the end. The modules are built together once; each test
validates one of them against the float64 reference. A failure names the seed
and the spec, so it reproduces with ``random_spec(SEED + i, i)``.
"""
import random

import pytest
import yaml

from conftest import build_drawn_specs, pipeline_of, spec_text, validate_drawn_spec
from kgen.errors import KgenError
from kgen.ops import elementwise_ops

SEED = 1528  # picked so that the draws cover what test_the_draws_cover_the_layers asks for
COUNT = 6  # modules; each CPU build costs seconds, so keep it modest


def _elementwise(rng, params: dict, shape=None) -> dict | str:
    """An elementwise op of the table; with ``shape`` ([C, *S]) maybe with a parameter operand.
    ``rng`` is the elementwise stream: adding an op to the table changes which ops
    are drawn, not the structure of the pipelines."""
    entry = rng.choice(elementwise_ops())
    if shape and entry.operand and entry.name != "div" and rng.random() < 0.3:
        name = f"p{len(params)}"
        # broadcast along some dims of [C, *S]
        pshape = [n if rng.random() < 0.5 else 1 for n in shape]
        params[name] = {"shape": pshape, "init": "randn"}
        return {entry.name: {"param": name}}
    return {entry.name: dict(entry.example)} if entry.example else entry.name


def _pool(rng, spatial) -> dict:
    rank = len(spatial)
    kind = rng.choice(("max", "avg"))
    k = [rng.randint(1, min(3, n)) for n in spatial]
    args = {"kernel_size": k, "stride": [rng.randint(1, kk) for kk in k]}
    if rng.random() < 0.3:
        args["padding"] = [rng.randint(0, kk // 2) for kk in k]
    if rng.random() < 0.2:
        args["ceil_mode"] = True
    if kind == "avg" and rng.random() < 0.3:
        args["count_include_pad"] = False
    return {f"{kind}_pool{rank}d": args}


def random_spec(seed: int, index: int) -> str:
    """A valid random spec (drawn again until it is valid); the structure and the
    elementwise ops come from two streams of ``seed``."""
    rng, ew, impl = random.Random(seed), random.Random(seed + 1_000_003), random.Random(seed + 2_000_003)
    while True:
        rank = rng.choice((1, 2, 2, 3))
        channels = rng.randint(1, 5)
        spatial = [rng.randint(4, 9 if rank < 3 else 6) for _ in range(rank)]
        ops, params = [], {}
        if rng.random() < 0.6:
            out = rng.randint(2, 6)
            k = rng.randint(1, 3)
            if rng.random() < 0.4:
                ops.append({f"conv_transpose{rank}d": {"out_channels": out, "kernel_size": k + 1, "stride": rng.randint(1, 2),
                                                       "padding": rng.randint(0, k // 2)}})
            else:
                ops.append({f"conv{rank}d": {"out_channels": out, "kernel_size": k, "stride": rng.randint(1, 2),
                                             "padding": rng.randint(0, k // 2), "bias": rng.random() < 0.8}})
        try:
            t = pipeline_of(spec_text([channels] + spatial, ops or ["relu"])).output
        except KgenError:
            continue
        C, S = t.channels, list(t.spatial)
        for segment in range(rng.randint(1, 2)):
            last = segment == 1 or rng.random() < 0.5
            for _ in range(rng.randint(0, 2)):
                ops.append(_elementwise(ew, params, [C] + S))
            if rng.random() < 0.35:
                groups = [g for g in range(1, C + 1) if C % g == 0]
                ops.append(rng.choice([{"group_norm": {"num_groups": rng.choice(groups)}}, {"instance_norm": {"affine": True}}]))
            else:
                for _ in range(rng.randint(1, 2)):
                    ops.append(_pool(rng, S))
            ops.append(_elementwise(ew, params, [C] + S))
            if last:
                break
        dims = sorted(rng.sample(range(1, 2 + rank), rng.randint(1, 1 + rank)))
        ops.append({rng.choice(("sum", "mean", "max")): {"dim": dims, "keepdim": rng.random() < 0.5}})
        if rng.random() < 0.5:
            ops.append(_elementwise(ew, params))
        # who computes a convolution: the planner (the generated one, mostly), or ATen
        plan = {"conv": impl.choice(("auto", "aten"))} if ops[0] and next(iter(ops[0])).startswith("conv") else None
        text = spec_text([channels] + spatial, ops, params=params, name=f"random_{index}", plan=plan)
        try:
            pipeline_of(text)
        except KgenError:
            continue  # a pool that does not fit, a norm on one element, ...
        return text


SPECS = [random_spec(SEED + i, i) for i in range(COUNT)]


def _where(i: int) -> str:
    return f"random pipeline {i} (seed {SEED + i}):\n{SPECS[i]}"


@pytest.fixture(scope="module")
def random_modules(tmp_path_factory):
    return build_drawn_specs(tmp_path_factory.mktemp("random"), SPECS, "random", _where)


def test_the_draws_cover_the_layers():
    """The fixed seed draws what the test claims to cover, down to the plans' buffers."""
    from kgen.plan import make_plan
    from kgen.target import DEFAULT

    ops = [next(iter(o)) if isinstance(o, dict) else o for text in SPECS for o in yaml.safe_load(text)["ops"]]
    assert any(o.startswith("conv") for o in ops) and any(o.startswith("conv_transpose") for o in ops)
    assert any("pool" in o for o in ops) and any(o in ("group_norm", "instance_norm") for o in ops)
    assert any(o in ("sum", "mean", "max") for o in ops)
    assert len({o for o in ops if o in {e.name for e in elementwise_ops()}}) >= 4
    plans = [make_plan(pipeline_of(text), target=DEFAULT) for text in SPECS]
    assert any(p.stages[0].kind != "conv" for p in plans)  # some start without a convolution
    assert any(p.stages[0].family.name == "conv_gemm" for p in plans) and any(p.stages[0].family.name == "conv_aten" for p in plans)
    assert any(len(p.stages) >= 3 for p in plans)
    assert any(s.input.phased for p in plans for s in p.kernel_stages())  # sub-pixel tiles read in place
    assert any(s.input.layout == "channels_last" for p in plans for s in p.kernel_stages())
    assert any(d.rewrite == "dead_region" and d.fired for p in plans for d in p.decisions)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(COUNT))
def test_random_pipeline_validates_on_the_cpu_build(i, random_modules):
    validate_drawn_spec(*random_modules, "random", i, _where)
