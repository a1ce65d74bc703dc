"""kgen_runtime.h's tf32_half_even (the weights a folded convolution with eager's products is folded from:
ConvGemmStage.eager_products) against a bit-level reference of cvt.rn.tf32.f32, and tf32_round_away with
kgen_math.h's tf32_rounded_away (a channels_last ATen convolution's operands rounded as eager's NC[D]HW call
rounds them: ConvStage.eager_rounding) against one of cvt.rna.tf32.f32: ties, negative values, carries into the
exponent and past the largest float to inf, subnormals, inf and NaN kept. Built on the CPU."""
import struct

import shutil

import pytest
import torch

from conftest import ROOT

# A module of its own (the op kgen_tf32_rounding::round_even), built as kgen builds a rendered module: on the
# CPU, with the precompiled kgen_runtime.h the other CPU builds share (torch's load_inline, through
# torch/extension.h and pybind11, took four times as long).
SOURCE = """
#include "kgen_runtime.h"
#include "kgen_math.h"
at::Tensor round_even(const at::Tensor& w) { return kgen::tf32_half_even(w); }
at::Tensor round_away(const at::Tensor& w) { return kgen::tf32_round_away(w); }
at::Tensor round_away_each(const at::Tensor& w) {  // the kernels' scalar function, value by value
  at::Tensor y = w.contiguous().clone();
  float* p = y.data_ptr<float>();
  for (int64_t i = 0; i < y.numel(); ++i) p[i] = kgen::tf32_rounded_away(p[i]);
  return y;
}
TORCH_LIBRARY(kgen_tf32_rounding, m) {
  m.def("round_even(Tensor w) -> Tensor", &round_even);
  m.def("round_away(Tensor w) -> Tensor", &round_away);
  m.def("round_away_each(Tensor w) -> Tensor", &round_away_each);
}
"""


def reference(v: float, ties_away: bool = False) -> float:
    """The nearest float with 10 mantissa bits, ties to the even one (the bits, as cvt.rn does) or away from zero
    (``ties_away``: as cvt.rna does); inf and NaN kept."""
    if v != v or v in (float("inf"), float("-inf")):
        return v
    b = struct.unpack("<I", struct.pack("<f", v))[0]
    low, kept = b & 0x1FFF, b & ~0x1FFF & 0xFFFFFFFF
    if low > 0x1000 or (low == 0x1000 and (ties_away or (b >> 13) & 1)):
        kept += 0x2000
    return struct.unpack("<f", struct.pack("<I", kept & 0xFFFFFFFF))[0]


def bits(*words):
    return [struct.unpack("<f", struct.pack("<I", w))[0] for w in words]


@pytest.fixture(scope="module")
def rounding(tmp_path_factory):
    from kgen.build import build_module
    from kgen.render import SHARED_FILES

    gen = tmp_path_factory.mktemp("rt")
    for f in SHARED_FILES:  # beside the module, as `kgen render` puts them
        (gen / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "templates" / f, gen / f)
    module = gen / "kgen_tf32_rounding"
    module.mkdir()
    (module / "binding.cpp").write_text(SOURCE)
    (module / "kernel_cpu.cpp").write_text("")
    (module / "stages.h").write_text("")
    torch.ops.load_library(str(build_module(module, "cpu", quiet=True).library))
    return torch.ops.kgen_tf32_rounding


def _values():
    special = bits(
        0x3F801000, 0x3F803000, 0xBF801000, 0xBF803000,  # ties (an even and an odd kept part), and negative
        0x3F801001, 0x3F800FFF, 0x3FFFF000, 0x3FFFFFFF,  # above / below a tie; carries into the exponent
        0x7F7FF000, 0x7F7FFFFF, 0xFF7FFFFF,  # past the largest TF32 value: inf (signed)
        0x00001000, 0x00003000, 0x807FFFFF, 0x00000001,  # subnormal ties and extremes
        0x7F800000, 0xFF800000, 0x7FC00000, 0x00000000, 0x80000000)
    g = torch.Generator().manual_seed(0)
    spread = 4096 - len(special)  # normal values over many binades
    return torch.cat([torch.tensor(special, dtype=torch.float32),
                      torch.randn(spread, generator=g) * 10.0 ** torch.randint(-30, 30, (spread,), generator=g)]).view(64, -1)


def _reference_of(values, ties_away: bool = False):
    return torch.tensor([reference(v, ties_away) for v in values.flatten().tolist()], dtype=torch.float32).view(values.shape)


def _assert_same_bits(got, want, values):
    """``got`` has ``want``'s bits (any NaN for a NaN); else the first values that differ."""
    assert got.shape == want.shape and got.dtype == torch.float32
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    bad = (~same).nonzero()
    assert same.all(), [(values[tuple(i)].item(), got[tuple(i)].item(), want[tuple(i)].item()) for i in bad[:5]]


def test_tf32_round_away_rounds_as_cvt_rna(rounding):
    values = _values()
    want = _reference_of(values, ties_away=True)
    assert reference(bits(0x3F801000)[0], ties_away=True) == bits(0x3F802000)[0]  # (the reference's tie goes away)
    for got in (rounding.round_away(values), rounding.round_away_each(values), rounding.round_away(values.t()).t()):
        _assert_same_bits(got, want, values)


def test_tf32_half_even_rounds_as_cvt_rn(rounding):
    values = _values()  # ties to even go down from an even kept part, up from an odd one
    _assert_same_bits(rounding.round_even(values), _reference_of(values), values)
