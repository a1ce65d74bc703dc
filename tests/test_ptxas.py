"""Every generated CUDA source compiles for sm_90a with no spills, no local memory and no wgmma
serialized by ptxas (C7518).

Needs nvcc only (no GPU, no CUDA torch). Whole kernels through ptxas take minutes on 2 cores: these are in the
slow set, which runs on a GPU machine (README); the parser they read ptxas with is tested in test_build.py.
"""
import re
import shutil

import pytest

from conftest import (CL_ATEN, CONV16, POOL16, INPUT_COPIES, KEPT_WALKS, LAYER_NORMS, NORM_LAYOUTS, ROOT, SHIPPED, SOFTMAXES, TRANSPOSE_TILES, VIEW_VECTORS_SPEC, render_kept_walk,
                      render_layer_norm, render_norm_layout, render_softmax, render_transpose_tile, spec_text, write_spec)
from kgen.build import cuda_home, demangle, ptxas_report

NEEDS_NVCC = pytest.mark.skipif(cuda_home() is None and shutil.which("nvcc") is None, reason="needs nvcc")
pytestmark = [NEEDS_NVCC, pytest.mark.slow]


@pytest.mark.parametrize("name", SHIPPED)
def test_kernels_compile_without_spills(name):
    kernels = ptxas_report(ROOT / "generated" / name, "9.0a")
    assert kernels, "ptxas reported no kernels"
    bad = [f"{demangle(k.name)}: stack {k.stack}, spills {k.spill_stores}/{k.spill_loads}, serialized wgmma {k.serialized_wgmma}"
           for k in kernels if not k.clean]
    assert not bad, bad
    assert all(k.registers > 0 for k in kernels)


