"""Rounding points of 16-bit plans (kgen.plan.rounding_points): inside a fused stage each op's output is
rounded to the dtype, as eager PyTorch materializes it, unless the spec says `intermediates: float32`.

Rendering: the rounding is in the stage math of every 16-bit plan (one `kgen::round_to<T>` per op,
naming it), in plan.json and in `kgen explain`, and nowhere in float32 plans or with the option.
Numerics (CPU build): a mean far from zero before a group norm (x + 6: the add's rounding in bfloat16 is
~2^-6 of a unit-std value, which the norm keeps) is where eager's result is far from float64; with the
rounding points kgen's output matches eager within KernelBench's 1e-2, with float32 intermediates it
does not (and is closer to float64). bench/rounding_cpu.py measures more specs (docs/performance.md).
"""
import json

import pytest
import torch

from conftest import pipeline_of, render_specs

# one stage of each 16-bit family: norm (prologue, the norm, post, channel sum, epilogue), pool_reduce (an
# average pool, an elementwise op), softmax, layer_norm (the norm, post)
CHAIN = """
name: {name}
input:
  shape: [N, 8, 6, 6]
  dtype: {dtype}
  example: {{N: 2}}
{extra}ops:
  - add: {{scalar: 6.0}}
  - group_norm: {{num_groups: 4}}
  - mul: {{scalar: 2.0}}
  - sum: {{dim: 1}}
  - sigmoid
  - avg_pool1d: {{kernel_size: 2}}
  - tanh
  - softmax: {{dim: 1}}
{tail}"""
LAYER_NORM_TAIL = "  - layer_norm: {normalized_shape: [3]}\n  - relu\n"
FAMILIES = ["norm", "pool_reduce", "softmax", "layer_norm"]
C_TYPES = {"bfloat16": "kgen::bfloat16", "float16": "kgen::float16"}


def chain(name, dtype="[float32, bfloat16, float16]", extra="", tail=LAYER_NORM_TAIL):
    return CHAIN.format(name=name, dtype=dtype, extra=extra, tail=tail)


ROUNDINGS = ("round_to", "round_to_in_32_bit_registers")  # kgen_math.h: the cvt's round trip; the form for epilogues


def rounding_lines(text: str, dtype: str, form: str | None = None) -> list[str]:
    """The op keys of the rounding points in generated code, in order (those of one form of kgen_math.h's)."""
    marks = [f"v = kgen::{f}<{C_TYPES[dtype]}>(v);  // " for f in ROUNDINGS if form in (None, f)]
    return [line.split(m)[1].split("'s output")[0] for line in text.splitlines() for m in marks if m in line]


def test_every_op_of_a_16_bit_stage_is_a_rounding_point(tmp_path):
    from kgen.plan import choose_plans

    sel = choose_plans(pipeline_of(chain("r")))
    keys = [op.key for op in sel.pipeline.ops]
    for v in sel.variants:
        assert [s.family.name for s in v.plan.stages] == FAMILIES
        rounded = [op.key for s in v.plan.stages for op in s.rounded]
        assert rounded == ([] if v.dtype == "float32" else keys), v.dtype


def test_rounding_points_render_in_16_bit_plans_only(tmp_path):
    (_, d), = render_specs(tmp_path, {"r": chain("r")}).values()
    stages = (d / "stages.h").read_text()
    keys = [f"ops[{i}].{k}" for i, k in enumerate("add group_norm mul sum sigmoid avg_pool1d tanh softmax layer_norm relu".split())]
    float32_part, rest = stages.split("// ==== plan 1:")
    assert "round_to" not in float32_part  # the float32 plan computes as before
    bf16_part, fp16_part = rest.split("// ==== plan 2:")
    assert rounding_lines(bf16_part, "bfloat16") == keys and "kgen::float16>" not in bf16_part
    assert rounding_lines(fp16_part, "float16") == keys and "kgen::bfloat16>" not in fp16_part
    plans = json.loads((d / "plan.json").read_text())["plans"]
    assert [[k for s in p["stages"] for k in s.get("rounds_after", [])] for p in plans] == [[], keys, keys]
    # pool_reduce's math may run in a generated convolution's epilogue: its float16 rounding keeps to 32-bit
    # registers; the norm, softmax and layer_norm kernels round through the hardware's conversions
    in_epilogue = [k for s in plans[2]["stages"] if s["family"] == "pool_reduce" for k in s.get("rounds_after", [])]
    assert in_epilogue and rounding_lines(fp16_part, "float16", "round_to_in_32_bit_registers") == in_epilogue
    assert rounding_lines(fp16_part, "float16", "round_to") == [k for k in keys if k not in in_epilogue]


