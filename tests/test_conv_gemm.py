"""The conv_gemm family: when the plan takes the generated convolution, what it fuses in,
what it renders; CPU builds (ATen's convolution, then the epilogue stage) and, on a GPU,
the generated kernels against float64 over many convolution shapes."""
import math
import shutil

import pytest
import torch

from conftest import HAS_CUDA, ROOT, assert_report_passed, build_and_validate, pipeline_of, render_specs, spec_text, write_spec
from kgen.build import build_modules, cuda_home, demangle, ptxas_report
from kgen.families import conv_gemm
from kgen.plan import make_plan
from kgen.render import render_spec, write_rendered
from kgen.target import DEFAULT, H100
from dataclasses import replace
from kgen.validate import TOLERANCES, compare, import_module_dir, validate


def plan_of(shape, ops, target=DEFAULT, **kw):
    return make_plan(pipeline_of(spec_text(shape, ops, **kw)), target=target)


CONV3 = {"conv3d": {"out_channels": 16, "kernel_size": 3}}
GEMM = {"conv": "gemm"}  # plan.conv: rendered specs pin the generated convolution (else tuning or the cost model chooses)
RECOMPUTE = {"conv": "gemm", "conv_norm": "recompute"}  # ... and the norm after it as its two-pass epilogue
ONEPASS = {"conv": "gemm", "conv_norm": "onepass"}  # ... or as its one-pass epilogue on co-resident CTAs


# ------------------------------------------------------------------ planning


def test_small_convolution_is_generated_and_absorbs_aligned_pools():
    plan = plan_of([8, 10, 20, 20], [CONV3, {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [1, 2, 3, 4]}}])
    conv, epi = plan.stages
    assert conv.family is conv_gemm.FAMILY and conv.epilogue is epi and epi.absorbed_by is conv
    f = conv.fused
    assert f.window == (2, 2, 2) and f.kept == () and f.reduced == ("c", "d", "h", "w")
    assert all(t % w == 0 for t, w in zip(conv.schedule.tile, f.window))
    # one partial per tile along the reduced dims, combined by the pool_reduce stage's finalize
    pooled = (4, 9, 9)
    assert f.splits == math.prod(-(-p // t) for p, t in zip(pooled, f.pooled_tile))
    assert not f.registers and conv.schedule.loop == "window"  # stride 1: the register-window main loop


def test_pools_that_do_not_tile_the_output_are_not_fused():
    plan = plan_of([8, 10, 20, 20], [CONV3, {"max_pool3d": {"kernel_size": 3}}, {"sum": {"dim": 1}}])
    conv, epi = plan.stages
    assert conv.family is conv_gemm.FAMILY and conv.epilogue is None and epi.absorbed_by is None


def test_reduction_without_pools_runs_on_the_accumulators():
    plan = plan_of([3, 24, 24], [{"conv2d": {"out_channels": 8, "kernel_size": 3, "stride": 2}}, "sigmoid",
                                 {"sum": {"dim": [1, 2, 3]}}])
    conv = plan.stages[0]
    assert conv.fused.registers and conv.schedule.loop == "generic"  # stride 2: the generic main loop


# An elementwise epilogue whose chain calls libm computes several outputs per thread before storing
# them (Fused.batch); cheap chains, reductions and pools store as they go.
@pytest.mark.parametrize("tail,batch", [
    (["mish"], conv_gemm.EPILOGUE_BATCH),
    ([{"sub": {"scalar": 0.5}}, "gelu", "relu"], conv_gemm.EPILOGUE_BATCH),
    (["relu", "hardswish"], 1),
    ([{"div": {"scalar": 2.0}}, "leaky_relu"], 1),
    (["tanh", {"max": {"dim": 1}}], 1),
])
def test_libm_epilogues_compute_a_batch_before_storing(tail, batch):
    plan = plan_of([8, 40, 40], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}] + tail, plan=GEMM)
    conv = plan.stages[0]
    assert conv.family is conv_gemm.FAMILY and conv.fused is not None and conv.fused.batch == batch
    said = "\n".join(conv.family.explain_lines(conv))
    assert ("channels computed before any is stored (its chain calls libm)" in said) == (batch > 1), said


@pytest.mark.parametrize("ops,kw,why", [
    ([{"conv3d": {"out_channels": 256, "kernel_size": 3}}, "relu"], {}, "large enough for cuDNN"),
    ([CONV3, "relu"], {"precision": "ieee"}, "the fp32 direct loop is no faster"),  # K = 8 x 27
    ([{"conv3d": {"out_channels": 8, "kernel_size": 3, "groups": 2}}, "relu"], {}, None),
])
def test_aten_where_the_generated_convolution_declines(ops, kw, why):
    text = spec_text([8, 8, 12, 12], ops)
    if kw.get("precision"):
        text += f"precision: {kw['precision']}\n"
    plan = make_plan(pipeline_of(text), target=DEFAULT)
    st = plan.stages[0]
    assert st.family.name == "conv_aten"
    if why:  # declined after accepting the op (its reason is recorded)
        assert "conv_gemm declined" in st.choice and why in st.choice
    else:  # grouped convolutions: conv_gemm does not take the op at all
        assert "conv_gemm" not in st.candidates


@pytest.mark.parametrize("cin,cout,k,cudnn", [(480, 96, 1, True), (256, 64, 1, True), (480, 16, 1, False),
                                               (128, 64, 1, False), (32, 64, 3, False)])