@pytest.mark.parametrize("name", sorted(NORM_LAYOUTS))
def test_norm_layouts_compile_without_spills(name, tmp_path):
    """Each layout of the norm kernels (conftest.NORM_LAYOUTS) is the one its sizes choose, and compiles clean."""
    _, module_dir = render_norm_layout(name, tmp_path)
    kernels = ptxas_report(module_dir, "9.0a")
    stats_by = NORM_LAYOUTS[name][2][0]
    copies = 1 if len(NORM_LAYOUTS[name]) > 3 else 0  # its ATen convolution (channels_last) has a generated input copy
    names = [demangle(k.name) for k in kernels]
    norm = [n for n in names if any(f in n for f in ("stats_kernel", "finalize_kernel", "apply_kernel"))]
    assert len(norm) == (2 if stats_by == "warp" else 3)  # no finalize step after a warp's statistics
    assert sum("to_channels_last_kernel" in n for n in names) == copies and len(names) == len(norm) + copies, names
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", sorted(LAYER_NORMS))
def test_layer_norms_compile_without_spills(name, tmp_path):
    """Each row form of the layer_norm kernels (conftest.LAYER_NORMS) compiles clean: one kernel, and a
    second one with vector loads where the rows take them (the launch picks by alignment); the tiles form
    (a thread per row: row_threads 1) as layer_norm_tiles_kernel."""
    _, module_dir = render_layer_norm(name, tmp_path)
    kernels = ptxas_report(module_dir, "9.0a")
    names = [demangle(k.name) for k in kernels]
    row_threads, vector = LAYER_NORMS[name][5]
    kernel = "layer_norm_tiles_kernel" if row_threads == 1 else "layer_norm_kernel"
    assert sum(kernel + ("<" if row_threads == 1 else "") in n for n in names) == (2 if vector > 1 else 1), names
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_softmaxes_compile_without_spills(name, tmp_path):
    """Each form of the softmax kernel (conftest.SOFTMAXES: columns of 1, 2 or 4 lanes per slice, rows of
    part of a warp, a warp or a block; values held in registers or read twice; tiles of a channels_last input's
    positions) compiles clean: one kernel (the tiles form: one of vector loads, one of scalar loads)."""
    _, module_dir = render_softmax(name, tmp_path)
    kernels = ptxas_report(module_dir, "9.0a")
    names = [demangle(k.name) for k in kernels]
    if SOFTMAXES[name][5][0] == "tiles":  # a kernel of vector loads and one of scalar loads (the launch picks by alignment)
        assert sum("softmax_tiles_kernel<" in n for n in names) == 2, names
    else:
        assert sum("softmax_kernel" in n for n in names) == 1, names
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", sorted(INPUT_COPIES))
def test_input_copies_compile_without_spills(name, tmp_path):
    """The generated input copy of an ATen convolution (conftest.INPUT_COPIES) compiles clean."""
    from kgen.render import render_spec, write_rendered

    shape, ops = INPUT_COPIES[name]
    spec = write_spec(tmp_path, spec_text(shape, ops, name=name, batch=3, plan=CL_ATEN), f"{name}.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    kernels = ptxas_report(tmp_path / "gen" / name, "9.0a")
    assert any("to_channels_last_kernel" in demangle(k.name) for k in kernels)
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", [n for n, t in sorted(TRANSPOSE_TILES.items()) if t[3]])
def test_vector_transpose_tiles_compile_without_spills(name, tmp_path):
    """The channels_last -> NC[D]HW tile with 16-byte loads (conftest.TRANSPOSE_TILES with a vector) and its
    value-by-value fallback compile clean."""
    _, module_dir = render_transpose_tile(name, tmp_path)
    kernels = ptxas_report(module_dir, "9.0a")
    names = [demangle(k.name) for k in kernels]
    assert any("transpose_vector_kernel" in n for n in names) and any("transpose_kernel" in n for n in names), names
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", sorted(KEPT_WALKS))
def test_kept_walks_compile_without_spills(name, tmp_path):
    """The reduction kernels that walk their outputs in a channels_last input's order (conftest.KEPT_WALKS) compile clean."""
    _, module_dir = render_kept_walk(name, tmp_path)
    kernels = ptxas_report(module_dir, "9.0a")
    assert any("reduce_kernel" in demangle(k.name) for k in kernels)
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


def test_vector_maps_over_views_compile_without_spills(tmp_path):
    """pool_reduce's vector map kernel over views whose rows stay adjacent (conftest.VIEW_VECTORS_SPEC), in float32
    and bfloat16, and its value-by-value fallback compile clean: a vector kernel for each stage that takes vectors
    (4 in float32, 3 in bfloat16; one of each repeats an expanded value)."""
    from kgen.render import render_spec, write_rendered

    spec = write_spec(tmp_path, VIEW_VECTORS_SPEC, "view_vectors.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    kernels = ptxas_report(tmp_path / "gen" / "view_vectors", "9.0a")
    names = [demangle(k.name) for k in kernels]
    assert sum("map_vector_kernel" in n for n in names) == 7 and sum("map_kernel" in n for n in names) == 8, names
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


def test_linear_gemm_16_bit_compiles_without_spills(tmp_path):
    """linear_gemm's kernel in bfloat16 and float16 (a 256 -> 512 product with an elementwise epilogue, and rows of
    a rank-3 input with a bias parameter after the product): the 16-bit instances of gemm_kernel, each with its store
    and its fused epilogue, compile clean; no split or fixup kernel of the 16-bit types exists."""
    from kgen.render import render_spec, write_rendered

    texts = {
        "lg16_ptxas": spec_text([256], [{"linear": {"out_features": 512}}, "relu", {"mul": {"scalar": 1.5}}], name="lg16_ptxas", batch=64,
                                plan={"linear": "gemm"}),
        "lg16_ptxas_rows": spec_text([3, 24], [{"linear": {"out_features": 20}}, {"add": {"param": "b"}}, "tanh"],
                                     params={"b": {"shape": [20], "init": "randn"}}, name="lg16_ptxas_rows", batch=5, plan={"linear": "gemm"}),
    }
    for name, text in texts.items():
        spec = write_spec(tmp_path, text.replace("dtype: float32", "dtype: [bfloat16, float16]"), f"{name}.yaml")
        write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
        kernels = ptxas_report(tmp_path / "gen" / name, "9.0a")
        names = [demangle(k.name) for k in kernels]
        for t in ("bfloat16", "float16"):
            gemms = [n for n in names if n.startswith(f"void kgen::linear_gemm::gemm_kernel<kgen::{t},")]
            assert len(gemms) == 2 and any("::Fused>" in n for n in gemms) and any("::Store>" in n for n in gemms), names
        assert not any("gemm_kernel<float," in n or "fixup_kernel" in n for n in names), names
        assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", sorted(CONV16) + ["avgpool_sigmoid_sum", "instnorm_clamp_max"])
def test_conv_gemm_16_bit_compiles_without_spills(name, tmp_path):
    """conv_gemm in bfloat16 and float16: each form of conftest.CONV16 (window, generic and wgmma loops; the Store, a
    staged, an elementwise and a register epilogue) and the shipped convolution specs' 16-bit plans: the instances
    of conv_kernel over each 16-bit problem (P::Elem) with its Store and its fused epilogue compile clean, with the
    plan's shared memory asserted to cover the kernel's (kernel.cu's static_assert)."""
    from kgen.render import render_spec, write_rendered

    text = CONV16[name][0] if name in CONV16 else (ROOT / "specs" / f"{name}.yaml").read_text().replace(
        "dtype: float32", "dtype: [bfloat16, float16]")
    spec = write_spec(tmp_path, text, f"{name}.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    kernels = ptxas_report(tmp_path / "gen" / name, "9.0a")
    names = [demangle(k.name) for k in kernels]
    for t in ("bfloat16", "float16"):
        convs = [n for n in names if n.startswith("void kgen::conv_gemm::conv_kernel<") and re.search(
            rf"StoreEpilogue<(true|false), false, kgen::{t}>", n)]
        assert len(convs) == 1, names  # the stage run on its own: the Store in the dtype (staged or from registers)
    fused = [n for n in names if n.startswith("void kgen::conv_gemm::conv_kernel<") and "::Fused>" in n]
    assert len(fused) == (0 if name == "c16_store_bias" or name == "instnorm_clamp_max" else 2), names
    if fused and name in CONV16:  # the convolution keeps its bias (16-bit plans): the fused kernel adds it
        assert (tmp_path / "gen" / name / "kernel.cu").read_text().count("static constexpr bool kConvBias = true;") == 2
    assert not any("phase_pool" in n or "pool_ring" in n for n in names), names
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


@pytest.mark.parametrize("name", sorted(POOL16) + ["maxpool_sum", "div_max_gap_bias_sum"])
def test_fused_pool_kernels_16_bit_compile_without_spills(name, tmp_path):
    """conv_gemm:phase_pool and conv_gemm:pool_ring in bfloat16 and float16 (conftest.POOL16 and the shipped specs
    that take them): an instance per dtype over its 16-bit problem (P::Elem), clean (no spill, no stack, no serialized
    wgmma), with the plan's shared memory asserted to be the kernel's (kernel.cu's static_assert)."""
    from kgen.render import render_spec, write_rendered

    text = POOL16[name][0] if name in POOL16 else (ROOT / "specs" / f"{name}.yaml").read_text().replace(
        "dtype: float32", "dtype: [bfloat16, float16]")
    kernel = "phase_pool_kernel" if name in ("pp16", "maxpool_sum") else "pool_ring_kernel"
    spec = write_spec(tmp_path, text, f"{name}.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    kernels = ptxas_report(tmp_path / "gen" / name, "9.0a")
    names = [demangle(k.name) for k in kernels]
    fused = [n for n in names if f"::{kernel}<" in n]
    assert len(fused) == 2, names  # one per dtype
    src = (tmp_path / "gen" / name / "kernel.cu").read_text()
    for t in ("bfloat16", "float16"):
        assert f"using Elem = kgen::{t};  // the input's type" in src
    assert src.count("static constexpr bool kConvBias = true;") == 2  # the convolution keeps its bias: the kernel adds it
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]


def test_16_bit_batch_norm_epilogue_compiles_without_spills(tmp_path):
    """A convolution, an eval-mode batch norm (its affine in the convolution's epilogue) and a ReLU in bfloat16
    and float16: every kernel clean (float16's rounding points once spilled there with cvt.rn.f16.f32's 16-bit
    register; kgen_math.h round_to)."""
    from kgen.render import render_spec, write_rendered

    text = """
name: hb_cbr_ptxas
input:
  shape: [N, 4, 8, 8]
  dtype: [bfloat16, float16]
  example: {N: 2}
ops:
  - conv2d: {out_channels: 6, kernel_size: 3, padding: 1}
  - batch_norm: {}
  - relu
"""
    spec = write_spec(tmp_path, text, "hb_cbr_ptxas.yaml")
    write_rendered(render_spec(spec, tmp_path / "gen"), tmp_path / "gen")
    kernels = ptxas_report(tmp_path / "gen" / "hb_cbr_ptxas", "9.0a")
    fused = [k for k in kernels if "conv_kernel" in demangle(k.name) and "::Fused>" in demangle(k.name)]
    assert len(fused) == 2, [demangle(k.name) for k in kernels]  # eval mode's, one per dtype
    assert all(k.clean for k in kernels), [demangle(k.name) for k in kernels if not k.clean]