def test_intermediates_float32_renders_no_rounding_point(tmp_path):
    from kgen.explain import explain_text

    text = chain("f", extra="intermediates: float32\n")
    (spec, d), = render_specs(tmp_path, {"f": text}).values()
    assert "round_to" not in (d / "stages.h").read_text()
    assert all("rounds_after" not in s for p in json.loads((d / "plan.json").read_text())["plans"] for s in p["stages"])
    assert "float32 between its ops, rounded to bfloat16 at its output only" in explain_text(pipeline_of(text), dtype="bfloat16")
    eager = explain_text(pipeline_of(chain("r")), dtype="float16")
    assert "rounds to float16 after ops[0].add, ops[1].group_norm, ops[2].mul, ops[3].sum, ops[4].sigmoid" in eager
    assert "rounds to" not in explain_text(pipeline_of(chain("r")), dtype="float32")


def test_intermediates_round_trips_through_spec_data():
    from kgen.spec import parse_spec, spec_from_data, spec_to_data

    plain = parse_spec(chain("r"))
    assert plain.intermediates == "eager" and "intermediates" not in spec_to_data(plain)  # hashes of existing specs kept
    kept = parse_spec(chain("r", extra="intermediates: float32\n"))
    assert spec_from_data(spec_to_data(kept)).intermediates == "float32"


SHIFT_NORM = """
name: {name}
input:
  shape: [N, 8, 12, 12]
  dtype: [bfloat16, float16]
  example: {{N: 4}}
{extra}ops:
  - add: {{scalar: 6.0}}
  - group_norm: {{num_groups: 4}}
"""


# the rewrites that keep eager's 16-bit rounding points (kgen.rewrites.KEEPS_ROUNDING): sub-pixel phases, a
# positive scale moved past a max, two max pools as one
KEPT_REWRITES = """
name: {name}
input:
  shape: [N, 4, 8, 8]
  dtype: [bfloat16, float16]
  example: {{N: 2}}
{extra}ops:
  - conv_transpose2d: {{out_channels: 6, kernel_size: 4, stride: 2, padding: 1}}
  - div: {{scalar: 3.0}}
  - {pool}: {{kernel_size: 2}}
  - {pool}: {{kernel_size: 2}}
  - sum: {{dim: 1}}
"""


# avgpool_sigmoid_sum's form: nothing after the pool amplifies the convolution's rounding, so the pool folds into
# the convolution's weights in 16 bits too
FOLDED = """
name: {name}
input:
  shape: [N, 3, 18, 18]
  dtype: [bfloat16, float16]
  example: {{N: 2}}
ops:
  - conv2d: {{out_channels: 8, kernel_size: 3}}
  - avg_pool2d: {{kernel_size: 4}}
  - sigmoid
  - sum: {{dim: [1, 2, 3]}}
"""


def _fired(plan) -> set[str]:
    return {d.rewrite for d in plan.decisions if d.fired}


def _variant(dtype, text):
    from kgen.plan import choose_plans

    (v,) = [v for v in choose_plans(pipeline_of(text)).variants if v.dtype == dtype]
    return v