def test_a_pointwise_convolution_of_many_channels_is_cudnns(cin, cout, k, cudnn):
    """conv_gemm declines a 1-tap convolution of >= 256 channels to >= 64 over an NC[D]HW input (cuDNN's GEMM 3-9x
    faster, measured: POINTWISE_CUDNN_K); narrower outputs (the window loop wins) and other kernels it keeps."""
    text = spec_text([cin, 12, 12], [{"conv2d": {"out_channels": cout, "kernel_size": k, "padding": k // 2}}], batch=4)
    st = make_plan(pipeline_of(text), target=DEFAULT).stages[0]
    declined = "conv_gemm declined (a pointwise convolution" in (st.choice or "")
    assert declined == cudnn and (st.family.name == "conv_aten") == cudnn, (st.family.name, st.choice)
    forced = make_plan(pipeline_of(spec_text([cin, 12, 12], [{"conv2d": {"out_channels": cout, "kernel_size": k}}],
                                             batch=4, plan=GEMM)), target=DEFAULT).stages[0]
    assert forced.family is conv_gemm.FAMILY  # plan.conv: gemm still has it


def test_ieee_runs_the_direct_loop():
    """precision ieee: the generated convolution in plain fp32 FMAs (the direct loop), all
    output channels in one CTA, fused epilogues as in the tensor-core loops."""
    text = spec_text([3, 8, 16, 16], [CONV3, {"instance_norm": {}}]) + "precision: ieee\n"
    st = make_plan(pipeline_of(text), target=DEFAULT).stages[0]
    assert st.family is conv_gemm.FAMILY and st.schedule.loop == "direct" and st.schedule.mma == "fp32"
    assert st.schedule.block_n >= 16 and st.schedule.tile[2] == 16  # 14 output columns: W tiles of 16
    pooled = spec_text([4, 10, 20, 20], [CONV3, {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [1, 2, 3, 4]}}])
    conv, epi = make_plan(pipeline_of(pooled + "precision: ieee\n"), target=DEFAULT).stages
    assert conv.schedule.loop == "direct" and conv.epilogue is epi and not conv.fused.registers
    # the staged pool tile and the epilogue's scratch are counted in the shared memory the plan checks
    # (the generated kernel asserts that the plan's number covers each epilogue's)
    assert conv.schedule.smem_bytes == conv_gemm.FAMILY.smem_bytes(conv.problems[0], conv.schedule, True,
                                                                   conv_gemm.FUSED_SCRATCH_FLOATS)
    wide = spec_text([8, 20, 20], [{"conv2d": {"out_channels": 100, "kernel_size": 3}}]) + "precision: ieee\n"
    sc = make_plan(pipeline_of(wide), target=DEFAULT).stages[0].schedule
    assert sc.loop == "direct" and sc.block_n == 104 and sc.block_n // sc.warps_n <= 32


def test_mma_precision_follows_what_comes_after_the_convolution():
    """The rules on eager's own cuDNN calls hold on the GPU they were measured on (base.EAGER_RULES_DEVICE,
    the H100); on the default target (the H200, not measured) fp32-level products unless a sum follows."""
    def on_h100(shape, ops, **kw):
        return plan_of(shape, ops, target=H100, **kw)
    normed = on_h100([8, 8, 16, 16], [CONV3, {"instance_norm": {}}])  # K = 216: the norm is not fused in
    pooled = on_h100([3, 8, 16, 16], [CONV3, {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": 1}}])
    assert normed.stages[0].schedule.mma == "tf32x3" and pooled.stages[0].schedule.mma == "tf32"
    assert normed.stages[0].epilogue is None
    # each output carries a convolution value's error (elementwise ops, a max pool): split TF32, as eager's cuDNN
    # runs such small convolutions in fp32; a mean over the values lets TF32 products average out
    elementwise = on_h100([3, 8, 16, 16], [CONV3, "relu", {"clamp": {"min": -1.0, "max": 1.0}}], plan=GEMM)
    max_pooled = on_h100([3, 8, 16, 16], [CONV3, {"max_pool3d": {"kernel_size": 2}}], plan=GEMM)
    averaged = on_h100([3, 8, 16, 16], [CONV3, "relu", {"mean": {"dim": [2, 3, 4]}}], plan=GEMM)
    assert elementwise.stages[0].schedule.mma == max_pooled.stages[0].schedule.mma == "tf32x3"
    assert averaged.stages[0].schedule.mma == "tf32"
    # from 16 input channels eager's cuDNN call is TF32 (EAGER_TF32_MIN_CIN): TF32 products rounded as that
    # call rounds them (ties away), even where each output carries a convolution value's error or a norm follows;
    # split TF32 there would differ from eager by eager's own TF32 error (KernelBench #25's check: 1/5)
    conv16 = {"conv2d": {"out_channels": 32, "kernel_size": 3}}
    for after in (["relu"], [{"min": {"dim": 1}}, "tanh"], [{"group_norm": {"num_groups": 4}}]):
        wide_in = on_h100([16, 12, 12], [conv16] + after, plan=GEMM).stages[0]
        assert wide_in.schedule.mma == "tf32" and not wide_in.tf32_half_even, after
        assert "16 or more input channels" in wide_in.x3_reason
    below = on_h100([15, 12, 12], [conv16, "relu"], plan=GEMM).stages[0]
    assert below.schedule.mma == "tf32x3"
    # outside what was measured (2-d and 3-d, no groups) the rule for small convolutions stands
    conv1d = on_h100([16, 40], [{"conv1d": {"out_channels": 32, "kernel_size": 3}}, "relu"], plan=GEMM).stages[0]
    assert conv1d.schedule.mma == "tf32x3"
    grouped = {"conv2d": {"out_channels": 32, "kernel_size": 3, "groups": 2}}
    cl = {"conv": "aten", "conv_layout": "channels_last"}
    assert "no sum or mean" in on_h100([32, 12, 12], [grouped, "relu"], plan=cl).stages[0].fp32_products
    # where `kgen tune` measured eager's call on the target (Pipeline.eager_conv_tf32), the measurement decides
    # instead of the channel-count and transposed rules; what follows still asks for fp32-level products
    def measured(shape, ops, tf32):
        pipe = pipeline_of(spec_text(shape, ops, plan=GEMM))
        pipe = replace(pipe, eager_conv_tf32=((pipe.ops[0].module, tf32),))
        return make_plan(pipe, target=H100).stages[0]
    small_tf32 = measured([3, 12, 12], [conv16, "relu"], True)
    assert small_tf32.schedule.mma == "tf32" and "measured by `kgen tune`" in small_tf32.x3_reason
    assert measured([16, 12, 12], [conv16, "relu"], False).schedule.mma == "tf32x3"
    assert measured([16, 12, 12], [conv16, "relu", {"mean": {"dim": [2, 3]}}], False).schedule.mma == "tf32"
    up_fp32 = {"conv_transpose2d": {"out_channels": 16, "kernel_size": 3, "stride": 2}}
    assert measured([3, 8, 8], [up_fp32, "relu"], False).schedule.mma == "tf32x3"
    # on a GPU other than the one those two rules were measured on (EAGER_RULES_DEVICE), until `kgen tune`
    # measures eager's calls there: fp32-level products (never less accurate than eager), unless a sum follows
    other = DEFAULT  # the H200

    def unmeasured(shape, ops):
        return make_plan(pipeline_of(spec_text(shape, ops, plan=GEMM)), target=other).stages[0]
    wide = unmeasured([16, 12, 12], [conv16, "relu"])
    assert wide.schedule.mma == "tf32x3" and "NVIDIA H200 is not measured" in wide.x3_reason
    assert unmeasured([3, 8, 8], [up_fp32, "relu"]).schedule.mma == "tf32x3"
    assert unmeasured([16, 12, 12], [conv16, "relu", {"mean": {"dim": [2, 3]}}]).schedule.mma == "tf32"
    # eager's cuDNN call for a transposed convolution is TF32 (cudnn_calibrate.py): TF32 products even before
    # a norm, and cuDNN keeps TF32 allowed in any form
    up = {"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}}
    up_normed = on_h100([3, 8, 16, 16], [up, {"group_norm": {"num_groups": 4}}], plan=GEMM).stages[0]
    assert up_normed.schedule.mma == "tf32" and "transposed" in up_normed.x3_reason
    up_aten = on_h100([3, 8, 16, 16], [up, "relu"], plan={"conv": "aten", "conv_layout": "channels_last"}).stages[0]
    assert up_aten.layout == "channels_last" and not up_aten.fp32_products


INSTNORM_MAX = [CONV3, {"mul": {"param": "m"}}, {"instance_norm": {}}, {"clamp": {"min": -1.0, "max": 1.0}},
                {"max": {"dim": 1}}]


def test_norm_after_a_small_convolution_is_fused_in_by_computing_it_twice():
    """instnorm_clamp_max's shape: K = 3 x 27, 16 channels: the candidate conv_gemm:recompute
    takes the norm stage as the convolution's epilogue on the fp32 direct loop (statistics
    pass, merge, apply pass); the plain conv_gemm candidate writes the output for the norm stage."""
    shape, params = [3, 8, 18, 20], {"m": {"shape": [16, 1, 1, 1]}}
    conv, norm = plan_of(shape, INSTNORM_MAX, params=params, plan=GEMM).stages
    assert conv.candidates == ("conv_gemm", "conv_gemm:recompute", "conv_gemm:onepass")
    written, _ = plan_of(shape, INSTNORM_MAX, params=params, plan={**GEMM, "conv_norm": "written"}).stages
    assert written.candidates == ("conv_gemm",) and written.epilogue is None and written.schedule.mma == "tf32x3"
    conv, norm = plan_of(shape, INSTNORM_MAX, params=params, plan=RECOMPUTE).stages
    assert conv.candidates == ("conv_gemm:recompute",)
    assert conv.family is conv_gemm.FAMILY and conv.epilogue is norm and norm.absorbed_by is conv
    sc, fn = conv.schedule, conv.fused_norm
    assert sc.loop == "direct" and sc.mma == "fp32" and sc.warps_n == 1 and sc.block_n == 16
    assert fn.groups == 16 and fn.reduce == "max"
    assert fn.tiles == math.prod(-(-o // t) for o, t in zip(conv.problems[0].out, sc.tile))
    # the epilogue's scratch is counted in the shared memory the plan checks
    assert sc.smem_bytes == conv_gemm.FAMILY.smem_bytes(conv.problems[0], sc, False, conv_gemm.norm_scratch_floats(sc))
    assert [w.what for w in conv_gemm.FAMILY.work(conv, 2, DEFAULT)][1:] == [
        "direct convolution + statistics", "merge statistics", "direct convolution + apply"]
    from kgen.explain import explain_text

    text = explain_text(pipeline_of(spec_text(shape, INSTNORM_MAX, params=params, plan=RECOMPUTE)))
    assert "direct main loop, fp32" in text and "stage 1 (norm) is its epilogue: the convolution runs twice" in text
    assert "runs inside stage 0's kernel" in text
    grouped = plan_of([4, 9, 11], [{"conv2d": {"out_channels": 24, "kernel_size": 3}}, {"group_norm": {"num_groups": 3}}],
                      plan=RECOMPUTE)
    conv = grouped.stages[0]
    assert conv.fused_norm is not None and conv.fused_norm.groups == 3 and conv.fused_norm.reduce == ""


def test_norm_after_a_small_convolution_can_run_once_on_coresident_ctas():
    """conv_gemm:onepass: the same direct loop and scratch, one pass; the tiles of a sample run
    at once (at most one per SM at plan time) and wait for each other's moments."""
    shape, params = [3, 8, 18, 20], {"m": {"shape": [16, 1, 1, 1]}}
    conv, norm = plan_of(shape, INSTNORM_MAX, params=params, plan=ONEPASS).stages
    assert conv.candidates == ("conv_gemm:onepass",) and conv.epilogue is norm and norm.absorbed_by is conv
    sc, fn = conv.schedule, conv.fused_norm
    assert fn.one_pass and fn.groups == 16 and fn.reduce == "max"
    assert fn.tiles == math.prod(-(-o // t) for o, t in zip(conv.problems[0].out, sc.tile))
    assert sc.smem_bytes == conv_gemm.FAMILY.smem_bytes(conv.problems[0], sc, False, conv_gemm.norm_scratch_floats(sc))
    work = conv_gemm.FAMILY.work(conv, 2, DEFAULT)
    assert [w.what for w in work][1:2] == ["direct convolution + statistics + apply"]
    # every CTA merges its sample's moments once per round of co-resident samples: the more
    # samples than fit at once, the more rounds the cost model counts
    merge = lambda batch: conv_gemm.FAMILY.work(conv, batch, DEFAULT)[2].latency_s  # noqa: E731
    per_round = conv_gemm.ONEPASS_CTAS_PER_SM * DEFAULT.sm_count // fn.tiles
    assert merge(per_round) == merge(1) > 0 and merge(per_round + 1) == 2 * merge(1)
    from kgen.explain import explain_text

    text = explain_text(pipeline_of(spec_text(shape, INSTNORM_MAX, params=params, plan=ONEPASS, batch=400)))
    assert f"the convolution runs once, the {fn.tiles} tiles of a sample on co-resident CTAs" in text
    # the estimate's pieces, the merges' rounds among them (400 samples: more than fit at once)
    rounds = -(-400 // per_round)
    assert f"+ moment merges: {rounds} rounds x " in next(line for line in text.splitlines() if "      model: " in line)
    # a device of fewer SMs than a sample has tiles: the two-pass form and the written output remain
    small = replace(DEFAULT, sm_count=fn.tiles - 1)
    auto = make_plan(pipeline_of(spec_text(shape, INSTNORM_MAX, params=params, plan=GEMM)), target=small).stages[0]
    assert auto.candidates == ("conv_gemm", "conv_gemm:recompute")


@pytest.mark.parametrize("shape,conv", [
    ([8, 8, 12, 12], CONV3),  # K = 8 x 27: the second convolution costs more than it saves
    ([4, 12, 12], {"conv2d": {"out_channels": 40, "kernel_size": 3}}),  # two warp columns of channels
])
def test_norm_is_not_fused_where_recomputing_does_not_pay(shape, conv):
    conv_st = plan_of(shape, [conv, {"instance_norm": {}}, "relu"], plan=RECOMPUTE).stages[0]
    assert conv_st.family is conv_gemm.FAMILY and conv_st.epilogue is None and conv_st.schedule.mma == "tf32x3"
    assert conv_st.candidates == ("conv_gemm",)


def test_transposed_convolution_runs_as_its_phases():
    plan = plan_of([6, 9, 11], [{"conv_transpose2d": {"out_channels": 10, "kernel_size": 3, "stride": 2, "padding": 1}}, "relu"])
    st = plan.stages[0]
    assert st.family is conv_gemm.FAMILY and len(st.problems) == 4
    assert {p.out_residue[1:] for p in st.problems} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    # every output position belongs to exactly one phase
    full = st.out_type.spatial
    covered = sorted((r_h + 2 * i, r_w + 2 * j) for p in st.problems for r_h, r_w in [p.out_residue[1:]]
                     for i in range(p.out[1]) for j in range(p.out[2]))
    assert covered == [(h, w) for h in range(full[0]) for w in range(full[1])]


@pytest.mark.parametrize("cin,cout,rank,big", [(3, 16, 3, True), (4, 8, 3, True), (5, 16, 3, False), (3, 24, 3, False),
                                                (3, 16, 2, False)])
def test_few_channel_3d_phases_take_big_window_tiles(cin, cout, rank, big):
    """KernelBench #58's kind of convolution (3 -> 16, k3 s2, 3-d): 4 x 16 x 16 tiles of 16 warps for its phases
    with TF32 products (conv_gemm.PHASE_BIG_TILE_MAX_CIN / _COUT; on the H100, where eager's transposed convolution
    runs TF32); more channels or 2-d keep the window loop's usual tiles, and so do split-TF32 products (on the H200,
    eager's precision not measured: 16 warps' 128 registers do not hold both operand parts)."""
    shape = [cin, 6, 10, 12] if rank == 3 else [cin, 10, 12]
    conv = {f"conv_transpose{rank}d": {"out_channels": cout, "kernel_size": 3, "stride": 2, "padding": 1}}
    sc = plan_of(shape, [conv, "relu"], target=H100, plan=GEMM).stages[0].schedule
    assert sc.loop == "window" and sc.mma == "tf32"
    assert (sc.tile == (4, 16, 16) and sc.warps_m == 16) == big, sc
    split = plan_of(shape, [conv, "relu"], plan=GEMM).stages[0].schedule
    assert split.loop == "window" and split.mma == "tf32x3" and split.warps_m < 16, split


def test_wgmma_loop_where_it_wins_on_hopper():
    """The wgmma main loop for wide convolutions (>= 32 output channels, >= 8 input
    channels) on a Hopper target; the mma.sync loops elsewhere and on other GPUs."""
    from dataclasses import replace

    wide = ([8, 30, 41], [{"conv2d": {"out_channels": 64, "kernel_size": 6, "stride": 4}}, "sigmoid",
                          {"sum": {"dim": [1, 2, 3]}}])
    st = plan_of(*wide, plan=GEMM).stages[0]
    assert st.schedule.loop == "wgmma" and st.fused.registers
    assert st.schedule.tile[2] == 8 and st.schedule.warps_m % 4 == 0 and st.schedule.block_n == 64
    other = make_plan(pipeline_of(spec_text(*wide, plan=GEMM)), target=replace(DEFAULT, wgmma=False)).stages[0]
    assert other.family is conv_gemm.FAMILY and other.schedule.loop == "generic"  # stride 4
    narrow = plan_of([8, 10, 20, 20], [CONV3], plan=GEMM).stages[0]
    assert narrow.schedule.loop == "window"  # 16 output channels: the window loop wins
    split = plan_of([8, 30, 41], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, {"group_norm": {"num_groups": 4}}],
                    plan=GEMM).stages[0]
    assert split.schedule.mma == "tf32x3" and split.schedule.loop == "window"  # split TF32 keeps mma.sync


def test_wgmma_teams_share_the_weights_as_far_as_shared_memory_allows(tmp_path):
    """The wgmma loop runs teams of one warpgroup that share the resident weights: as many as
    fit (WGMMA_SHAPES) beside the epilogue's own shared memory, which the plan counts per team
    (A buffer, staged tile, scratch); the rendered kernel carries both numbers."""
    wide = ([8, 30, 41], [{"conv2d": {"out_channels": 64, "kernel_size": 6, "stride": 4}}, "sigmoid",
                          {"sum": {"dim": [1, 2, 3]}}])
    st = plan_of(*wide, plan=GEMM).stages[0]
    sc = st.schedule
    assert st.fused.registers and (sc.tile, sc.warps_m, sc.warps_n, sc.teams) == ((1, 8, 8), 4, 1, 3)
    p = st.problems[0]
    weights = 8 * 36 * 64  # K x N floats, resident once
    a_buffer = 2 * 34 * 4 * 4 * 9  # two channel quads x 34 box rows x (4 W phases x 9 columns x 4 channels)
    assert conv_gemm.FAMILY.smem_bytes(p, sc, False, conv_gemm.FUSED_SCRATCH_FLOATS) == 4 * (
        weights + 3 * (a_buffer + conv_gemm.FUSED_SCRATCH_FLOATS)) == sc.smem_bytes
    # a staged epilogue (a pool kept per position, then summed over the channels: TF32) needs its tile
    # per team: fewer teams fit
    big = ([32, 40, 40], [{"conv2d": {"out_channels": 128, "kernel_size": 3}}, {"max_pool2d": {"kernel_size": 2}},
                          {"sum": {"dim": 1}}])
    pooled = plan_of(*big, plan=GEMM).stages[0]
    assert pooled.schedule.loop == "wgmma" and not pooled.fused.registers
    assert pooled.schedule.teams < 3 and pooled.schedule.smem_bytes <= conv_gemm.SMEM_LIMIT
    rendered = render_spec(write_spec(tmp_path, spec_text(*wide, plan=GEMM), "teams.yaml"), tmp_path / "gen")
    kernel = next(v for k, v in rendered.files.items() if str(k).endswith("kernel.cu"))
    assert "static constexpr int kTeams = 3;" in kernel
    assert f"constexpr int kPlanSmemBytes = {sc.smem_bytes};" in kernel and "covers this epilogue's" in kernel


def test_wgmma_store_stages_its_tile_where_the_plans_shared_memory_holds_it(tmp_path):
    """The conv output of the stage run alone (its Store epilogue) on the wgmma loop goes through a
    staged tile (stores of consecutive positions) when the plan's shared memory holds one; a fused
    plan whose teams fill it stores from the accumulators; the direct loop never stages. (A channel
    sum follows, so the products are TF32 and the loop wgmma.)"""
    written = ([16, 20, 24], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, "relu", {"sum": {"dim": 1}}])
    st = plan_of(*written, plan=GEMM).stages[0]
    assert st.schedule.loop == "wgmma" and st.store_staged()
    p = st.problems[0]
    assert conv_gemm.FAMILY.smem_bytes(p, st.schedule, True) <= st.schedule.smem_bytes
    fused = ([8, 30, 41], [{"conv2d": {"out_channels": 64, "kernel_size": 6, "stride": 4}}, "sigmoid",
                           {"sum": {"dim": [1, 2, 3]}}])
    teams = plan_of(*fused, plan=GEMM).stages[0]
    assert teams.schedule.teams == 3 and not teams.store_staged()
    for shape_ops, staged in ((written, True), (fused, False)):
        rendered = render_spec(write_spec(tmp_path, spec_text(*shape_ops, plan=GEMM), f"s{staged}.yaml"), tmp_path / f"g{staged}")
        kernel = next(v for k, v in rendered.files.items() if str(k).endswith("kernel.cu"))
        assert f"using Store = StoreEpilogue<{'true' if staged else 'false'}>;" in kernel


def test_register_pool_takes_a_2x2x2_max_pool_reduced_to_one_value_on_the_window_loop(tmp_path):
    """A conv3d followed by a 2 x 2 x 2 max pool and a reduction over everything runs the pool in
    registers (no staged tile; the scratch holds the depth-1 warps' maxima) where every tile holds
    a pooled window; an average pool, a
    kept channel dim or a 1 x 2 x 2 window keeps the staged epilogue."""
    pooled = ([8, 10, 21, 37], [{"conv3d": {"out_channels": 12, "kernel_size": 3}}, {"max_pool3d": {"kernel_size": 2}},
                                {"sum": {"dim": [1, 2, 3, 4]}}])
    st = plan_of(*pooled, plan=GEMM).stages[0]
    f, sc = st.fused, st.schedule
    assert sc.loop == "window" and f.register_pool and not f.registers
    m_tiles = sc.tile[0] * sc.tile[1] * sc.tile[2] // sc.warps_m // 16
    assert f.scratch == 32 + sc.warps_m // 2 * 32 * (m_tiles // 2) * (sc.block_n // 8) * 2
    assert sc.smem_bytes == conv_gemm.FAMILY.smem_bytes(st.problems[0], sc, False, f.scratch)
    for ops in ([pooled[1][0], {"avg_pool3d": {"kernel_size": 2}}, pooled[1][2]],
                [pooled[1][0], pooled[1][1], {"sum": {"dim": [2, 3, 4]}}],
                [pooled[1][0], {"max_pool3d": {"kernel_size": [1, 2, 2]}}, pooled[1][2]]):
        other = plan_of(pooled[0], ops, plan=GEMM).stages[0]
        assert other.fused is not None and not other.fused.register_pool, ops
    # 7 output depths (the dead-region rewrite off: it would compute only the 6 the pool reads): 4 tiles of 2
    # but 3 pooled depths, the last tile has no window and one partial per tile would not fit the stage's
    # 3 per sample: the staged epilogue, which skips such tiles
    odd = plan_of([8, 9, 21, 37], pooled[1], plan=GEMM, rewrites={"dead_region": False}).stages[0]
    assert odd.problems[0].out == (7, 19, 35) and odd.fused is not None
    assert not odd.fused.register_pool and odd.fused.scratch == 32
    with_rewrite = plan_of([8, 9, 21, 37], pooled[1], plan=GEMM).stages[0]
    assert with_rewrite.problems[0].out == (6, 18, 34) and with_rewrite.fused.register_pool
    rendered = render_spec(write_spec(tmp_path, spec_text(*pooled, plan=GEMM), "rp.yaml"), tmp_path / "gen")
    kernel = next(v for k, v in rendered.files.items() if str(k).endswith("kernel.cu"))
    assert "level1_after_pool(" in kernel and f"static constexpr int kScratchFloats = {f.scratch};" in kernel


def test_schedules_keep_the_kernels_static_rules_over_many_shapes():
    """Plan many random convolutions; every schedule passes ConvGemm.check (the kernel's
    static_asserts, at plan time): a broken one would fail to compile on the GPU machine."""
    import random

    rng = random.Random(7)
    planned = fused_norms = 0
    for _ in range(150):
        rank = rng.choice((1, 2, 3))
        cin, cout = rng.randint(1, 40), rng.randint(1, 130)
        spatial = [rng.randint(5, 14) for _ in range(rank)]
        k = rng.randint(1, 4)
        transposed = rng.random() < 0.3
        op = {f"conv_transpose{rank}d" if transposed else f"conv{rank}d": {
            "out_channels": cout, "kernel_size": k, "stride": rng.randint(1, min(k, 3) if transposed else 3),
            "padding": rng.randint(0, k // 2)} | ({} if transposed else {"dilation": rng.randint(1, 2)})}
        ops = [op] + rng.choice([[], ["relu"], [{"sum": {"dim": 1}}], [{f"max_pool{rank}d": {"kernel_size": 2}}, {"mean": {"dim": list(range(2, 2 + rank))}}],
                                 [{"instance_norm": {}}, {"max": {"dim": 1}}]])
        precision = rng.choice(("tf32", "tf32", "ieee"))
        try:  # a norm after it: its recompute form where it applies
            pipe = pipeline_of(spec_text([cin] + spatial, ops, plan={"conv_norm": "recompute"}) + f"precision: {precision}\n")
        except Exception:  # noqa: BLE001 - a shape that does not fit: draw again
            continue
        st = make_plan(pipe, target=DEFAULT).stages[0]  # ConvGemm.check runs inside; it raises on a broken schedule
        planned += 1
        if st.family is conv_gemm.FAMILY:
            conv_gemm.FAMILY.check(st.schedule, st.problems)
            fused_norms += st.fused_norm is not None
    assert planned > 100 and fused_norms >= 3


# ------------------------------------------------------------------ rendering and CPU builds

SPECS = {
    # a fused 3-d pool + reduction; a 2-d stride-2 sigmoid-sum on the accumulators; a transposed 2-d
    # convolution (phases, its output written) feeding a norm; a 1-d convolution feeding a channel max
    "cg_pool3d": spec_text([5, 6, 10, 18], [{"conv3d": {"out_channels": 12, "kernel_size": 3, "padding": 1}},
                                           {"max_pool3d": {"kernel_size": 2}}, {"add": {"scalar": 0.5}},
                                           {"sum": {"dim": [1, 3]}}], name="cg_pool3d", plan=GEMM),
    "cg_sigsum": spec_text([3, 21, 26], [{"conv2d": {"out_channels": 8, "kernel_size": 3, "stride": 2}}, "sigmoid",
                                        {"sum": {"dim": [1, 2, 3]}}], name="cg_sigsum", plan=GEMM),
    "cg_transposed": spec_text([7, 6, 9], [{"conv_transpose2d": {"out_channels": 9, "kernel_size": 4, "stride": 2,
                                                                 "padding": 1}},
                                           {"group_norm": {"num_groups": 3}}], name="cg_transposed", plan=GEMM),
    "cg_conv1d": spec_text([9, 40], [{"conv1d": {"out_channels": 13, "kernel_size": 5, "dilation": 2}},
                                     {"max": {"dim": 1}}], name="cg_conv1d", plan=GEMM),
    "cg_odd": spec_text([3, 17, 29], [{"conv2d": {"out_channels": 33, "kernel_size": 3, "padding": 1}}, "relu"],
                        name="cg_odd", plan=GEMM),
    # KernelBench #58's convolution (a 3-d transposed one, 3 -> 16): its 8 phases in rounds on the window
    # loop, written for a logsumexp stage. ptxas: 108 registers; an equivalent form of conv_ctas' one-tile
    # round count compiled to 96 registers and spilled (2026-11-27)
    "cg_tr3d": spec_text([3, 16, 32, 32], [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2,
                                                                "padding": 1}},
                                         {"logsumexp": {"dim": 1, "keepdim": True}}], name="cg_tr3d", plan=GEMM),
    # the wgmma loop: a written output (staged epilogue) and a transposed convolution's phases
    "cg_wide": spec_text([16, 20, 23], [{"conv2d": {"out_channels": 48, "kernel_size": 3, "padding": 1}}, "relu"],
                         name="cg_wide", plan=GEMM),
    "cg_wide_tr": spec_text([12, 5, 7, 9], [{"conv_transpose3d": {"out_channels": 32, "kernel_size": 3, "stride": 2,
                                                                   "padding": 1}}, "relu"], name="cg_wide_tr",
                            plan=GEMM),
    # the direct loop (ieee): a fused pool + reduction (staged tile), a sigmoid-sum on the accumulators,
    # transposed phases whose output is written from the accumulators
    "cg_direct_pool": spec_text([4, 6, 10, 18], [{"conv3d": {"out_channels": 12, "kernel_size": 3, "padding": 1}},
                                                {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [1, 3]}}],
                                name="cg_direct_pool", plan=GEMM) + "precision: ieee\n",
    "cg_direct_sig": spec_text([3, 21, 26], [{"conv2d": {"out_channels": 40, "kernel_size": 3, "stride": 2}}, "sigmoid",
                                            {"sum": {"dim": [1, 2, 3]}}], name="cg_direct_sig", plan=GEMM) + "precision: ieee\n",
    "cg_direct_tr": spec_text([7, 6, 9], [{"conv_transpose2d": {"out_channels": 9, "kernel_size": 4, "stride": 2,
                                                                "padding": 1}}, "relu"], name="cg_direct_tr",
                              plan=GEMM) + "precision: ieee\n",
    # a norm fused in (the convolution twice, the direct loop): a channel max after the instance norm
    # (odd sizes, partial tiles); an affine group norm over 3 groups of 4 channels, its output written;
    # a 1-d convolution with stride, then a channel mean and an op after it
    "cg_norm_max": spec_text([3, 5, 19, 37], INSTNORM_MAX, params={"m": {"shape": [16, 1, 1, 1], "init": "randn"}},
                             name="cg_norm_max", plan=RECOMPUTE),
    "cg_norm_gn": spec_text([4, 13, 21], [{"conv2d": {"out_channels": 12, "kernel_size": 3, "padding": 1}},
                                          {"group_norm": {"num_groups": 3}}, "relu"], name="cg_norm_gn", plan=RECOMPUTE),
    "cg_norm_1d": spec_text([5, 77], [{"conv1d": {"out_channels": 10, "kernel_size": 5, "stride": 2}},
                                      {"instance_norm": {}}, {"mean": {"dim": 1}}, "sigmoid"], name="cg_norm_1d",
                            plan=RECOMPUTE),
}
# An average pool folded into a transposed convolution (rewrites.avg_pool_folding): an ordinary convolution
# over the input, the pooled output computed directly. KernelBench #50's geometry (3 -> 16, k3 s2 p1, pool 2: a
# 2 x 2 x 2 kernel of stride 1) at odd sizes, its scalar factor moved past the pool; a 2-d k5 s2 p2 one whose
# two pools compose to 4 (a 4 x 4 kernel of stride 2, padded by 1).
FOLD_SPECS = {
    "cg_fold_tr3d": spec_text([3, 5, 9, 10], [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2,
                                                                    "padding": 1}}, {"mul": {"scalar": 0.5}},
                                              {"avg_pool3d": {"kernel_size": 2}}, {"add": {"param": "shift"}}],
                              params={"shift": {"shape": [16, 1, 1, 1], "init": "randn"}}, name="cg_fold_tr3d", plan=GEMM),
    "cg_fold_tr2d": spec_text([6, 11, 13], [{"conv_transpose2d": {"out_channels": 10, "kernel_size": 5, "stride": 2,
                                                                  "padding": 2}}, {"avg_pool2d": {"kernel_size": 2}},
                                            {"avg_pool2d": {"kernel_size": 2}}, "tanh"], name="cg_fold_tr2d", plan=GEMM),
}
SPECS.update(FOLD_SPECS)
# the same three in one pass (8, 2 and 1 tiles per sample), and a 3-d group norm of 4 groups of 4
# channels over 16 tiles, partial in D, H and W (16 does not divide an H100's 132 SMs: each staggered
# group leaves CTAs without tiles)
for _name in ("cg_norm_max", "cg_norm_gn", "cg_norm_1d"):
    SPECS[_name.replace("norm", "onepass")] = SPECS[_name].replace(
        f"name: {_name}", f"name: {_name.replace('norm', 'onepass')}").replace("conv_norm: recompute", "conv_norm: onepass")
SPECS["cg_onepass_gn3d"] = spec_text([2, 9, 20, 40], [{"conv3d": {"out_channels": 16, "kernel_size": 3}},
                                                     {"group_norm": {"num_groups": 4}}, {"mul": {"scalar": -2.0}}],
                                     name="cg_onepass_gn3d", plan=ONEPASS)
# cg_tr3d's ops at a ninth of its output (11 x 35 x 35 per channel: its phases still a full tile and a partial one in each
# dim), its plan checked to be cg_tr3d's (test_cpu_twins_plan_as_their_originals): the CPU build validates this one, as
# validating cg_tr3d in float64 on the CPU took 18 s of the file's time; cg_tr3d keeps its size for ptxas' register count
CPU_TWINS = {"cg_tr3d": "cg_tr3d_small"}
SPECS["cg_tr3d_small"] = SPECS["cg_tr3d"].replace("name: cg_tr3d", "name: cg_tr3d_small").replace(
    "- 16\n  - 32\n  - 32\n", "- 6\n  - 18\n  - 18\n")
NORM_SPECS = ("cg_norm_max", "cg_norm_gn", "cg_norm_1d")
ONEPASS_SPECS = ("cg_onepass_max", "cg_onepass_gn", "cg_onepass_1d", "cg_onepass_gn3d")


@pytest.fixture(scope="module")
def cg_modules(tmp_path_factory):
    return render_specs(tmp_path_factory.mktemp("cg"), SPECS)


def test_rendered_sources_carry_the_plan(cg_modules):
    spec, d = cg_modules["cg_pool3d"]
    kernel = (d / "kernel.cu").read_text()
    binding = (d / "binding.cpp").read_text()
    assert '#include "conv_gemm/conv_gemm.cuh"' in kernel and "static constexpr int kCin = 5, kCout = 12;" in kernel
    assert "stage0_fused(x.contiguous()" in binding and "// stage 1: the epilogue of stage 0" in binding
    spec, d = cg_modules["cg_transposed"]
    assert (d / "kernel.cu").read_text().count("struct Phase") == 4


def test_cpu_twins_plan_as_their_originals(cg_modules):
    for name, twin in CPU_TWINS.items():
        full, small = (make_plan(pipeline_of(cg_modules[n][0].read_text()), target=DEFAULT) for n in (name, twin))
        assert [full.pipeline.input.shape, small.pipeline.input.shape] == [("N", 3, 16, 32, 32), ("N", 3, 6, 18, 18)]
        assert small.choices == full.choices, (small.choices, full.choices)
        assert [(repr(s.family), s.kind) for s in small.stages] == [(repr(s.family), s.kind) for s in full.stages]
        drop = ("smem_bytes",)  # the only field the output's size may change
        assert [{k: v for k, v in vars(s.schedule).items() if k not in drop} for s in small.stages] == \
            [{k: v for k, v in vars(s.schedule).items() if k not in drop} for s in full.stages]


@pytest.mark.slow
def test_cpu_builds_validate(cg_modules):
    cpu = {n: m for n, m in cg_modules.items() if n not in CPU_TWINS}  # a twin validates in its place
    build_modules([d for _, d in cpu.values()], "cpu")
    for name, (spec, d) in cpu.items():
        report = validate(spec, d, "cpu")
        assert_report_passed(report, name)


@pytest.mark.slow
@pytest.mark.skipif(cuda_home() is None and shutil.which("nvcc") is None, reason="needs nvcc")
def test_generated_kernels_compile_without_spills(cg_modules):
    from concurrent.futures import ThreadPoolExecutor

    names = ("cg_transposed", "cg_tr3d", "cg_fold_tr3d", "cg_fold_tr2d", "cg_conv1d", "cg_odd", "cg_wide", "cg_wide_tr", "cg_direct_pool",
             "cg_direct_sig", "cg_direct_tr") + NORM_SPECS + ONEPASS_SPECS
    with ThreadPoolExecutor(2) as pool:  # nvcc compiles on one core: two at once
        reports = dict(zip(names, pool.map(lambda n: ptxas_report(cg_modules[n][1], "9.0a"), names)))
    for name, kernels in reports.items():
        assert any("conv_kernel" in k.name or "phases_kernel" in k.name for k in kernels)
        bad = [f"{demangle(k.name)}: stack {k.stack}, spills {k.spill_stores}/{k.spill_loads}, serialized wgmma {k.serialized_wgmma}"
               for k in kernels if not k.clean]
        assert not bad, bad


def test_fused_norms_render_both_passes(cg_modules):
    for name in NORM_SPECS + ONEPASS_SPECS:
        spec, d = cg_modules[name]
        plan = make_plan(pipeline_of(spec.read_text()), target=DEFAULT)
        fn = plan.stages[0].fused_norm
        assert fn is not None and fn.one_pass == (name in ONEPASS_SPECS), name
        kernel, binding = (d / "kernel.cu").read_text(), (d / "binding.cpp").read_text()
        two_pass = "run<NormMoments>" in kernel and "merge_moments_kernel<<<" in kernel and "run<NormApply>" in kernel
        one_pass = "run_coresident<Problem, NormOnePass>" in kernel and "cudaMemsetAsync(a.arrived" in kernel
        assert (one_pass, two_pass) == ((True, False) if fn.one_pass else (False, True)), name
        assert ("arrived_cache.get<int>(arrived, batch" in binding) == fn.one_pass, name
    tiles = {n: make_plan(pipeline_of(cg_modules[n][0].read_text()), target=DEFAULT).stages[0].fused_norm.tiles
             for n in ONEPASS_SPECS}
    assert tiles == {"cg_onepass_max": 8, "cg_onepass_gn": 2, "cg_onepass_1d": 1, "cg_onepass_gn3d": 16}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fused_norms_match_float64(cg_modules):
    """The norm epilogues on the GPU: validate's cases (batches, NaN, inf, large values) against
    float64; a NaN or inf in one sample's convolution makes that sample's normalized output NaN."""
    dirs = [cg_modules[n][1] for n in NORM_SPECS + ONEPASS_SPECS]
    build_modules(dirs, "cuda")
    for name in NORM_SPECS + ONEPASS_SPECS:
        spec, d = cg_modules[name]
        report = validate(spec, d, "cuda")
        assert_report_passed(report, name)
    # one pass at a batch of several rounds of co-resident samples (an H100 holds 264 of these CTAs:
    # 33 samples of 8 tiles, 16 of 16), every round waiting on its own samples' counts
    for name in ONEPASS_SPECS:
        spec, d = cg_modules[name]
        report = validate(spec, d, "cuda", stages=False, batch=101)
        assert_report_passed(report, f"{name} at batch 101")


# ------------------------------------------------------------------ GPU: many convolutions against float64

# ------------------------------------------------------------------ phase_pool

PHASE_POOL = "conv_gemm:phase_pool"
MAXPOOL_SUM = ([32, 32, 32, 32], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 5, "stride": 2, "padding": 2}},
                                  {"max_pool3d": {"kernel_size": 2}}, {"max_pool3d": {"kernel_size": 3}},
                                  {"sum": {"dim": 1, "keepdim": True}}])


def plan_on(candidate, shape, ops, target=DEFAULT, **kw):
    """The plan with stage 0 on ``candidate`` (None where it is not one)."""
    pipe = pipeline_of(spec_text(shape, ops, **kw))
    first = make_plan(pipe, target=target)
    if candidate not in first.stages[0].candidates:
        return None
    return make_plan(pipe, target=target, choices={f"implementation @ {pipe.ops[0].key}": candidate})


def phase_pool_plan(shape, ops, target=DEFAULT, **kw):
    return plan_on(PHASE_POOL, shape, ops, target, **kw)


def emulate_phase_pool(pp, x, w):
    """The convolution as phase_pool computes it, from its tables alone (float64): every phase's taps
    at their box offsets and weight taps, over the pooled region. x [Cin, D, H, W], w [Cin, Cout, K..]."""
    cin, cout = w.shape[:2]
    kernel = w.shape[2:]
    q = [pp.tq[0] * pp.pooled[0], pp.tq[1] * pp.pooled[1], pp.tq[2] * pp.pooled[2]]
    out = torch.zeros(cout, *(s * n for s, n in zip(pp.stride, q)), dtype=torch.float64)
    lo = [-e for e in pp.emin]
    pad = [lo[i] + q[i] + pp.box[i] for i in range(3)]  # room for every offset
    xp = torch.nn.functional.pad(x, (lo[2], pad[2], lo[1], pad[1], lo[0], pad[0]))
    wf = w.reshape(cin, cout, -1)
    bh, bw = pp.box[1], pp.box[2]
    for wg in range(2):
        j = 0
        for ph in pp.phases[wg]:
            rd, rh, rw = pp.residues[ph]
            acc = torch.zeros(cout, *q, dtype=torch.float64)
            for _ in range(pp.taps[ph]):
                off, tap = pp.offsets[wg][j], pp.weight_taps[wg][j]
                j += 1
                bd_, bh_, bw_ = off // (bh * bw), off // bw % bh, off % bw  # box index = q + e - e_min
                xs = xp[:, bd_:bd_ + q[0], bh_:bh_ + q[1], bw_:bw_ + q[2]]
                acc += torch.einsum("io,idhw->odhw", wf[:, :, tap], xs)
            out[:, rd::pp.stride[0], rh::pp.stride[1], rw::pp.stride[2]] = acc
    return out


@pytest.mark.parametrize("shape,conv,window", [
    ([32, 32, 32, 32], {"out_channels": 64, "kernel_size": 5, "stride": 2, "padding": 2}, 6),  # maxpool_sum
    ([8, 5, 9, 10], {"out_channels": 64, "kernel_size": 4, "stride": 2, "padding": 1}, 4),
    ([8, 4, 6, 7], {"out_channels": 64, "kernel_size": 5, "stride": 3, "padding": 2}, 6),
    ([16, 6, 7, 9], {"out_channels": 64, "kernel_size": 3, "stride": [2, 1, 2], "padding": 1}, [4, 2, 4]),
])
def test_phase_pool_tables_compute_the_transposed_convolution(shape, conv, window):
    """Every phase's taps, box offsets and weight taps (what the kernel reads) give PyTorch's
    transposed convolution over the pooled region, each phase on one warpgroup, the two within a
    phase's taps of each other; the box holds every offset's reads."""
    ops = [{"conv_transpose3d": conv}, {"max_pool3d": {"kernel_size": window}}, {"sum": {"dim": 1, "keepdim": True}}]
    plan = phase_pool_plan(shape, ops)
    assert plan is not None
    st = plan.stages[0]
    pp = st.phase_pool
    assert st.epilogue is plan.stages[1] and plan.stages[1].absorbed_by is st
    assert sorted(pp.phases[0] + pp.phases[1]) == list(range(len(pp.taps)))
    loads = [sum(pp.taps[i] for i in g) for g in pp.phases]
    assert abs(loads[0] - loads[1]) <= max(pp.taps) and [len(o) for o in pp.offsets] == loads
    assert st.phase_pool_packed_floats() == sum(loads) * shape[0] * 64
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    w = torch.randn(shape[0], 64, *([conv["kernel_size"]] * 3), dtype=torch.float64)
    got = emulate_phase_pool(pp, x, w)
    ref = torch.nn.functional.conv_transpose3d(x[None], w, stride=conv["stride"], padding=conv["padding"])[0]
    ref = ref[:, :got.shape[1], :got.shape[2], :got.shape[3]]
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-10)
    # the box: the last valid column of the last row of the last plane reads inside it
    for o in pp.offsets[0] + pp.offsets[1]:
        bd_, bh_, bw_ = o // (pp.box[1] * pp.box[2]), o // pp.box[2] % pp.box[1], o % pp.box[2]
        assert bd_ + pp.tq[0] <= pp.box[0] and bh_ + pp.tq[1] <= pp.box[1] and bw_ + pp.tq[2] * pp.pooled[2] <= pp.box[2]


def test_phase_pool_is_maxpool_sums_candidate_and_the_cost_models_choice():
    shape, ops = MAXPOOL_SUM
    plan = phase_pool_plan(shape, ops)
    pp = plan.stages[0].phase_pool
    assert pp.tq == (3, 3, 3) and pp.box == (5, 5, 32) and pp.pooled == (10, 10, 10)
    assert sorted(pp.taps) == [8, 12, 12, 12, 18, 18, 18, 27]
    assert sorted(sum(pp.taps[i] for i in g) for g in pp.phases) == [62, 63]
    # K = 32 x 27 rules the generated loops out (cuDNN wins there): phase_pool is conv_gemm's only candidate
    assert [c for c in plan.stages[0].candidates if c.startswith("conv_gemm")] == [PHASE_POOL]
    from kgen.plan import choose_plans
    chosen = choose_plans(pipeline_of(spec_text(shape, ops))).variants[0].plan
    assert chosen.stages[0].phase_pool is not None


@pytest.mark.parametrize("shape,ops,target", [
    # the pool window (3) is not a whole number of strides (2)
    ([8, 5, 6, 7], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": 2}},
                    {"max_pool3d": {"kernel_size": 3}}, {"sum": {"dim": 1}}], DEFAULT),
    # 32 output channels (one m64 block of 64 only)
    ([8, 5, 6, 7], [{"conv_transpose3d": {"out_channels": 32, "kernel_size": 3, "stride": 2}},
                    {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], DEFAULT),
    # no reduction over the channels
    ([8, 5, 6, 7], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": 2}},
                    {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [2, 3, 4]}}], DEFAULT),
    # an average pool
    ([8, 5, 6, 7], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": 2}},
                    {"avg_pool3d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], DEFAULT),
    # no wgmma on the target
    (MAXPOOL_SUM[0], MAXPOOL_SUM[1], replace(DEFAULT, wgmma=False)),
    # 12 input channels (a k step is 8)
    ([12, 5, 6, 7], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": 2}},
                     {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": 1}}], DEFAULT),
])
def test_phase_pool_is_not_offered_outside_its_pattern(shape, ops, target):
    assert phase_pool_plan(shape, ops, target=target) is None


def test_phase_pool_keeps_the_precision_the_spec_asks_for():
    shape, ops = MAXPOOL_SUM
    for precision in ("tf32x3", "ieee"):
        pipe = pipeline_of(spec_text(shape, ops) + f"precision: {precision}\n")
        assert PHASE_POOL not in make_plan(pipe, target=DEFAULT).stages[0].candidates


# ------------------------------------------------------------------ pool_ring

POOL_RING = "conv_gemm:pool_ring"
DIV_MAX = ([8, 16, 64, 64], [CONV3, {"div": {"scalar": 2.0}}, {"max_pool3d": {"kernel_size": 2}},
                             {"adaptive_avg_pool3d": {"output_size": [1, 1, 1]}}, {"sum": {"dim": 1}}])
POOL_ALL = [{"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [1, 2, 3, 4]}}]


def pool_ring_plan(shape, ops, target=DEFAULT, **kw):
    return plan_on(POOL_RING, shape, ops, target, **kw)


def test_pool_ring_is_div_maxs_candidate_and_the_cost_models_choice(tmp_path):
    shape, ops = DIV_MAX
    plan = pool_ring_plan(shape, ops)
    st = plan.stages[0]
    pr = st.pool_ring
    assert st.epilogue is plan.stages[1] and plan.stages[1].absorbed_by is st and st.fused is None
    # 7 plane pairs x 16 blocks of 4 rows (62 rows) per sample; pool_ring.cuh's layout: 4 pair planes of 4
    # ring slots x 6 box rows x 68 columns x 2 channels (+4 floats: 4 mod 32), the A fragments, 8 sums
    assert pr.pooled == (7, 31, 31) and pr.row_blocks == 16 and pr.splits == 7 * 16
    assert pr.packed_floats == 27 * 32 * 4 and pr.smem_bytes == 4 * (4 * (4 * 6 * 68 * 2 + 4) + 27 * 32 * 4 + 8)
    from kgen.plan import choose_plans
    chosen = choose_plans(pipeline_of(spec_text(shape, ops))).variants[0].plan
    assert chosen.stages[0].pool_ring is not None
    # what the templates render from it
    spec = write_spec(tmp_path, spec_text(shape, ops, name="dm"), "dm.yaml")
    files = render_spec(spec, tmp_path / "gen").files
    kernel, stage_h, binding = (files[f"dm/{f}"] for f in ("kernel.cu", "stages.h", "binding.cpp"))
    assert "struct PoolRingProblem" in kernel and "kPooledD = 7, kPooledH = 31, kPooledW = 31" in kernel
    assert "level1_after_pool(" in kernel and "launch_finalize(a, kSplits" in kernel
    assert "constexpr int kSplits = 112;" in stage_h and f"kPoolRingPackedFloats = {27 * 32 * 4}" in stage_h
    assert "kPoolRingPackedFloats" in binding and "kSplits" in binding


@pytest.mark.parametrize("shape,ops,kw", [
    ([8, 8, 12, 32], [{"conv3d": {"out_channels": 16, "kernel_size": 3, "stride": 2}}] + POOL_ALL, {}),
    ([8, 8, 12, 32], [{"conv3d": {"out_channels": 16, "kernel_size": 3, "padding": 1}}] + POOL_ALL, {}),
    ([8, 8, 12, 32], [{"conv3d": {"out_channels": 16, "kernel_size": 5}}] + POOL_ALL, {}),
    ([8, 8, 12, 32], [{"conv3d": {"out_channels": 32, "kernel_size": 3}}] + POOL_ALL, {}),  # two m16 tiles
    ([12, 8, 12, 32], [CONV3] + POOL_ALL, {}),  # a k step is 8 channels
    ([8, 8, 12, 68], [CONV3] + POOL_ALL, {}),  # rows past 64 positions
    ([8, 8, 12, 30], [CONV3] + POOL_ALL, {}),  # rows not in 16-byte pieces
    ([8, 8, 12, 32], [CONV3, {"avg_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [1, 2, 3, 4]}}], {}),
    ([8, 8, 12, 32], [CONV3, {"max_pool3d": {"kernel_size": 3}}, {"sum": {"dim": [1, 2, 3, 4]}}], {}),
    ([8, 8, 12, 32], [CONV3, {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [3, 4]}}], {}),  # D kept (channels kept: per_channel)
    ([8, 8, 12, 32], [CONV3] + POOL_ALL, {"plan": {"conv": "aten"}}),
])
def test_pool_ring_is_not_offered_outside_its_pattern(shape, ops, kw):
    assert pool_ring_plan(shape, ops, **kw) is None


def test_pool_ring_keeps_the_precision_the_spec_asks_for():
    shape, ops = DIV_MAX
    for precision in ("tf32x3", "ieee"):
        pipe = pipeline_of(spec_text(shape, ops) + f"precision: {precision}\n")
        assert POOL_RING not in make_plan(pipe, target=DEFAULT).stages[0].candidates


PHASE_POOL_CASES = [
    # (input [C, D, H, W], ops): a ReLU before the pool, a mean over the channels, a stride of 3, an
    # anisotropic stride, a bias and a scale after the pool
    ([16, 6, 7, 9], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": 2, "padding": 1}}, "relu",
                     {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": 1, "keepdim": True}}]),
    ([8, 5, 9, 10], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 4, "stride": 2, "padding": 1}},
                     {"max_pool3d": {"kernel_size": 4}}, {"mean": {"dim": 1}}]),
    ([8, 4, 6, 7], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 5, "stride": 3, "padding": 2}},
                    {"max_pool3d": {"kernel_size": 3}}, {"mul": {"scalar": 0.5}}, {"sum": {"dim": 1, "keepdim": True}}]),
    ([16, 6, 7, 9], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 3, "stride": [2, 1, 2], "padding": 1}},
                     {"max_pool3d": {"kernel_size": [2, 3, 2]}}, {"sum": {"dim": 1}}]),
]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_phase_pool_kernels_match_float64(tmp_path):
    """conv_gemm:phase_pool on a Hopper GPU, each case validated (batches 1 to 3, NaN, large values,
    ties, +-inf) against float64 at the tf32 tolerance, NaN masks exact; the plans take phase_pool; and
    one case at a batch whose last round of tiles runs split into parts."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("phase_pool runs on wgmma (sm_90a)")
    out = tmp_path / "gen"
    cases = []
    for i, (shape, ops) in enumerate(PHASE_POOL_CASES):
        name = f"pp{i}"
        spec = write_spec(tmp_path, spec_text(shape, ops, name=name, batch=3), f"{name}.yaml")
        write_rendered(render_spec(spec, out), out)
        cases.append((spec, out / name))
        import json
        stages = json.loads((out / name / "plan.json").read_text())["plans"][0]["stages"]
        assert "phase_pool" in stages[0], f"{name}: {stages[0].get('choice')}"
    build_modules([d for _, d in cases], "cuda")
    for spec, d in cases:
        report = validate(spec, d, "cuda")
        assert_report_passed(report, d.name)
    # a batch whose last round runs split (phase_pool.cuh split_last_round): pp3 has 10 tiles per sample and
    # 2 parts per tile; the tiles past the last whole round of one CTA per SM must fit 2 CTAs each
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = next(b for b in range(1, 1000) if 10 * b > sms and 0 < 2 * (10 * b % sms) <= sms)
    spec, d = cases[3]
    report = validate(spec, d, "cuda", stages=False, batch=batch)
    assert_report_passed(report, f"{d.name} at batch {batch}")


RANDOM_CONVS = [
    # (input shape [C, *S], conv op, precision)
    ([3, 37, 29], {"conv2d": {"out_channels": 33, "kernel_size": 3, "padding": 1}}, "tf32"),
    ([16, 40, 41], {"conv2d": {"out_channels": 24, "kernel_size": [5, 3], "stride": 2, "padding": [2, 1]}}, "tf32"),
    ([9, 9, 12, 13], {"conv3d": {"out_channels": 16, "kernel_size": 3, "padding": 2, "dilation": 2}}, "tf32x3"),
    ([33, 101], {"conv1d": {"out_channels": 70, "kernel_size": 7, "stride": 3, "padding": 3}}, "tf32"),
    ([13, 37, 29], {"conv2d": {"out_channels": 40, "kernel_size": [3, 5], "padding": [1, 2], "dilation": [2, 1]}}, "tf32x3"),
    ([5, 7, 19, 35], {"conv3d": {"out_channels": 8, "kernel_size": [2, 3, 3], "padding": 1}}, "tf32"),
    ([12, 5, 7, 9], {"conv_transpose3d": {"out_channels": 20, "kernel_size": 3, "stride": 2, "padding": 1}}, "tf32"),
    ([7, 11, 13], {"conv_transpose2d": {"out_channels": 33, "kernel_size": 4, "stride": 3, "padding": 1}}, "tf32x3"),
    ([9, 6, 10, 20], {"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "padding": 1}}, "tf32"),
    ([6, 50], {"conv_transpose1d": {"out_channels": 11, "kernel_size": 5, "stride": 2}}, "tf32x3"),
    # the wgmma loop (tf32, >= 8 input, >= 32 output channels): odd sizes, stride 4, dilation with two
    # input-channel chunks, 3-d transposed phases
    ([16, 21, 19], {"conv2d": {"out_channels": 48, "kernel_size": 3, "padding": 1}}, "tf32"),
    ([8, 30, 41], {"conv2d": {"out_channels": 64, "kernel_size": 6, "stride": 4}}, "tf32"),
    ([9, 23, 18], {"conv2d": {"out_channels": 40, "kernel_size": [3, 5], "padding": [1, 2], "dilation": [2, 1]}}, "tf32"),
    ([12, 5, 7, 9], {"conv_transpose3d": {"out_channels": 32, "kernel_size": 3, "stride": 2, "padding": 1}}, "tf32"),
    # the direct loop (ieee): odd sizes, stride and two weight column warps, dilation with two input-channel
    # chunks, 3-d transposed phases, 1-d stride 3
    ([3, 9, 13, 35], {"conv3d": {"out_channels": 20, "kernel_size": 3, "padding": 1}}, "ieee"),
    ([5, 40, 41], {"conv2d": {"out_channels": 40, "kernel_size": [5, 3], "stride": 2, "padding": [2, 1]}}, "ieee"),
    ([7, 20, 23], {"conv2d": {"out_channels": 8, "kernel_size": 3, "padding": 2, "dilation": 2}}, "ieee"),
    ([6, 5, 7, 9], {"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}}, "ieee"),
    ([7, 101], {"conv1d": {"out_channels": 12, "kernel_size": 7, "stride": 3, "padding": 3}}, "ieee"),
]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_random_convolutions_match_float64(tmp_path):
    """Each convolution built in parallel and validated (batches 1 to 3, NaN, large values,
    +-inf into the kernel) against float64 at its precision's tolerance, NaN masks exact.
    tf32: the convolution, a ReLU and a sum over the channels (TF32 products, as a sum follows);
    tf32x3 and ieee: the convolution is the output (split TF32; fp32 FMAs)."""
    out = tmp_path / "gen"
    cases = []
    for i, (shape, op, precision) in enumerate(RANDOM_CONVS):
        name = f"cg_rand{i}"
        ops = [op, "relu", {"sum": {"dim": 1}}] if precision == "tf32" else [op]
        spec = write_spec(tmp_path, spec_text(shape, ops, name=name, plan=GEMM) + f"precision: {precision}\n", f"{name}.yaml")
        rendered = render_spec(spec, out)
        write_rendered(rendered, out)
        cases.append((spec, out / name, precision))
    build_modules([d for _, d, _ in cases], "cuda")
    loops = []
    for spec, d, precision in cases:
        pipe_text = spec.read_text()
        report = validate(spec, d, "cuda")
        assert_report_passed(report, f"{d.name} ({pipe_text.splitlines()[-2]})")
        st = make_plan(pipeline_of(pipe_text)).stages[0]
        assert st.family is conv_gemm.FAMILY
        loops.append(st.schedule.loop)
    assert {"generic", "window"} <= set(loops) and loops.count("direct") == 5, loops
    if torch.cuda.get_device_capability()[0] == 9:  # Hopper: the wide ones take the wgmma loop
        assert loops.count("wgmma") == 4, loops


# Strided transposed convolutions whose phases run in rounds (conv_gemm.cuh phase_dispatch: loops that read
# their weights from global memory); at the example batch each phase has several times more tiles than an H100
# has resident CTAs, so every CTA runs several rounds of all phases. Both on the window loop (a phase is a
# stride-1 convolution): a KernelBench #58-like 3-d one (3 input channels), a 2-d stride-3 one in split TF32.
ROUND_CONVS = {
    "cg_rounds_window": ([3, 8, 16, 16], {"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2,
                                                                "padding": 1}}, "tf32", 256),
    "cg_rounds_2d": ([7, 40, 44], {"conv_transpose2d": {"out_channels": 12, "kernel_size": 4, "stride": 3,
                                                             "padding": 1}}, "tf32x3", 512),
}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_transposed_phases_in_rounds_match_float64(tmp_path):
    """Validated against float64 at batches 1 to 3 with the adversarial cases, and at the example batch
    (several rounds per CTA)."""
    texts = {name: spec_text(shape, [op, "relu", {"sum": {"dim": 1}}] if precision == "tf32" else [op], name=name, plan=GEMM,
                             batch=batch) + f"precision: {precision}\n"
             for name, (shape, op, precision, batch) in ROUND_CONVS.items()}
    cases = list(render_specs(tmp_path, texts).values())
    build_modules([d for _, d in cases], "cuda")
    for spec, d in cases:
        st = make_plan(pipeline_of(spec.read_text())).stages[0]
        assert st.family is conv_gemm.FAMILY and st.schedule.loop == "window", st.schedule
        assert "run_phases" in (d / "kernel.cu").read_text()
        assert_report_passed(validate(spec, d, "cuda", example_batch=True), d.name)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_folded_transposed_convolutions_match_float64(tmp_path):
    """FOLD_SPECS on the GPU: the folded weights made on the device, the ordinary convolution's kernel, validated
    against the pipeline as written in float64 (batches 1 to 3, adversarial cases, and the example batch)."""
    # named apart from cg_modules' modules of the same specs, which other tests load in this process
    texts = {f"{n}_alone": t.replace(f"name: {n}\n", f"name: {n}_alone\n") for n, t in FOLD_SPECS.items()}
    cases = list(render_specs(tmp_path, texts).values())
    build_modules([d for _, d in cases], "cuda")
    for spec, d in cases:
        st = make_plan(pipeline_of(spec.read_text())).stages[0]
        assert st.family is conv_gemm.FAMILY and st.conv.lowering.name == "folded" and not st.phases, st
        assert_report_passed(validate(spec, d, "cuda", example_batch=True), d.name)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["avgpool_sigmoid_sum", "div_max_gap_bias_sum", "instnorm_clamp_max", "maxpool_sum", "relu_group_norm"])
def test_kernelbench_style_check(name, modules):
    """What KernelBench's evaluator does: the same seed for both models' weights, 5 inputs
    from torch.rand, torch.allclose at atol = rtol = 1e-4 against eager PyTorch."""
    from handwritten import MODELS
    from kgen.ir import load_pipeline

    shape = load_pipeline(ROOT / "specs" / f"{name}.yaml").input.concrete(2)
    torch.manual_seed(42)
    eager = MODELS[name]().cuda()
    torch.manual_seed(42)
    ours = modules[name].Model().cuda()
    with torch.no_grad():
        for trial in range(5):
            x = torch.rand(shape, device="cuda")
            a, b = ours(x), eager(x)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"trial {trial}: max abs diff {float((a - b).abs().max()):.3g}"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_split_tf32_error_stays_at_eagers_over_a_long_k(tmp_path):
    """tf32x3 over K = 1152 (conv2d 128 -> 64, k3) on one-signed data, where every add of the sum has one
    sign: the window loop's error against float64 is at most twice eager's (cuDNN, TF32 off). Accumulated
    in place in the tensor cores, whose adds truncate, it was ~10x (lab conv_lab/k_error.py in docs/performance.md)."""
    text = spec_text([128, 20, 20], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}], name="cg_long_k",
                     plan=GEMM, batch=4) + "precision: tf32x3\n"
    (spec, d), = render_specs(tmp_path, {"cg_long_k": text}).values()
    build_modules([d], "cuda")
    st = make_plan(pipeline_of(text)).stages[0]
    assert st.family is conv_gemm.FAMILY and st.schedule.mma == "tf32x3", st.schedule
    mod = import_module_dir(d)
    model = mod.Model().cuda()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.rand(4, 128, 20, 20, device="cuda", generator=g)
    w = torch.randn(64, 128, 3, 3, device="cuda", generator=g).abs() / 34.0
    b = torch.randn(64, device="cuda", generator=g)
    params = dict(model.named_parameters())
    (wname,) = [k for k, v in params.items() if v.dim() == 4]
    (bname,) = [k for k, v in params.items() if v.dim() == 1]
    tf32 = torch.backends.cudnn.allow_tf32
    try:
        with torch.no_grad():
            params[wname].copy_(w)
            params[bname].copy_(b)
            got = model(x).double()
            torch.backends.cudnn.allow_tf32 = False
            eager = torch.nn.functional.conv2d(x, w, b).double()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    ref = torch.nn.functional.conv2d(x.double(), w.double(), b.double())
    err, eager_err = (got - ref).abs().max().item(), (eager - ref).abs().max().item()
    assert err <= 2 * eager_err, (err, eager_err)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_tf32_transposed_convolutions_round_as_eagers_cudnn_call(tmp_path, monkeypatch):
    """ConvGemmStage.tf32_half_even: a transposed convolution's TF32 operands round ties to even, as
    cuDNN's transposed-convolution kernels do, so kgen's TF32 phases and eager's call (TF32 allowed)
    differ only by the order of their fp32 sums: far less than either is off float64 (ties away from
    zero left ~45% of TF32's error between them, which a batch norm after it scaled past 1e-4).
    The window loop (3 -> 16, KernelBench #72's) and the wgmma loop (16 -> 32, #15's) on Hopper. Eager's call
    taken as measured TF32 (the H100's cuDNN runs these on TF32; the H200's in fp32, where kgen plans tf32x3)."""
    from kgen import tunefile

    monkeypatch.setattr(tunefile, "eager_conv_tf32", lambda stored, pipe: ((pipe.ops[0].module, True),))
    convs = {"cg_round_window": [3, 6, 10, 12], "cg_round_wide": [16, 6, 10, 12]}
    texts = {name: spec_text(shape, [{"conv_transpose3d": {"out_channels": 16 if shape[0] == 3 else 32, "kernel_size": 3,
                                                              "stride": 2, "padding": 1}}], name=name, plan=GEMM, batch=4)
             for name, shape in convs.items()}
    cases = render_specs(tmp_path, texts)
    build_modules([d for _, d in cases.values()], "cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        for name, (spec, d) in cases.items():
            pipe = pipeline_of(texts[name])
            st = make_plan(replace(pipe, eager_conv_tf32=tunefile.eager_conv_tf32(None, pipe))).stages[0]
            assert st.family is conv_gemm.FAMILY and st.schedule.mma == "tf32" and st.tf32_half_even, st.schedule
            assert "kTf32HalfEven = true" in (d / "kernel.cu").read_text()
            torch.manual_seed(0)
            model = import_module_dir(d).Model().cuda()
            (w,) = [v for v in model.parameters() if v.dim() == 5]
            (b,) = [v for v in model.parameters() if v.dim() == 1]
            x = torch.randn([4] + convs[name], device="cuda")
            with torch.no_grad():
                ours = model(x).double()
                eager = torch.nn.functional.conv_transpose3d(x, w, b, stride=2, padding=1).double()
            ref = torch.nn.functional.conv_transpose3d(x.double(), w.double(), b.double(), stride=2, padding=1)
            apart, eager_err = (ours - eager).abs().max().item(), (eager - ref).abs().max().item()
            assert apart <= 0.05 * eager_err, (name, apart, eager_err)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_libm_epilogue_batches_match_float64(tmp_path):
    """Fused.batch > 1 on tiles the output does not fill (37 x 45 and 7 x 11 x 19 outputs, 40 channels
    in a 64-channel block: the clamped coordinates; a parameter over every output position, whose loads
    past the output would leave it), validated with the adversarial cases."""
    texts = {
        "cg_libm_2d": spec_text([5, 39, 47], [{"conv2d": {"out_channels": 40, "kernel_size": 3}}, {"add": {"param": "p"}}, "mish"],
                                params={"p": {"shape": [40, 37, 45], "init": "randn"}}, name="cg_libm_2d", plan=GEMM, batch=3),
        "cg_libm_3d": spec_text([3, 9, 13, 21], [{"conv3d": {"out_channels": 16, "kernel_size": 3}}, {"mul": {"scalar": 2.0}},
                                                 "tanh", "sigmoid"], name="cg_libm_3d", plan=GEMM, batch=2),
    }
    rendered = render_specs(tmp_path, texts)
    for name, (spec, d) in rendered.items():
        assert make_plan(pipeline_of(texts[name])).stages[0].fused.batch == conv_gemm.EPILOGUE_BATCH, name
        assert "constexpr int kBatch" in (d / "kernel.cu").read_text()
    build_and_validate(rendered, "cuda")


# The cost model's choices that `kgen tune` of KernelBench problems measured (H200, 2026-11-27, 1feed18; the
# model decides where a spec has no tuning file): the spec's own sizes, batch as in the problem.
@pytest.mark.parametrize("shape,ops,batch,chosen", [
    # #25: conv2d 16 -> 64 k3 and a channel min: the window loop (2.87 ms) beat cuDNN in NCHW (3.62)
    ([16, 256, 256], [{"conv2d": {"out_channels": 64, "kernel_size": 3}}, {"min": {"dim": 1, "keepdim": True}},
                      "tanh", "tanh"], 128, "conv_gemm"),
    # #21: 128 tiles per sample before a group norm: the written form (2.04 ms) beat the one-pass
    # form (3.97), whose CTAs each merge 64 moment terms per lane in every one of 63 rounds
    ([8, 256, 256], [{"conv2d": {"out_channels": 32, "kernel_size": 3}}, "sigmoid", {"group_norm": {"num_groups": 8}}],
     128, "conv_gemm"),
    # instnorm_clamp_max's shape: 14 tiles per sample, the one-pass form (0.19 ms) beat the written (0.24)
    ([3, 16, 32, 32], [CONV3, {"instance_norm": {}}, {"clamp": {"min": -1.0, "max": 1.0}}, {"max": {"dim": 1}}],
     128, "conv_gemm:onepass"),
    # #34: ConvTranspose3d 32 -> 64 k4 s2 as sub-pixel phases: cuDNN in channels_last (3.08 ms) beat
    # the generated phases (3.88) and cuDNN's NCHW phases (5.47), whose outputs are written strided
    ([32, 16, 32, 32], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 4, "stride": 2, "padding": 1}},
                        {"layer_norm": {"normalized_shape": [64]}}], 32, "conv_aten:channels_last"),
])
def test_the_cost_models_convolution_choice_follows_the_measurements(shape, ops, batch, chosen):
    from kgen.plan import choose_plans

    plan = choose_plans(pipeline_of(spec_text(shape, ops, batch=batch))).variants[0].plan
    assert plan.choices["implementation @ ops[0]." + next(iter(ops[0]))] == chosen


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("depth,splits", [(6, 2), (24, 11), (72, 35)])
def test_a_reduction_over_depth_tiles_combines_its_partials(tmp_path, depth, splits):
    """KernelBench #24's pattern: a min over the depth in the convolution's epilogue, one partial per
    depth tile; the finalize kernel gives an output 1, 4 or 32 lanes by the count of partials (2, 11,
    35 here), odd output counts leaving threads past the end in the last block. Against float64 with
    validate's cases (NaN, inf, ties, large values) at several batches."""
    ops = [{"conv3d": {"out_channels": 24, "kernel_size": 3}}, {"min": {"dim": 2}}, {"softmax": {"dim": 1}}]
    name = f"cg_min_depth{depth}"
    text = spec_text([3, depth, 10, 13], ops, plan=GEMM, name=name)
    st = make_plan(pipeline_of(text), target=DEFAULT).stages[0]
    assert st.epilogue is not None and st.fused.splits == splits
    build_and_validate(render_specs(tmp_path, {name: text}), "cuda")
