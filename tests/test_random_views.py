"""Seeded random pipelines of views read in place, through render, the CPU build and validation.

Each pipeline permutes, slices and expands its values (ranks 3 to 5, sizes of 1 too) and hands each view,
or a view of it (their strides composed), to a stage that reads it in place (an elementwise op, maybe with a broadcast parameter, or a reduction):
buffer.view_buffer's strides and broadcast zeros, the plan's view stages and the binding's views, a view
read again later as a later stage's operand (cexpr.view_index) or as a plain tensor (a copy),
checked against the float64 reference end to end and stage by stage. A failure names the seed and
the spec, so it reproduces with ``random_view_spec(SEED + i, i)``.
"""
import math
import random

import pytest

from conftest import HAS_CUDA, build_and_validate, build_drawn_specs, pipeline_of, render_specs, spec_text, validate_drawn_spec
from kgen.errors import KgenError

SEED = 7306
COUNT = 4  # modules; each CPU build costs seconds
UNARY = ("relu", "tanh", "sigmoid", "neg", "abs", "gelu")


def _shape(ops, shape) -> list[int]:
    """[C, *S] of the pipeline's output."""
    return list(pipeline_of(spec_text(shape, ops)).output.shape[1:])


def _consumer(rng, ops, params, shape, masks: bool = False) -> None:
    """An op that reads the view before it in place: elementwise (maybe with a parameter broadcast along
    some dims: with ``masks``, a masked_fill's mask too) or a reduction over some dims."""
    if rng.random() < 0.35 and len(shape) > 1:
        dims = sorted(rng.sample(range(1, len(shape) + 1), rng.randint(1, len(shape) - 1)))
        ops.append({rng.choice(("sum", "mean", "max")): {"dim": dims, "keepdim": rng.random() < 0.6}})
    elif rng.random() < 0.5:
        name = f"p{len(params)}"
        params[name] = {"shape": [n if rng.random() < 0.5 else 1 for n in shape], "init": "randn"}
        if masks and rng.random() < 0.5:
            ops.append({"masked_fill": {"param": name, "value": rng.choice((-math.inf, 2.5))}})
        else:
            ops.append({rng.choice(("add", "mul", "sub")): {"param": name}})
    else:
        ops.append(rng.choice(UNARY))


def _view(rng, ops, shape) -> None:
    """A permute, a slice (maybe with a step) or an expand of the dims of size 1 (made by a sum first where none
    is) of the pipeline's result."""
    now = _shape(ops, shape)
    if rng.random() < 0.4:
        if 1 not in now:
            ops.append({"sum": {"dim": [rng.randint(1, len(now))], "keepdim": True}})
            now = _shape(ops, shape)
        ops.append({"expand": {"shape": [rng.randint(2, 5) if n == 1 else -1 for n in now]}})
    elif (rng.random() < 0.3 or len(now) == 1) and max(now) > 1:
        d = rng.choice([d for d, n in enumerate(now) if n > 1])
        start = rng.randint(0, now[d] - 2)
        ops.append({"slice": {"dim": d + 1, "start": start, "end": rng.randint(start + 1, now[d]),
                              "step": rng.choice((1, 1, 2))}})
    elif len(now) > 1:
        order = list(range(1, len(now) + 1))
        while order == sorted(order):
            rng.shuffle(order)
        ops.append({"permute": {"dims": [0] + order}})
    else:
        ops.append({"expand": {"shape": [rng.randint(2, 5)]}})


def random_view_spec(seed: int, index: int, rich: bool = False) -> str:
    """A drawn pipeline of views and the ops reading them. ``rich``: masked_fill among the consumers, and views of
    named values that start elementwise chains (what permute_before_elementwise moves with a chain)."""
    rng = random.Random(seed)
    while True:
        shape = [rng.choice((1, 2, 3, 4, 5, 6)) for _ in range(rng.randint(2, 4))]
        if shape[0] == 1:
            shape[0] = 3
        ops, params = [rng.choice(UNARY)], {}
        try:
            for k in range(rng.randint(3, 5)):
                _view(rng, ops, shape)
                if rng.random() < 0.3:  # a view of the view (its strides composed)
                    _view(rng, ops, shape)
                roll = rng.random()
                if roll < 0.2:  # named: read in place by the next stage, and as a plain tensor later (a copy)
                    name = f"v{k}"
                    ops[-1][next(iter(ops[-1]))]["as"] = name
                    _consumer(rng, ops, params, _shape(ops, shape))
                    ops.append({"tanh": {"from": name}})
                elif roll < 0.45:  # named: read in place, then as a later stage's operand through its strides
                    name, viewed = f"v{k}", _shape(ops, shape)
                    ops[-1][next(iter(ops[-1]))]["as"] = name
                    ops.append(rng.choice(UNARY))
                    ops.append({"sum": {"dim": [rng.randint(1, len(viewed))], "keepdim": True}})
                    ops.append({"expand": {"shape": viewed}})
                    ops.append({rng.choice(("add", "mul", "sub")): {"tensor": name}})
                elif rich and roll < 0.7:  # a named value, then a view of it that starts a chain
                    name = f"src{k}"
                    ops.append({rng.choice(UNARY): {"as": name}})
                    _view(rng, ops, shape)
                    ops[-1][next(iter(ops[-1]))]["from"] = name
                _consumer(rng, ops, params, _shape(ops, shape), masks=rich)
            text = spec_text(shape, ops, params=params, name=f"views_{index}")
            pipeline_of(text)
        except KgenError:
            continue  # a draw that does not fit (a parameter's broadcast after a reduction, ...)
        return text