def test_16_bit_plans_run_the_rewrites_that_keep_eagers_rounding():
    """Every 16-bit plan runs the rewrites that keep eager's rounding points; the others (a mean of rounded
    means as one mean, a pool folded into the weights) skip roundings eager does, and run only where no
    later op amplifies them (a softmax here) or with float32 intermediates."""
    softmax = "  - softmax: {dim: 1}\n"
    for dtype in ("bfloat16", "float16"):
        v = _variant(dtype, KEPT_REWRITES.format(name="r", extra="", pool="max_pool2d"))
        assert _fired(v.plan) == {"subpixel_conv_transpose", "scalar_through_max", "pool_composition"}
        a = _variant(dtype, KEPT_REWRITES.format(name="r", extra="", pool="avg_pool2d"))
        assert "pool_composition" in _fired(a.plan)  # nothing after the pools amplifies their rounding
        amp = _variant(dtype, KEPT_REWRITES.format(name="r", extra="", pool="avg_pool2d") + softmax)
        assert not _fired(amp.plan) & {"pool_composition", "avg_pool_folding", "subpixel_conv_transpose"}
        why = {d.rewrite: d.reason for d in amp.plan.decisions if not d.fired}
        assert "skip roundings to the dtype that eager does between ops, which ops[5].softmax" in why["pool_composition"]
        assert "skip roundings" in why["avg_pool_folding"] and "ops[5].softmax (softmax) needs eager's own call" in why[
            "subpixel_conv_transpose"]
    # float32 intermediates: every rewrite, as in float32
    f = _variant("bfloat16", KEPT_REWRITES.format(name="r", extra="intermediates: float32\n", pool="avg_pool2d") + softmax)
    assert "pool_composition" in _fired(f.plan) and not any("skip roundings" in d.reason for d in f.plan.decisions)


def test_16_bit_transposed_convolution_before_a_norm_is_eagers_own_call():
    """A norm scales a unit of the dtype in the convolution's output up past KernelBench's 1e-2 against eager
    (relu_group_norm in bfloat16 on an H200, sub-pixel phases by cuDNN: 6e-2 off eager), so before a norm a
    16-bit transposed convolution is eager's own call; in float32, and without the norm, sub-pixel phases."""
    from kgen.plan import choose_plans

    text = KEPT_REWRITES.replace("- {pool}: {{kernel_size: 2}}\n  - {pool}: {{kernel_size: 2}}\n  - sum: {{dim: 1}}",
                                 "- group_norm: {{num_groups: 2}}").format(name="r", extra="")
    for v in choose_plans(pipeline_of(text.replace("[bfloat16, float16]", "[float32, bfloat16]"))).variants:
        assert ("subpixel_conv_transpose" in _fired(v.plan)) == (v.dtype == "float32"), v.dtype


@pytest.fixture(scope="module")
def rounding_modules(tmp_path_factory):
    from kgen.build import build_modules
    from kgen.ir import load_pipeline
    from kgen.validate import import_module_dir

    texts = {
        "rnd_chain": chain("rnd_chain", "[bfloat16, float16]", tail=""),
        "rnd_shift": SHIFT_NORM.format(name="rnd_shift", extra=""),
        "rnd_shift_f32": SHIFT_NORM.format(name="rnd_shift_f32", extra="intermediates: float32\n"),
        "rnd_kept": KEPT_REWRITES.format(name="rnd_kept", extra="", pool="max_pool2d"),
        "rnd_folded": FOLDED.format(name="rnd_folded"),
    }
    rendered = render_specs(tmp_path_factory.mktemp("rounding"), texts)
    build_modules([d for _, d in rendered.values()], "cpu")
    return {n: (load_pipeline(str(spec)), import_module_dir(d)) for n, (spec, d) in rendered.items()}


