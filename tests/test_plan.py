"""The planner: grouping ops into stages and families, the choice among implementations,
schedules (from the target), buffers and tiles. No builds: plans only."""
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from conftest import ROOT, assert_report_passed, pipeline_of, spec_text, write_spec
from kgen import families
from kgen.families import conv_aten, layer_norm, norm, pool_reduce, softmax
from kgen.families.base import Family
from kgen.ir import Capture, Elementwise, LayerNorm, Norm, Reduce, Softmax, load_pipeline
from kgen.lowering import Subpixel
from kgen.plan import choose_plans, make_plan
from kgen.stage import ConvStage
from kgen.target import DEFAULT, H100, H200, KNOWN, Target, current

CONV2 = {"conv2d": {"out_channels": 4, "kernel_size": 3}}


def plan_of(shape, ops, target=DEFAULT, choices=None, **kw):
    return make_plan(pipeline_of(spec_text(shape, ops, **kw)), target=target, choices=choices)


ATEN = {"conv": "aten"}  # plan.conv: the ATen convolution (what these tests check), not the generated one


def families_of(plan):
    return [s.family.name for s in plan.stages]


# ------------------------------------------------------------------ grouping


@pytest.mark.parametrize(
    "shape,ops,expected",
    [
        ([3, 10, 10], [CONV2, "relu", {"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], ["conv_gemm", "pool_reduce"]),
        ([4, 6, 6], ["relu", {"group_norm": {"num_groups": 2}}, {"sum": {"dim": 1}}, "sigmoid"], ["norm"]),
        ([4, 6, 6], [{"group_norm": {"num_groups": 2}}, {"max_pool2d": {"kernel_size": 2}}], ["norm", "pool_reduce"]),
        # a reduction over space is not the norm family's: the norm ends its stage
        ([4, 6, 6], [{"group_norm": {"num_groups": 2}}, {"sum": {"dim": [2, 3]}}], ["norm", "pool_reduce"]),
        # a reduction before a norm ends the pool_reduce stage
        ([4, 6, 6], [{"sum": {"dim": 2, "keepdim": True}}, {"group_norm": {"num_groups": 2}}], ["pool_reduce", "norm"]),
        ([4, 6, 6], [{"max_pool2d": {"kernel_size": 2}}, {"group_norm": {"num_groups": 4}}], ["pool_reduce", "norm"]),
        ([4, 6, 6], [{"sum": {"dim": 1}}, {"max": {"dim": 1}}], ["pool_reduce", "pool_reduce"]),
        ([4, 8, 8], [{"max_pool2d": {"kernel_size": 2}}, "relu", {"avg_pool2d": {"kernel_size": 2}}, {"mean": {"dim": 1}}, "relu"],
         ["pool_reduce"]),
        ([2, 6], ["relu"], ["pool_reduce"]),
    ],
)
def test_grouping(shape, ops, expected):
    plan = plan_of(shape, ops, rewrites=False)
    assert families_of(plan) == expected
    # every op of the (rewritten) pipeline is in exactly one stage, in order
    assert [o for s in plan.stages for o in s.ops] == list(plan.pipeline.ops)
    for s in plan.stages:  # each stage's candidates: the conv families' (conv_aten: one per layout), a group norm's
        # without a channel reduction also the layer_norm family's (its groups in registers), else its family
        assert s.family.name in {c.split(":")[0] for c in s.candidates} and s.choice.startswith(s.family.name)
        reduced = any(o.op_name in ("sum", "max") for o in s.ops)
        expected_families = (("conv_gemm", "conv_aten") if s.kind == "conv" else
                             ("norm", "layer_norm") if s.family.name == "norm" and not reduced else (s.family.name,))
        assert tuple(dict.fromkeys(c.split(":")[0] for c in s.candidates)) == expected_families


def test_norm_stage_parts():
    plan = plan_of([4, 6, 6], ["relu", {"group_norm": {"num_groups": 2}}, "sigmoid", {"sum": {"dim": 1}}, {"mul": {"scalar": 2.0}}])
    (st,) = plan.stages
    assert [o.fn for o in st.prologue] == ["relu"] and isinstance(st.norm, Norm)
    assert [o.fn for o in st.post] == ["sigmoid"] and isinstance(st.reduce, Reduce)
    assert [o.fn for o in st.epilogue] == ["mul"]


def test_pool_reduce_levels():
    plan = plan_of([4, 12, 12], ["relu", {"max_pool2d": {"kernel_size": 2}}, "sigmoid",
                                 {"avg_pool2d": {"kernel_size": 3, "padding": 1}}, {"sum": {"dim": [1, 3]}}, "relu"], rewrites=False)
    (st,) = plan.stages
    assert [lv.pool.kind if lv.pool else None for lv in st.levels] == [None, "max", "avg"]
    assert [[o.fn for o in lv.ew] for lv in st.levels] == [["relu"], ["sigmoid"], []]
    assert [o.fn for o in st.epilogue] == ["relu"]
    assert st.levels[1].clipped == (False, False) and st.levels[2].clipped == (True, True)  # padding needs bounds checks
    assert st.kept_dims == (2,) and st.kept_count == 2 and st.reduced_count == 4 * 2


def test_conv_bias_moves_into_the_next_stage():
    plan = plan_of([3, 10, 10], [CONV2, {"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], rewrites=False)
    conv, fused = plan.stages
    assert conv.conv.bias_deferred and "bias added by the next stage" in conv.conv.describe()
    first = fused.ops[0]
    assert isinstance(first, Elementwise) and first.fn == "add" and first.param == "conv.bias"
    assert [a.name for a in plan.stage_args(fused)] == ["conv.bias"]
    # a convolution at the end keeps its bias
    last = plan_of([3, 10, 10], ["relu", CONV2], rewrites=False)
    assert not last.stages[1].conv.bias_deferred


LN64 = {"layer_norm": {"normalized_shape": [64]}}


def test_layer_norm_fuses_with_the_elementwise_ops_around_it():
    """KernelBench level 2 #34's tail: layer_norm over the last dim, gelu, a scale: one stage of the
    layer_norm family (a warp per row of 64, float2 loads, 4 rows in flight), with the ops before it
    as its prologue; no ATen stage."""
    plan = plan_of([4, 3, 64], ["relu", LN64, "gelu", {"mul": {"scalar": 2.0}}])
    (st,) = plan.stages
    assert st.family is layer_norm.FAMILY and st.candidates == ("layer_norm",)
    assert [o.fn for o in st.prologue] == ["relu"] and isinstance(st.norm, LayerNorm)
    assert [o.fn for o in st.post] == ["gelu", "mul"]
    assert (st.row_size, st.rows, st.row_dims) == (64, 12, 1)
    sc = st.schedule
    assert (sc.cuda_threads, sc.row_threads, sc.vector, sc.rows_in_flight) == (layer_norm.CUDA_THREADS, 16, 4, 2)
    assert sc.cpu_grain == layer_norm.CPU_TASK_VALUES // 64 and sc.index_type == "int"
    # alone, it is also the aten family's: both are candidates, the generated one first
    (alone,) = plan_of([4, 3, 64], [LN64]).stages
    assert alone.candidates == ("layer_norm", "aten") and alone.family is layer_norm.FAMILY
    # a reduction (or a pool) after it is not the family's: the stage ends there
    assert families_of(plan_of([4, 3, 64], [LN64, "gelu", {"sum": {"dim": 1}}])) == ["layer_norm", "pool_reduce"]
    assert families_of(plan_of([4, 6, 64], [LN64, {"avg_pool2d": {"kernel_size": 2}}])) == ["layer_norm", "pool_reduce"]
    # two layer norms: two stages
    two = plan_of([4, 3, 64], [LN64, "relu", {"layer_norm": {"normalized_shape": [64], "name": "ln2"}}])
    assert families_of(two) == ["layer_norm", "layer_norm"]


def test_layer_norm_after_a_convolution_reads_its_buffer_in_place():
    """A transposed convolution's sub-pixel phase tiles (#34 in small) are read in place, with the
    convolution's bias added in the layer norm's prologue: no copy stage; the loads are scalar."""
    ct = {"conv_transpose3d": {"out_channels": 6, "kernel_size": 4, "stride": 2, "padding": 1}}
    plan = plan_of([4, 3, 5, 6], [ct, {"layer_norm": {"normalized_shape": [12]}}, "gelu", {"mul": {"scalar": 1.0}}],
                   plan={"conv": "aten", "conv_layout": "contiguous"}, batch=2048)
    conv, st = plan.stages
    assert isinstance(conv.conv.lowering, Subpixel) and conv.conv.bias_deferred
    assert st.family is layer_norm.FAMILY and st.input is conv.output and len(st.input.tiles) == 8
    assert [(o.fn, o.param) for o in st.prologue] == [("add", "conv_transpose.bias")]
    assert (st.schedule.row_threads, st.schedule.vector) == (16, 1)  # rows of 12: 16 lanes; no vectors from tiles
    # an ATen convolution writes NC[D]HW for it first (a row's values lie a channel count apart in channels_last)
    c2 = {"conv2d": {"out_channels": 5, "kernel_size": 3, "padding": 1}}
    auto = plan_of([3, 40, 40], [c2, {"layer_norm": {"normalized_shape": [40]}}], plan=ATEN)
    assert auto.stages[0].candidates == ("conv_aten:contiguous", "conv_aten:channels_last")
    assert auto.stages[1].input.flat and auto.stages[1].schedule.vector == 1  # 40 values: no whole vectors per lane


def test_layer_norm_rows_longer_than_the_registers_stay_with_aten():
    """Rows of more than MAX_ROW_VALUES values: the family declines (its reason in the stage's
    choice), the layer_norm is an ATen stage of its own and the ops around it go to pool_reduce."""
    long_row = {"layer_norm": {"normalized_shape": [32, 64]}}  # 2048 values
    plan = plan_of([3, 32, 64], ["relu", long_row, "gelu", {"mul": {"scalar": 2.0}}])
    assert families_of(plan) == ["pool_reduce", "aten", "pool_reduce"]
    ln = plan.stages[1]
    assert ln.candidates == ("aten",)
    assert "layer_norm declined (rows of 2048 values: more than the 1024 a block holds in registers)" in ln.choice
    assert [o.fn for o in plan.stages[2].ops] == ["gelu", "mul"]
    # a convolution before it keeps its bias: the ATen stage would not take it
    conv_first = plan_of([3, 34, 66], [{"conv2d": {"out_channels": 4, "kernel_size": 3}}, long_row], plan=ATEN)
    assert families_of(conv_first) == ["conv_aten", "aten"] and not conv_first.stages[0].conv.bias_deferred
    # at the limit it is the family's
    edge = plan_of([3, 32, 32], [{"layer_norm": {"normalized_shape": [32, 32]}}, "gelu"])
    assert families_of(edge) == ["layer_norm"] and edge.stages[0].schedule.row_threads == layer_norm.CUDA_THREADS


@pytest.mark.parametrize("shape, normalized, row_threads, vector, rows_in_flight", [
    ([5, 8], [8], 2, 4, 2),  # short rows: 2 lanes of one float4 each, 16 rows per warp
    ([5, 64], [64], 16, 4, 2),  # 16 lanes of one float4 (not 32 of a float2)
    ([5, 48], [48], 32, 1, 4),  # 48 values: two slots, the second half full
    ([6, 8], [6, 8], 32, 1, 4),  # a 2-dim row of 48 values
    ([5, 128], [128], 32, 4, 2),  # float4: whole vectors per lane
    ([5, 256], [256], 32, 4, 1),  # the longest row a warp takes
    ([5, 384], [384], 256, 1, 4),  # a block per row: 1.5 values per thread, scalar
    ([5, 512], [512], 256, 2, 4),
    ([2, 32, 32], [32, 32], 256, 4, 2),
])
def test_layer_norm_schedule_follows_the_row(shape, normalized, row_threads, vector, rows_in_flight):
    (st,) = plan_of(shape, [{"layer_norm": {"normalized_shape": normalized}}, "relu"]).stages
    sc = st.schedule
    assert (sc.row_threads, sc.vector, sc.rows_in_flight) == (row_threads, vector, rows_in_flight)


def test_a_value_named_after_layer_norm():
    """Named right after the norm and read in the same run of elementwise ops: a register of the
    stage; read after a reduction: the stage ends with it and its output is the value."""
    local = plan_of([3, 6, 8], [{"layer_norm": {"normalized_shape": [6, 8], "as": "h"}}, "tanh", {"mul": {"tensor": "h"}}])
    (st,) = local.stages
    assert isinstance(st.post[0], Capture) and st.post[-1].register
    later = plan_of([3, 6, 8], [{"layer_norm": {"normalized_shape": [8], "as": "h"}}, {"mean": {"dim": 1, "keepdim": True, "as": "m"}},
                                {"sub": {"from": "h", "tensor": "m"}}])
    assert families_of(later) == ["layer_norm", "pool_reduce", "pool_reduce"]
    assert later.value_exprs["h"] == "t0" and isinstance(later.stages[0].ops[-1], Capture)


def test_layer_norm_over_channels_last_rows_takes_tiles():
    """A layer norm over the last dim of a channels_last convolution's output: the tiles form (a thread per row,
    tiles of W x C through shared memory; 16-byte vectors where W x C divides), priced at plain bytes where the
    row form reading in place is charged the strided read; over two dims, or with more than MAX_TILE_ROW values a
    row, the row form."""
    from kgen.families import layer_norm

    def ln_stage(shape, normalized, channels=16, dtype="float32"):
        text = spec_text(shape, [{"conv2d": {"out_channels": channels, "kernel_size": 1}}, {"layer_norm": {"normalized_shape": normalized}}],
                         plan={"conv": "aten", "conv_layout": "channels_last"}).replace("dtype: float32", f"dtype: {dtype}")
        plan = make_plan(replace(pipeline_of(text), dtype=dtype), target=DEFAULT)
        return next(st for st in plan.stages if st.kind == "layer_norm")

    st = ln_stage([4, 6, 64], [64], dtype="bfloat16")
    assert st.input.layout == "channels_last" and st.schedule.form == "tiles" and st.schedule.row_threads == 1
    assert st.schedule.vector == 8 and st.schedule.tiles_per_block == layer_norm.TILE_SMEM_BYTES // (64 * 17 * 4)
    assert layer_norm.FAMILY.read_bytes(st, 2) == 2 * 2 * 16 * 6 * 64  # whole sectors: the bytes themselves
    odd = ln_stage([4, 6, 7], [7], channels=5)
    assert odd.schedule.form == "tiles" and odd.schedule.vector == 1 and odd.schedule.tiles_per_block == layer_norm.CUDA_THREADS // 5
    for rows in (ln_stage([4, 6, 8], [6, 8]), ln_stage([4, 2, 128], [128])):
        assert rows.schedule.form == "rows" and rows.schedule.row_threads > 1
        assert layer_norm.FAMILY.read_bytes(rows, 2) > 4 * 2 * 16 * math.prod(rows.in_type.spatial)


def test_softmax_fuses_with_the_elementwise_ops_around_it():
    """softmax, log_softmax and logsumexp over one axis: one stage of the softmax family with the
    elementwise ops before it as its prologue and those after it as its post ops; no ATen stage.
    Alone, the op is also the aten family's candidate (the generated one first)."""
    plan = plan_of([24, 5, 7], ["relu", {"softmax": {"dim": 1}}, "sigmoid", {"mul": {"scalar": 2.0}}])
    (st,) = plan.stages
    assert st.family is softmax.FAMILY and st.candidates == ("softmax",)
    assert [o.fn for o in st.prologue] == ["relu"] and isinstance(st.op, Softmax) and [o.fn for o in st.post] == ["sigmoid", "mul"]
    assert (st.axis, st.length, st.inner, st.slices) == ((1,), 24, 35, 35)
    (alone,) = plan_of([24, 5, 7], [{"log_softmax": {"dim": 1}}]).stages
    assert alone.candidates == ("softmax", "aten") and alone.family is softmax.FAMILY
    # logsumexp: its output keeps the axis as 1 (keepdim) or drops it; two consecutive dims are one axis
    (lse,) = plan_of([4, 6, 5], [{"logsumexp": {"dim": [2, 3], "keepdim": True}}, "relu"]).stages
    assert lse.family is softmax.FAMILY and (lse.axis, lse.length, lse.inner, lse.slices) == ((2, 3), 30, 1, 4)
    assert str(lse.out_type) == "[N, 4, 1, 1]"
    # over dims that are not consecutive: an ATen stage of its own, the ops around it elsewhere
    gap = plan_of([4, 6, 5], ["relu", {"logsumexp": {"dim": [1, 3]}}, "relu"])
    assert families_of(gap) == ["pool_reduce", "aten", "pool_reduce"]
    # a reduction or a pool after it is not the family's; two softmaxes are two stages
    assert families_of(plan_of([8, 6], [{"softmax": {"dim": 1}}, {"max": {"dim": 1}}])) == ["softmax", "pool_reduce"]
    assert families_of(plan_of([8, 6, 6], [{"softmax": {"dim": 1}}, {"max_pool2d": {"kernel_size": 2}}])) == ["softmax", "pool_reduce"]
    assert families_of(plan_of([8, 6], [{"softmax": {"dim": 1}}, "relu", {"logsumexp": {"dim": 1}}])) == ["softmax", "softmax"]


def test_kernelbench_softmax_and_logsumexp_stages_are_fused():
    """The KernelBench level 2 shapes in small: #49 (ConvTranspose3d, softmax over the channels, sigmoid),
    #58 (logsumexp over the channels kept as a value for the ops after it), #92 (group norm, then
    logsumexp over the channels) and #99 (a GEMM, gelu, softmax over a row of 8192): no ATen stage, the
    convolution's bias added in the softmax stage's prologue, the value in a register."""
    ct = {"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1}}
    kb49 = plan_of([32, 4, 4, 4], [ct, {"softmax": {"dim": 1}}, "sigmoid"], plan=ATEN)
    assert families_of(kb49) == ["conv_aten", "softmax"] and kb49.stages[0].conv.bias_deferred
    st = kb49.stages[1]
    assert [(o.fn, o.param) for o in st.prologue] == [("add", "conv_transpose.bias")] and [o.fn for o in st.post] == ["sigmoid"]
    sc = st.schedule  # 64 channels: two lanes of 32 values each, in registers
    assert (sc.form, sc.cuda_threads, sc.slice_threads, sc.cached) == ("columns", softmax.COLUMN_THREADS, 2, True)
    ct16 = {"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}}
    kb58 = plan_of([3, 4, 4, 4], [ct16, {"logsumexp": {"dim": 1, "keepdim": True, "as": "l"}}, {"add": {"scalar": 3.0}}, "sigmoid",
                                  {"mul": {"tensor": "l"}}, {"clamp": {"min": -1.0, "max": 1.0}}], plan=ATEN)
    assert families_of(kb58)[-1] == "softmax" and "aten" not in families_of(kb58)
    lse = kb58.stages[-1]
    assert isinstance(lse.post[0], Capture) and lse.post[3].tensor == "l" and lse.post[3].register
    assert (lse.schedule.form, lse.schedule.slice_threads) == ("columns", 1)
    kb92 = plan_of([8, 10, 10], [{"group_norm": {"num_groups": 4, "name": "gn"}}, "tanh", {"logsumexp": {"dim": 1, "keepdim": True}}])
    assert families_of(kb92) == ["norm", "softmax"]
    kb99 = plan_of([256], [{"linear": {"out_features": 8192}}, "gelu", {"softmax": {"dim": 1}}], batch=1024,
                   choices={"pipeline": "kgen"})
    assert families_of(kb99) == ["linear_gemm", "softmax"]  # the softmax reads the product: no epilogue
    sc = kb99.stages[1].schedule  # a block of 512 threads per row, 16 values each in registers
    assert (sc.form, sc.cuda_threads, sc.slice_threads, sc.cached) == ("rows", 512, 512, True)


@pytest.mark.parametrize("shape, op, form, threads, slice_threads, cached", [
    ([16, 6, 6], {"softmax": {"dim": 1}}, "columns", 128, 1, True),  # a thread per slice
    ([24, 6, 6], {"softmax": {"dim": 1}}, "columns", 128, 1, True),
    ([33, 6, 6], {"softmax": {"dim": 1}}, "columns", 128, 2, True),  # two lanes 16 apart
    ([128, 6, 6], {"log_softmax": {"dim": 1}}, "columns", 128, 4, True),  # four lanes 8 apart, 32 values each
    ([256, 6, 6], {"softmax": {"dim": 1}}, "columns", 128, 4, True),  # 64 values each: the most a thread holds
    ([257, 6, 6], {"softmax": {"dim": 1}}, "columns", 128, 4, False),  # read twice
    ([6, 10], {"softmax": {"dim": 2}}, "rows", 256, 16, True),  # short rows: part of a warp
    ([256], {"logsumexp": {"dim": 1}}, "rows", 256, 32, True),  # the longest row a warp takes
    ([300], {"softmax": {"dim": 1}}, "rows", 256, 256, True),  # a block
    ([8192], {"softmax": {"dim": 1}}, "rows", 512, 512, True),
    ([16384], {"softmax": {"dim": 1}}, "rows", 1024, 1024, True),
    ([16385], {"softmax": {"dim": 1}}, "rows", 1024, 1024, False),  # more than a block holds: read twice
    ([131072], {"logsumexp": {"dim": 1}}, "rows", 1024, 1024, False),  # pushed while loading, one pass
])
def test_softmax_schedule_follows_the_slice(shape, op, form, threads, slice_threads, cached):
    (st,) = plan_of(shape, ["relu", op]).stages
    sc = st.schedule
    assert (sc.form, sc.cuda_threads, sc.slice_threads, sc.cached) == (form, threads, slice_threads, cached)
    assert sc.cpu_grain == max(1, softmax.CPU_TASK_VALUES // st.length)


def test_softmax_cost_counts_a_second_read_where_the_slice_is_not_held():
    from kgen.families.base import FLOAT_BYTES

    held, twice = (plan_of([n], [{"softmax": {"dim": 1}}], choices={"implementation @ ops[0].softmax": "softmax"}).stages[0]
                   for n in (16384, 16385))
    (w1,), (w2,) = softmax.FAMILY.work(held, 4, DEFAULT), softmax.FAMILY.work(twice, 4, DEFAULT)
    assert w1.bytes == 2 * FLOAT_BYTES * 4 * 16384 and w2.bytes == 3 * FLOAT_BYTES * 4 * 16385
    (lse,) = plan_of([16385], [{"logsumexp": {"dim": 1}}], choices={"implementation @ ops[0].logsumexp": "softmax"}).stages
    assert softmax.FAMILY.work(lse, 4, DEFAULT)[0].bytes == FLOAT_BYTES * 4 * (16385 + 1)  # one pass


# ------------------------------------------------------------------ buffers and copies


def test_conv_layout_follows_the_reader():
    to_pool = plan_of([3, 10, 10], [CONV2, {"sum": {"dim": 1}}], plan=ATEN)
    assert to_pool.stages[0].layout == "channels_last"  # pool_reduce reads channels_last as fast
    assert to_pool.stages[1].input.layout == "channels_last"
    assert to_pool.stages[1].input.tiles[0].strides == (1, 8 * 4, 4)  # (C, H, W) of [4, 8, 8] channels_last
    to_norm = plan_of([3, 40, 40], [CONV2, {"group_norm": {"num_groups": 2}}], plan=ATEN)
    assert to_norm.stages[0].layout == "channels_last"  # the norm's row kernels read it as fast
    assert (to_norm.stages[1].schedule.stats_by, to_norm.stages[1].schedule.apply_by) == ("rows", "transpose")
    wide = {"conv2d": {"out_channels": 320, "kernel_size": 3}}  # above the row kernels' 256 channels
    to_wide_norm = plan_of([3, 40, 40], [wide, {"group_norm": {"num_groups": 2}}], plan=ATEN)
    assert to_wide_norm.stages[0].layout == "contiguous" and to_wide_norm.stages[1].input.flat
    forced = plan_of([3, 10, 10], [CONV2, {"sum": {"dim": 1}}], plan={"conv_layout": "contiguous", "conv": "aten"})
    assert forced.stages[0].layout == "contiguous"


def test_aten_convolution_runs_with_tf32_off_where_it_is_not_eagers_call(tmp_path):
    """conv_aten.fp32_products: a small convolution whose values reach the output one by one (no sum
    or mean after it), run in another memory format than eager's NC[D]HW call, gets cuDNN's TF32 off
    (cuDNN picked TF32 kernels in channels_last where eager's call ran fp32); eager's own call keeps
    the spec's precision (cuDNN picks what eager gets), and so do a convolution whose values are
    summed, one large enough for cuDNN's tensor-core GEMMs, and a spec at ieee. The binding passes it."""
    from kgen.render import render_spec

    conv = {"conv2d": {"out_channels": 64, "kernel_size": 3}}
    cl = {"conv": "aten", "conv_layout": "channels_last"}
    elementwise = plan_of([8, 40, 40], [conv, "relu"], plan=cl).stages[0]
    assert elementwise.layout == "channels_last" and "no sum or mean" in elementwise.fp32_products
    as_eager = plan_of([8, 40, 40], [conv, "relu"], plan={"conv": "aten", "conv_layout": "contiguous"}).stages[0]
    summed = plan_of([8, 40, 40], [conv, "relu", {"sum": {"dim": 1}}], plan=cl).stages[0]
    large = plan_of([64, 20, 20], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, "relu"], plan=cl).stages[0]  # K = 576
    ieee = make_plan(pipeline_of(spec_text([8, 40, 40], [conv, "relu"], plan=cl) + "precision: ieee\n")).stages[0]
    assert not as_eager.fp32_products and not summed.fp32_products and not large.fp32_products and not ieee.fp32_products
    for name, ops, precision in (("off", [conv, "relu"], "kgen::Precision::kIeee"),
                                 ("kept", [conv, "relu", {"sum": {"dim": 1}}], "kPrecision")):
        rendered = render_spec(write_spec(tmp_path, spec_text([8, 40, 40], ops, name=name, plan=cl), f"{name}.yaml"),
                               tmp_path / "gen")
        binding = next(v for k, v in rendered.files.items() if str(k).endswith("binding.cpp"))
        call = binding[binding.index("kgen::convolution("):]
        assert f", {precision}, at::MemoryFormat::ChannelsLast)" in call[:call.index(";")], (name, call[:400])


def test_a_tf32_convolution_before_a_normalization_rounds_as_eagers_own_call():
    """conv_aten.eager_rounding_only: cuDNN rounds a forward convolution's operands to TF32 ties away from
    zero in NC[D]HW and to even in channels_last, and a normalization scales that up past KernelBench's
    1e-4; so a forward convolution with TF32 products (K = 576) before a group, instance or training-mode
    batch norm makes eager's own call, or a channels_last call whose operands are rounded first as eager's
    call rounds them (ConvStage.eager_rounding: the input in the generated copy, so only where that copy
    makes it). An exponential after it or a transposed convolution (ties to even in every form) leave the
    layout free and round nothing; a spec's conv_layout takes that layout (channels_last: rounded)."""
    large = {"conv2d": {"out_channels": 64, "kernel_size": 3}}
    for norm in ({"group_norm": {"num_groups": 4}}, {"instance_norm": {}}):
        first = plan_of([64, 20, 20], [large, norm], plan=ATEN).stages[0]
        assert first.layout == "contiguous" and not first.eager_rounding and not first.fp32_products, norm
        assert first.candidates == ("conv_aten:contiguous", "conv_aten:channels_last"), first.candidates
        cl = plan_of([64, 20, 20], [large, norm], plan=ATEN,
                     choices={"implementation @ ops[0].conv2d": "conv_aten:channels_last"}).stages[0]
        assert cl.layout == "channels_last" and cl.eager_rounding and not cl.fp32_products, norm
        assert "rounded to TF32 ties away from zero" in cl.family.explain_lines(cl)[0]
    wide = plan_of([300, 8, 8], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, {"instance_norm": {}}], plan=ATEN).stages[0]
    assert wide.candidates == ("conv_aten:contiguous",)  # its copy into channels_last would be ATen's: nothing rounds it
    sel = choose_plans(pipeline_of(spec_text([64, 20, 20], [large, "relu", {"batch_norm": {}}], plan=ATEN)))
    train, evl = sel.variant_for(2, True).plan.stages[0], sel.variant_for(2, False).plan.stages[0]
    assert train.eager_rounding == (train.layout == "channels_last")  # the batch statistics: rounded as eager's
    assert evl.layout == "channels_last" and not evl.eager_rounding  # eval mode: an affine over the running statistics
    free = [plan_of([64, 20, 20], [large, "exp", {"sum": {"dim": 1}}], plan=ATEN).stages[0],
            plan_of([64, 20, 20], [{"conv_transpose2d": {"out_channels": 64, "kernel_size": 3}},
                                   {"group_norm": {"num_groups": 4}}], plan=ATEN).stages[0]]
    assert [(st.layout, st.eager_rounding) for st in free] == [("channels_last", False)] * 2
    given = plan_of([64, 20, 20], [large, {"group_norm": {"num_groups": 4}}],
                    plan={"conv": "aten", "conv_layout": "channels_last"}).stages[0]
    assert given.layout == "channels_last" and given.eager_rounding


def test_the_rounded_channels_last_call_renders_its_rounding_and_validates_on_the_cpu(tmp_path):
    """ConvStage.eager_rounding in the sources: the generated copy rounds the input, ATen's fallback copy and the
    kept weight are rounded on CUDA (the CPU's convolution is fp32: nothing is rounded there, so the CPU build
    validates against float64 as eager's CPU call does)."""
    from kgen.build import build_module
    from kgen.render import render_spec, write_rendered
    from kgen.validate import validate

    ops = [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, {"instance_norm": {}}]
    spec = write_spec(tmp_path, spec_text([64, 6, 6], ops, name="er", plan={"conv": "aten", "conv_layout": "channels_last"}), "er.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    module = tmp_path / "gen" / "er"
    binding, kernel = (module / "binding.cpp").read_text(), (module / "kernel.cu").read_text()
    assert "(w.is_cuda() ? kgen::tf32_round_away(w) : w).contiguous(at::MemoryFormat::ChannelsLast)" in binding
    assert "(x.is_cuda() ? kgen::tf32_round_away(narrowed) : narrowed)" in binding
    assert "yn[i] = kgen::tf32_rounded_away(tile[" in kernel
    build_module(module, "cpu", quiet=True)
    assert_report_passed(validate(spec, module, "cpu"), "er")


def test_how_the_aten_convolution_gets_its_input():
    """conv_aten.input_copy: a generated copy into channels_last from an NC[D]HW input (narrowed in
    place), ATen's copy where the generated one does not apply, none where the input is read as is."""
    fam = conv_aten.FAMILY
    to_pool = [CONV2, {"sum": {"dim": 1}}]
    cl = plan_of([3, 10, 10], to_pool, plan={"conv_layout": "channels_last", "conv": "aten"}).stages[0]
    assert fam.input_copy(cl) == "kernel" and fam.stage_json(cl)["input_copy"] == "kernel"
    assert "generated kernel" in fam.explain_lines(cl)[0]
    nchw = plan_of([3, 10, 10], to_pool, plan={"conv_layout": "contiguous", "conv": "aten"}).stages[0]
    assert fam.input_copy(nchw) is None and "copied" not in fam.explain_lines(nchw)[0]
    wide_in = plan_of([300, 6, 6], to_pool, plan={"conv_layout": "channels_last", "conv": "aten"}).stages[0]
    assert fam.input_copy(wide_in) == "aten"  # more input channels than the copy's tile takes
    ct = {"conv_transpose2d": {"out_channels": 4, "kernel_size": 5, "stride": 2, "padding": 2}}
    narrowed = plan_of([8, 24, 25], [ct, {"max_pool2d": {"kernel_size": 6}}, {"sum": {"dim": 1}}],
                       plan={"conv_layout": "contiguous", "conv": "aten"}).stages[0]
    assert tuple(narrowed.input_extent) != tuple(narrowed.in_type.spatial)  # the dead region cuts the input
    assert fam.input_copy(narrowed) == "aten"  # narrowed, but no change of layout: ATen's narrow + contiguous
    # the cost model: ATen's copy into channels_last transposes at a share of the DRAM rate, the others stream
    from kgen.families.base import ATEN_RELAYOUT_SHARE

    def copy_share(st):
        (w,) = [w for w in fam.work(st, 2, DEFAULT) if w.what == "input copy"]
        return w.bandwidth_share
    assert ATEN_RELAYOUT_SHARE < 0.5
    assert copy_share(wide_in) == ATEN_RELAYOUT_SHARE and copy_share(cl) == copy_share(narrowed) == 1.0


def test_explain_costs_an_eager_plan_whose_ops_read_named_values():
    """The eager plan is one stage of every op; an op reading a named value (``from:``) takes that value's type
    (typed_ops reads the eager stage's chain), not the op before it's: kgen explain of such a plan once failed."""
    from kgen.explain import stage_cost
    from kgen.plan import EAGER, PIPELINE

    ops = [{"conv2d": {"out_channels": 8, "kernel_size": 1, "name": "one"}},
           {"conv2d": {"out_channels": 6, "kernel_size": 3, "name": "three", "from": "x"}}]
    plan = make_plan(pipeline_of(spec_text([5, 4, 4], ops, batch=2)), choices={PIPELINE: EAGER})
    (st,) = plan.stages
    flops, _ = stage_cost(plan, st, 2)
    assert flops == 2 * (2 * 5 * 8 * 16 + 2 * 5 * 9 * 6 * 4)  # batch 2: both convolutions read x [5, 4, 4]


def test_atens_cat_of_channels_last_values_costs_their_transposing_copies():
    """A cat (an ATen stage) reading convolutions' channels_last outputs copies them into its NC[D]HW result by
    ATen's strided copy: priced at ATEN_RELAYOUT_SHARE of the DRAM rate, so the convolutions write NC[D]HW where
    the cat is all that reads them (KernelBench level 3's inception module: its cat 2.04 -> 0.51 ms)."""
    from kgen import cost
    from kgen.families.base import ATEN_RELAYOUT_SHARE

    ops = [{"conv2d": {"out_channels": 8, "kernel_size": 1, "name": "one", "as": "ya"}},
           {"conv2d": {"out_channels": 8, "kernel_size": 3, "padding": 1, "name": "three", "from": "x", "as": "yb"}},
           {"cat": {"dim": 1, "tensors": ["yb"], "from": "ya"}}]

    def cat_work(layout):
        plan = plan_of([3, 10, 10], ops, plan={"conv_layout": layout, "conv": "aten"})
        assert [s.family.name for s in plan.stages] == ["conv_aten", "conv_aten", "aten"]
        return cost.estimate(plan, 2)[-1].work
    relayouts = [w for w in cat_work("channels_last") if "read channels_last by ATen's cat" in w.what]
    assert len(relayouts) == 2 and all(w.bandwidth_share == ATEN_RELAYOUT_SHARE for w in relayouts)
    assert [w.what for w in cat_work("contiguous")] == ["aten"]
    assert families_of(plan_of([3, 10, 10], ops, plan={"conv": "aten"})) == ["conv_aten", "conv_aten", "aten"]


def test_views_cost_nothing_in_the_eager_plan_and_a_flat_reshape_nothing_in_atens_stage():
    """The eager stage runs its ops as written: an expand the next call broadcasts, a name (``as``) and a reshape
    of a contiguous value copy nothing (Mamba2's segment sums: x[..., :, None] - x[..., None, :] priced as three
    passes once, so a plan writing the expanded value out looked faster than eager's one broadcasting pass). A
    reshape in an ATen stage of its own is a view where its input is plain contiguous."""
    from kgen import cost
    from kgen.ir import Reshape
    from kgen.plan import EAGER, PIPELINE

    ops = [{"relu": {"as": "y"}}, {"sub": {"scalar": 1.0}}, {"expand": {"shape": [6, 5, 5]}},
           {"sub": {"tensor": "y", "as": "d"}}, "relu", {"reshape": {"shape": [150]}}]
    pipe = pipeline_of(spec_text([6, 5, 1], ops, batch=4))
    eager = make_plan(pipe, choices={PIPELINE: EAGER})
    works = {w.what: w for w in cost.estimate(eager, 4)[0].work}
    views = [w for w in works.values() if w.what.endswith("(a view)")]
    assert len(views) == 4 and all(w.bytes == 0 and w.launches == 0 for w in views), list(works)
    # reads the view's own values and y, writes the result
    assert works["ops[3].sub"].bytes == 4 * 4 * (6 * 5 * 1 + 6 * 5 * 1 + 6 * 5 * 5)
    kgen = make_plan(pipe)
    (reshape,) = [s for s in kgen.stages if s.family.name == "aten" and isinstance(s.ops[0], Reshape)]
    assert reshape.input.flat and cost.estimate(kgen, 4)[reshape.index].work[0].bytes == 0


def test_subpixel_phases_are_tiles_read_in_place():
    op = {"conv_transpose2d": {"out_channels": 3, "kernel_size": 4, "stride": 2, "padding": 1}}
    plan = plan_of([2, 5, 5], [op, {"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], plan=ATEN)
    conv, fused = plan.stages
    assert isinstance(conv.conv.lowering, Subpixel) and len(conv.phases) == 4
    assert fused.input is conv.output and fused.input.phase_stride == (2, 2) and len(fused.input.tiles) == 4
    assert sorted(t.residue for t in fused.input.tiles) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_copy_stage_where_a_conv_output_is_read_as_a_tensor():
    op = {"conv_transpose2d": {"out_channels": 3, "kernel_size": 4, "stride": 2, "padding": 1}}
    alone = plan_of([2, 5, 5], [op], plan=ATEN)  # phase tiles at the end: copied into one tensor
    assert families_of(alone) == ["conv_aten", "pool_reduce"] and alone.stages[1].ops == []
    assert alone.stages[1].output.flat and "copy" not in alone.stages[1].choice  # chosen like any other stage
    conv_b = {"conv2d": {"out_channels": 4, "kernel_size": 3, "name": "conv_b"}}
    two = plan_of([2, 5, 5], [op, conv_b], plan=ATEN)  # the second conv reads a tensor
    assert families_of(two) == ["conv_aten", "pool_reduce", "conv_aten"]
    plain = plan_of([3, 10, 10], [CONV2, {"conv2d": {"out_channels": 2, "kernel_size": 3, "name": "conv_b"}}], rewrites=False, plan=ATEN)  # dense outputs need no copy
    assert families_of(plain) == ["conv_aten", "conv_aten"]
    assert [s.index for s in two.stages] == [0, 1, 2]


def test_cropped_conv_buffer_is_larger_than_the_logical_tensor():
    plan = plan_of([2, 9, 9], [CONV2, {"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], plan=ATEN)
    conv, fused = plan.stages
    assert conv.conv.crop == (6, 6) and conv.input_extent == (8, 8)
    assert fused.input.logical == (4, 6, 6) and fused.input.tiles[0].dims == (4, 6, 6)
    assert any(d.rewrite == "dead_region" and d.fired for d in plan.decisions)


# ------------------------------------------------------------------ schedules and the target


def test_schedule_fields_come_from_the_family_and_the_target():
    ops = [{"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": [2, 3]}}]
    big = plan_of([64, 64, 64], ops, batch=1, target=DEFAULT).stages[0].schedule
    small = plan_of([64, 64, 64], ops, batch=1, target=Target(sm_count=2, max_threads_per_sm=1024)).stages[0].schedule
    assert big.cuda_threads == pool_reduce.CUDA_THREADS and big.min_per_thread == pool_reduce.MIN_PER_THREAD
    # contiguous input, spatial reduction innermost: lanes walk the reduction
    assert big.r_fast and big.r_lanes == 256
    # a short reduction adjacent in memory, few outputs: R_FAST_MIN_PER_LANE values per lane (128 -> 32 lanes), not one
    # each; outputs enough to fill the device: R_FAST_PER_LANE (128 -> 8 lanes, 4 outputs per warp)
    short = plan_of([4, 6, 128], [{"min": {"dim": 3}}], batch=1, target=DEFAULT).stages[0].schedule
    assert short.r_fast and short.r_lanes == 128 // pool_reduce.R_FAST_MIN_PER_LANE == 32
    many = plan_of([4, 600, 128], [{"min": {"dim": 3}}], batch=128, target=DEFAULT).stages[0].schedule
    assert many.r_fast and many.r_lanes == 128 // pool_reduce.R_FAST_PER_LANE == 8
    # reducing channels of a contiguous tensor: threads walk the outputs, lanes fill the device
    chans = [{"sum": {"dim": 1}}]
    lanes_big = plan_of([64, 32, 32], chans, batch=1, target=DEFAULT).stages[0].schedule
    lanes_small = plan_of([64, 32, 32], chans, batch=1, target=Target(sm_count=2, max_threads_per_sm=1024)).stages[0].schedule
    assert not lanes_big.r_fast and lanes_big.r_lanes == 32 and lanes_small.r_lanes == 2
    assert big.target_blocks_per_sm == pool_reduce.WAVES * 2048 // 256 and small.target_blocks_per_sm == 2 * 1024 // 256
    assert big.unroll == 4  # 16 loads in flight over a 2x2 window
    assert big.index_type == "int"
    norm_sc = plan_of([8, 4, 4], [{"group_norm": {"num_groups": 2}}, {"sum": {"dim": 1}}]).stages[0].schedule
    assert norm_sc.cpu_grain == norm.CPU_TASK_VALUES // 8 and norm_sc.unroll == norm.UNROLL


def test_plan_json_records_target_family_and_schedule():
    target = Target(sm_count=7, max_threads_per_sm=1536)
    data = json.loads(json.dumps(plan_of([3, 10, 10], [CONV2, {"sum": {"dim": 1}}], target=target, plan=ATEN).to_json()))
    assert {k: data["target"][k] for k in ("sm_count", "max_threads_per_sm", "max_grid_y")} == {"sm_count": 7, "max_threads_per_sm": 1536, "max_grid_y": 65535}
    conv, fused = data["stages"]
    assert conv["family"] == "conv_aten" and conv["lowering"] == "direct"
    assert conv["candidates"] == ["conv_aten:channels_last", "conv_aten:contiguous"]  # the reader takes channels_last fast
    assert "conv_gemm declined (the spec asks for ATen (plan.conv: aten))" in conv["choice"]
    # a spec that pins its convolution (plan.conv) has no eager candidate: one decision point
    assert data["choices"] == [{"decision": "implementation @ ops[0].conv2d", "options": conv["candidates"],
                                "chosen": "conv_aten:channels_last"}]
    assert fused["family"] == "pool_reduce" and fused["schedule"]["target_blocks_per_sm"] == 2 * (1536 // 256)
    assert set(fused["schedule"]) >= {"cuda_threads", "r_lanes", "unroll", "min_per_thread", "cpu_grain", "cpu_chunk", "index_type"}


def test_target_is_the_default_without_a_gpu_or_when_forced(monkeypatch):
    monkeypatch.setenv("KGEN_TARGET", "default")
    assert current() == DEFAULT == Target(132, 2048) == H200  # the machine kgen is measured on now
    assert DEFAULT.name == "NVIDIA H200" and DEFAULT.dram_bytes_per_s == 4.3e12 and DEFAULT.ceilings_of is None
    monkeypatch.setenv("KGEN_TARGET", "h100x")
    with pytest.raises(Exception, match="KGEN_TARGET"):
        current()
    monkeypatch.delenv("KGEN_TARGET")
    import torch

    if not torch.cuda.is_available():
        assert current() == DEFAULT


def _fake_device(monkeypatch, name: str, sms: int = 114, memory: int = 80 * 2**30):
    import torch

    props = SimpleNamespace(name=name, multi_processor_count=sms, max_threads_per_multi_processor=2048, major=9,
                            total_memory=memory)
    monkeypatch.delenv("KGEN_TARGET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)


def test_a_known_device_gets_its_own_ceilings_and_an_unknown_one_the_defaults_marked(monkeypatch):
    """The ceilings (bandwidth, FLOP/s, launch cost) come from KNOWN by the device's CUDA name; SMs, threads and
    memory from the device. Another device gets the default's ceilings, and says they were not measured on it."""
    from kgen.explain import explain_text

    assert KNOWN == {"NVIDIA H100 80GB HBM3": H100, "NVIDIA H200": H200}
    assert H100.dram_bytes_per_s == 3.0e12 < H200.dram_bytes_per_s and H100.tensor_flops == H200.tensor_flops
    _fake_device(monkeypatch, H100.name, memory=85_000_000_000)
    t = current()
    assert t == replace(H100, sm_count=114) and t.ceilings_of is None and t.described() == H100.name
    _fake_device(monkeypatch, "NVIDIA H200", sms=132, memory=150_000_000_000)
    assert current() == replace(H200, memory_bytes=150_000_000_000)  # the device's own memory
    _fake_device(monkeypatch, "NVIDIA GeForce RTX 5090", sms=170, memory=32 * 10**9)
    t = current()
    assert (t.name, t.sm_count, t.memory_bytes) == ("NVIDIA GeForce RTX 5090", 170, 32 * 10**9)
    assert (t.dram_bytes_per_s, t.tensor_flops, t.launch_s) == (DEFAULT.dram_bytes_per_s, DEFAULT.tensor_flops, DEFAULT.launch_s)
    assert t.ceilings_of == DEFAULT.name
    text = explain_text(load_pipeline(ROOT / "specs" / "maxpool_sum.yaml"))
    head = "target NVIDIA GeForce RTX 5090 (ceilings of the NVIDIA H200: not measured on this device)"
    assert text.count(head) == 1 and text.count("not measured on this device") == 1  # said once
    assert f"bytes / {DEFAULT.dram_bytes_per_s / 1e12:.1f} TB/s" in text  # the floor at the target's bandwidth


def test_explain_prints_the_targets_own_figures(monkeypatch):
    """kgen explain's target line and floor follow the target (the default: the H200's 4.3 TB/s)."""
    from kgen.explain import explain_text

    monkeypatch.setenv("KGEN_TARGET", "default")
    text = explain_text(load_pipeline(ROOT / "specs" / "maxpool_sum.yaml"))
    assert "; target NVIDIA H200\n" in text and "bytes / 4.3 TB/s" in text and "3.0 TB/s" not in text


# ------------------------------------------------------------------ implementations to choose between


class _GeneratedConv(Family):
    """A stand-in for a generated convolution (conv_gemm): a peer of conv_aten that takes
    the next pool_reduce stage as its epilogue."""

    name = "test_conv_gemm"
    stage_kind = "conv"
    generates_kernel = True
    pieces = ()
    summary = "test"

    def fits(self, ops):
        return conv_aten.FAMILY.fits(ops)

    def accepts(self, ops):  # the op table does not list this family; it takes what conv_aten takes
        return conv_aten.FAMILY.accepts(ops)

    def make_stage(self, req):
        st = conv_aten.FAMILY.make_stage(req)
        st.layout = "contiguous"
        return st

    def absorbs_epilogue(self, stage, nxt):
        return nxt.family is pool_reduce.FAMILY


def test_a_peer_implementation_is_a_candidate_and_may_absorb_the_next_stage(monkeypatch):
    ops = [CONV2, "relu", {"sum": {"dim": 1}}]
    peer = _GeneratedConv()
    monkeypatch.setattr(families, "FAMILIES", (conv_aten.FAMILY, peer, norm.FAMILY, pool_reduce.FAMILY))
    plan = plan_of([3, 10, 10], ops)
    assert families_of(plan) == ["conv_aten", "pool_reduce"]  # ATen stays the default
    assert plan.stages[0].candidates == ("conv_aten:channels_last", "conv_aten:contiguous", "test_conv_gemm")
    chosen = plan_of([3, 10, 10], ops, choices={"implementation @ ops[0].conv2d": "test_conv_gemm"})
    assert chosen.stages[0].family is peer  # a plan's choices name any candidate
    monkeypatch.setattr(families, "FAMILIES", (peer, conv_aten.FAMILY, norm.FAMILY, pool_reduce.FAMILY))
    plan = plan_of([3, 10, 10], ops)
    st, epi = plan.stages  # the generated convolution took the reduction as its epilogue; it keeps its place
    assert isinstance(st, ConvStage) and st.family is peer and st.epilogue is epi and epi.absorbed_by is st
    assert [o.fn for o in epi.ops if isinstance(o, Elementwise)] == ["add", "relu"]
    assert [s.index for s in plan.stages] == [0, 1] and plan.kernel_stages() == [st, epi]


def test_every_family_is_registered_once_with_its_template_folder():
    from kgen.render import TEMPLATES

    names = [f.name for f in families.FAMILIES]
    assert len(set(names)) == len(names)
    for f in families.FAMILIES:
        for piece in f.pieces:
            assert (TEMPLATES / f.template(piece)).is_file(), f.template(piece)
        assert f.generates_kernel == ("stage.h" in f.pieces)


def test_an_op_no_family_takes_is_a_clear_error(monkeypatch):
    from kgen.errors import KgenError
    from kgen.ops import OPS

    monkeypatch.setitem(OPS, "sigmoid", replace(OPS["sigmoid"], families=()))
    with pytest.raises(KgenError, match=r"t.yaml: ops\[1\].sigmoid: no template family computes sigmoid"):
        plan_of([2, 6], ["relu", "sigmoid"])


def test_elementwise_stages_move_16_byte_vectors_where_output_k_is_input_k():
    """pool_reduce's map_vector: 4 float32 or 8 16-bit values per access where nothing is pooled or reduced and
    the input is a plain contiguous tensor whose samples are whole vectors; one at a time otherwise (a sample of
    an odd size, a pool, a channels_last input); kgen explain says which."""
    from kgen.explain import explain_text

    def map_stage(shape, ops, dtype="float32", **kw):
        text = spec_text(shape, ops, **kw).replace("dtype: float32", f"dtype: {dtype}")
        return next(st for st in make_plan(pipeline_of(text), target=DEFAULT).stages if st.kind == "pool_reduce")

    affine = [{"batch_norm": {}}, "relu", {"mul": {"scalar": 2.0}}]
    assert map_stage([8, 6, 6], affine).schedule.map_vector == 4
    assert map_stage([8, 6, 6], affine, dtype="bfloat16").schedule.map_vector == 8
    assert map_stage([8, 6, 6], affine, dtype="float16").schedule.map_vector == 8
    assert map_stage([3, 5, 5], affine).schedule.map_vector == 1  # 75 values a sample: not whole vectors
    pooled = map_stage([8, 6, 6], [{"batch_norm": {}}, {"max_pool2d": {"kernel_size": 2}}])
    assert pooled.schedule.map_vector == 1
    cl = map_stage([8, 6, 6], [{"conv2d": {"out_channels": 32, "kernel_size": 1}}, "relu"],
                   plan={"conv": "aten", "conv_layout": "channels_last"})
    assert cl.input.layout == "channels_last" and cl.schedule.map_vector == 1
    text = explain_text(pipeline_of(spec_text([8, 6, 6], affine), "t.yaml"))
    assert "4 consecutive values per 16-byte load and store" in text


def test_vector_maps_take_lane_order_where_a_vector_spans_channels():
    """schedule.map_lane_order: where a channel holds fewer values than a vector (a GEMM's [N, C] rows, or 2 positions
    per channel in 16 bits) and an op reads a per-channel parameter, the warp's vectors go through shared memory
    and lane l computes values l, l + 32, ...; not where a vector lies in one channel, nor without a parameter."""
    from kgen.explain import explain_text

    def stages(shape, ops, dtype="float32"):
        text = spec_text(shape, ops).replace("dtype: float32", f"dtype: {dtype}")
        return [st for v in choose_plans(pipeline_of(text), DEFAULT).variants for st in v.plan.stages if st.kind == "pool_reduce"]

    affine = [{"batch_norm": {}}, "relu"]
    assert all(st.schedule.map_vector == 4 and st.schedule.map_lane_order for st in stages([64], affine))
    assert all(st.schedule.map_vector == 8 and st.schedule.map_lane_order for st in stages([16, 2], affine, "bfloat16"))
    assert not any(st.schedule.map_lane_order for st in stages([16, 8], affine, "bfloat16"))  # a vector, one channel
    assert not any(st.schedule.map_lane_order for st in stages([64], ["relu", {"mul": {"scalar": 2.0}}]))  # no parameter
    text = explain_text(pipeline_of(spec_text([64], affine), "t.yaml"))
    assert "lane l computing values l, l + 32" in text


def test_the_cost_model_choice_is_no_worse_than_any_one_choice_apart(monkeypatch):
    """Where the decision points allow more plans than candidate_plans enumerates (MAX_CANDIDATES near the
    default plan), the cost model's choice is the cheapest candidate improved one decision at a time: with
    an estimate that falls with every choice away from each point's first option, the choice changes every
    point (the enumeration alone reaches plans of one or two changes), and no plan one choice apart is
    estimated cheaper."""
    from kgen import cost
    from kgen.plan import MAX_CANDIDATES, PIPELINE, candidate_plans

    ops = []
    for i in range(7):
        ops += [{"conv2d": {"out_channels": 32, "kernel_size": 3, "padding": 1, "name": f"conv{i}"}}, "relu",
                {"add": {"scalar": 1.0}}]
    pipe = pipeline_of(spec_text([16, 20, 20], ops, batch=8))
    points = [k for k, v in make_plan(pipe, None, DEFAULT).options.items() if len(v) > 1 and k != PIPELINE]
    assert len(points) >= 7 and len(candidate_plans(pipe, DEFAULT)) == MAX_CANDIDATES

    def estimate(plan, batch):  # 1 ms less per point away from its first option; the eager plan dearest
        if plan.eager:
            return 100.0
        return 50.0 - sum(plan.choices.get(k) != plan.options[k][0] for k in plan.options if k != PIPELINE)

    monkeypatch.setattr(cost, "estimate_ms", estimate)
    chosen = choose_plans(pipe, DEFAULT).variants[0].plan
    assert all(chosen.choices[k] != chosen.options[k][0] for k in points), chosen.choices
    assert "plans one choice apart" in choose_plans(pipe, DEFAULT).variants[0].why
    ms = estimate(chosen, 8)
    for point, options in chosen.options.items():
        for option in options:
            if option != chosen.choices[point]:
                other = make_plan(pipe, None, DEFAULT, {**chosen.choices, point: option}, 8)
                assert estimate(other, 8) >= ms, (point, option)


def test_the_cost_model_prices_the_tensors_an_elementwise_op_reads():
    """KernelBench level 2 #26's form: the output plus a second input of its size, read by the fused stage and by the
    eager candidate's add; each estimate moves that input's bytes once more than its own input and output."""
    from kgen import cost

    pipe = pipeline_of("""
name: two_inputs
inputs:
  x: {shape: [N, 8, 6, 6]}
  y: {shape: [N, 8, 6, 6]}
example: {N: 4}
ops:
  - add: {tensor: y}
  - relu
""")
    fused = make_plan(pipe, target=DEFAULT)
    reads = [w for e in cost.estimate(fused, 4) for w in e.work if w.what == "y read"]
    assert [w.bytes for w in reads] == [4 * 4 * 8 * 6 * 6]
    from kgen.explain import stage_cost

    (stage,) = [s for s in fused.stages if s.family.name == "pool_reduce"]
    assert stage_cost(fused, stage, 4)[1] == 3 * 4 * 4 * 8 * 6 * 6  # the floor's bytes too: x and y read, one written
    eager = make_plan(pipe, target=DEFAULT, choices={"pipeline": "eager"})
    (add,) = [w for e in cost.estimate(eager, 4) for w in e.work if w.what.endswith("add")]
    assert add.bytes == 3 * 4 * 4 * 8 * 6 * 6  # x and y read, the sum written


@pytest.mark.parametrize("generated_ms, eager, as_fast", [(2.0, False, True), (1.9999996, False, True), (1.999, False, False),
                                                         (2.0000004, True, False)])
def test_a_plan_the_eager_candidate_ties_says_so(monkeypatch, generated_ms, eager, as_fast):
    """Where the cost model puts the spec's ops through ATen at the best generated plan's estimate (to TIE_DIGITS
    decimals), the generated plan stays the choice and its variant says the eager candidate is as fast
    (Variant.eager_as_fast; plan.json's "eager_as_fast"), which the Dynamo backend reads."""
    from kgen import cost
    from kgen.render import selection_json

    pipe = pipeline_of(spec_text([8, 6, 6], ["exp"], batch=4))
    monkeypatch.setattr(cost, "estimate_ms", lambda plan, batch: 2.0 if plan.eager else generated_ms)
    sel = choose_plans(pipe, DEFAULT)
    (v,) = sel.variants
    assert v.plan.eager == eager and v.eager_as_fast == as_fast, v.why
    assert selection_json(sel, "t.yaml", 1)["plans"][0].get("eager_as_fast", False) == as_fast


@pytest.mark.parametrize("spec", ["maxpool_sum", "relu_group_norm", "div_max_gap_bias_sum"])
def test_a_plan_made_from_remembered_answers_is_the_plan_made_afresh(spec):
    """make_plan remembers, per pipeline, its rewriting front and the families' answers to each stage request
    (coordinate descent makes hundreds of plans one decision apart); every plan one decision away from the
    default is the one an empty memory makes, and no two plans share a stage (the plan sets their fields)."""
    from kgen import plan as plan_module

    pipe = load_pipeline(ROOT / "specs" / f"{spec}.yaml")
    default = make_plan(pipe, None, DEFAULT, {})
    tries = [{}] + [{point: o} for point, opts in default.options.items() for o in opts[1:]]
    assert len(tries) > 1, default.options
    remembered = [make_plan(pipe, None, DEFAULT, given) for given in tries]
    for made in remembered:
        for st in made.stages:
            st.choice = "changed after planning"  # must not reach a later plan
    afresh = []
    for given in tries:
        plan_module._MEMOS.clear()
        afresh.append(make_plan(pipe, None, DEFAULT, given))
    again = [make_plan(pipe, None, DEFAULT, given) for given in tries]
    for fresh, made in zip(afresh, again):
        assert json.dumps(made.to_json(), sort_keys=True, default=str) == json.dumps(fresh.to_json(), sort_keys=True, default=str)
    ids = [id(st) for made in remembered + again for st in made.stages]
    assert len(ids) == len(set(ids))


def test_a_3d_stride1_transposed_convolution_plans_the_flipped_kernel_call():
    """KernelBench level 2 #77's convolution (64 -> 128, k5, stride 1, batch 16 at 16x32x32): cuDNN's call as written
    in channels_last, without its bias, measured 5.7 ms on the H200 where the flipped-kernel forward call takes 4.1
    (conv_aten.TRANSPOSED_3D_STRIDE1_CL_EFFICIENCY); the default target's plan is the flipped kernel."""
    pipe = pipeline_of(spec_text([64, 16, 32, 32], [{"conv_transpose3d": {"out_channels": 128, "kernel_size": 5}},
                                                   {"mul": {"scalar": 2.0}}, "relu"], batch=16))
    plan = choose_plans(pipe, DEFAULT).variants[0].plan
    assert plan.choices["subpixel_conv_transpose @ ops[0].conv_transpose3d"] == "on", plan.choices