SPECS = [random_view_spec(SEED + i, i) for i in range(COUNT)]


def _where(i: int) -> str:
    return f"random view pipeline {i} (seed {SEED + i}):\n{SPECS[i]}"


@pytest.fixture(scope="module")
def view_modules(tmp_path_factory):
    return build_drawn_specs(tmp_path_factory.mktemp("views"), SPECS, "views", _where)


def test_the_draws_read_views_in_place():
    """The fixed seed draws permutes read as channels_last and as strided buffers, and expands of stride 0,
    each read in place by the stage after it."""
    from kgen.plan import make_plan
    from kgen.target import DEFAULT

    plans = [make_plan(pipeline_of(text), target=DEFAULT) for text in SPECS]
    read = [(st.ops[0].op_name, st.output.layout) for p in plans for st in p.stages
            if st.family.name == "aten" and not st.output.flat]
    assert ("permute", "channels_last") in read and ("permute", "strided") in read and ("expand", "strided") in read, read
    assert ("slice", "strided") in read, read
    assert any(st.family.name == "aten" and not st.output.flat and not st.input.flat for p in plans for st in p.stages)
    assert any("from" in str(text) for text in SPECS)  # a view read again later, as a plain tensor
    # a view read by a later stage as an operand, through its strides
    assert any(set(p.view_values()) & set(p.stage_values(st)) for p in plans for st in p.kernel_stages())


@pytest.mark.parametrize("i", range(COUNT))
def test_random_views_validate_on_the_cpu_build(i, view_modules):
    validate_drawn_spec(*view_modules, "views", i, _where)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_random_views_validate_on_the_gpu(tmp_path):
    """The same pipelines built for CUDA: the kernels' strided loads, channels_last tiles and view operands."""
    # (named apart from the CPU build's modules: one process loads each name once)
    texts = {f"views_gpu_{i}": text.replace(f"name: views_{i}", f"name: views_gpu_{i}") for i, text in enumerate(SPECS)}
    build_and_validate(render_specs(tmp_path, texts), "cuda")


REWRITE_DRAWS = 120  # pipelines drawn for the rewrites below (float64 runs, no build: ~10 s)


def test_elementwise_chains_moved_around_permutes_compute_the_same_values():
    """The rewrites that move elementwise chains around views (kgen.rewrites: permute_before_elementwise,
    commute_operand_chain) on drawn pipelines with masked_fill among their ops (masks of zeros and ones) and views
    of named values starting chains: where they fire, the rewritten pipeline's values are the original's in float64,
    NaN included, and the plan builds. The draws must make them fire, over masks and over such views too."""
    import math

    import torch

    from kgen.plan import make_plan
    from kgen.reference import ReferenceModel
    from kgen.rewrites import apply_rewrites
    from kgen.spec import REWRITE_NAMES
    from kgen.target import DEFAULT

    names = ("commute_operand_chain", "permute_before_elementwise")
    fired, masks, viewed_chains = 0, 0, 0
    for i in range(REWRITE_DRAWS):
        text = random_view_spec(SEED + 1000 + i, i, rich=True)
        pipe = pipeline_of(text)
        new, decisions = apply_rewrites(pipe, {n: n in names for n in REWRITE_NAMES})
        if not any(d.fired for d in decisions if d.rewrite in names):
            continue
        fired += 1
        filled = {o.param for o in pipe.ops if getattr(o, "fn", "") == "masked_fill"}
        masks += bool(filled)
        viewed_chains += any(d.fired and " of " in d.reason for d in decisions if d.rewrite == "permute_before_elementwise")
        torch.manual_seed(i)
        params = {k: v.detach() for k, v in ReferenceModel(pipe).double().named_parameters()}
        params.update({k: (torch.rand_like(v) < 0.5).double() for k, v in params.items() if k in filled})  # zeros and ones
        x = torch.randn(pipe.input.concrete(3), dtype=torch.float64)
        x.view(-1)[::7] = math.nan
        with torch.no_grad():
            want, got = pipe.run(x, params), new.run(x, params)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"seed {SEED + 1000 + i}:\n{text}"
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True, msg=f"seed {SEED + 1000 + i}:\n{text}")
        make_plan(pipe, target=DEFAULT)
    assert fired >= 10 and masks >= 2 and viewed_chains >= 2, (fired, masks, viewed_chains)