def run(pipe, module, dtype, seed):
    """(kgen's output, eager's in the same dtype, float64 on the same rounded inputs and parameters)."""
    from kgen.reference import ReferenceModel

    torch.manual_seed(seed)
    ref = ReferenceModel(pipe).eval()
    x = torch.randn(4, *pipe.input.shape[1:])
    eager = ref.to(dtype)
    model = module.Model().to(dtype)
    model.load_state_dict(eager.state_dict())
    xd = x.to(dtype)
    with torch.no_grad():
        return model(xd).double(), eager(xd).double(), ref.double()(xd.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_family_rounds_as_eager(rounding_modules, dtype):
    """Through a norm, a pool, elementwise ops and a softmax, kgen's output is within one rounding of
    eager's in the dtype (the fp32 arithmetic inside an op may land a value on the other side of a tie)."""
    pipe, m = rounding_modules["rnd_chain"]
    for seed in range(3):
        y, want, _ = run(pipe, m, dtype, seed)
        assert (y - want).abs().max().item() <= torch.finfo(dtype).eps * want.abs().max().item(), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_amplified_rounding_matches_eager(rounding_modules, dtype):
    """x + 6 before a group norm: with eager's rounding points every seed passes KernelBench's check
    against eager; with float32 intermediates bfloat16 fails it (eager is 4e-2 off float64 there, kgen
    9e-3: bench/rounding_cpu.py), while being closer to float64."""
    rounded, kept = [], []
    for seed in range(4):
        y, want, exact = run(*rounding_modules["rnd_shift"], dtype, seed)
        assert torch.allclose(y, want, atol=1e-2, rtol=1e-2), seed
        rounded.append((y - exact).abs().max().item())
        y32, want32, exact32 = run(*rounding_modules["rnd_shift_f32"], dtype, seed)
        assert torch.equal(want32, want)  # the same model and data
        kept.append(((y32 - exact32).abs().max().item(), torch.allclose(y32, want32, atol=1e-2, rtol=1e-2)))
    assert max(e for e, _ in kept) < max(rounded)  # float32 intermediates: closer to the exact result
    if dtype == torch.bfloat16:
        assert not any(ok for _, ok in kept)  # ... and not what KernelBench's check against eager accepts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rewritten_16_bit_plan_computes_eagers_values(rounding_modules, dtype):
    """Sub-pixel phases, the scale after the max and one max pool for two: the values eager rounds, rounded
    where eager rounds them, so kgen's output is within one rounding of eager's (the channel sum's float
    arithmetic may land on the other side of a tie)."""
    pipe, m = rounding_modules["rnd_kept"]
    for seed in range(3):
        y, want, _ = run(pipe, m, dtype, seed)
        assert (y - want).abs().max().item() <= torch.finfo(dtype).eps * want.abs().max().item(), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_16_bit_plan_passes_the_check_against_eager(rounding_modules, dtype):
    """The average pool folded into the convolution skips the rounding of the convolution's output that eager
    does: kgen's output is then within KernelBench's 1e-2 of eager's in the dtype, and no further from float64
    than eager plus one unit of the dtype (the sum's own rounding)."""
    pipe, m = rounding_modules["rnd_folded"]
    assert "avg_pool_folding" in _fired(_variant(str(dtype).removeprefix("torch."), FOLDED.format(name="rnd_folded")).plan)
    for seed in range(3):
        y, want, exact = run(pipe, m, dtype, seed)
        assert torch.allclose(y, want, atol=1e-2, rtol=1e-2), seed
        unit = torch.finfo(dtype).eps * exact.abs().max().item()
        assert (y - exact).abs().max().item() <= (want - exact).abs().max().item() + unit, seed


MEAN_THEN_SUM = """
name: r_mean_sum
input:
  shape: [N, 4, 6, 6]
  dtype: [bfloat16, float16]
  example: {N: 2}
params:
  b: {shape: [4, 1, 1], init: randn}
ops:
  - adaptive_avg_pool2d: {output_size: [1, 1]}
  - add: {param: b}
  - sum: {dim: 1}
"""


def test_reduction_algebra_keeps_float16s_range():
    """A mean then a sum as one sum, divided after: in bfloat16 (float's range) where nothing amplifies the
    skipped roundings; in float16 the sum before the division is a rounding point 36 times the mean here, which
    overflows where eager's mean does not (validation's x 1e3 case), so not there."""
    assert "reduction_algebra" in _fired(_variant("bfloat16", MEAN_THEN_SUM).plan)
    fp16 = _variant("float16", MEAN_THEN_SUM).plan
    assert "reduction_algebra" not in _fired(fp16)
    (why,) = [d.reason for d in fp16.decisions if d.rewrite == "reduction_algebra"]
    assert "in float16 the sum over the mean's dims would round to the dtype" in why


def test_16_bit_search_goes_past_a_rewrite_no_family_computes():
    """The pool folds into the convolution in 16 bits (nothing amplifies the skipped rounding), but with the
    convolution pinned to ATen (`plan: {conv: aten}`) no family computes a folded 16-bit convolution (conv_aten
    would round the box-filtered weights to the dtype): the candidate search takes the plan without the folding,
    not the eager plan."""
    text = FOLDED.format(name="r_pinned").replace("ops:\n", "plan: {conv: aten}\nops:\n")
    for dtype in ("bfloat16", "float16"):
        plan = _variant(dtype, text).plan
        assert not plan.eager and [s.family.name for s in plan.stages] == ["conv_aten", "pool_reduce"]
        (fold,) = [d for d in plan.decisions if d.rewrite == "avg_pool_folding"]
        assert not fold.fired and "not chosen" in fold.reason
