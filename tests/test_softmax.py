"""The softmax family (templates/softmax): softmax, log_softmax and logsumexp over one axis, through
the CPU build and validation, and the non-finite values of a slice as PyTorch has them.

Each spec of conftest.SOFTMAXES (channels of 24, 128, 300, 48 and 16, a middle axis, two dims as one
axis, rows of 10, 1000, 8192, 4100 and 40000 values; prologue and post ops, a value in a register, a
[N] output; a plain input, sub-pixel phase tiles and a channels_last convolution output read in
place) is rendered, built for the CPU and validated against the float64 reference, with the
adversarial cases (NaN and +-inf in a slice, data far from zero, ties, constants) fed straight into
the stage. The same specs run on CUDA in tests/test_cuda.py and through ptxas in tests/test_ptxas.py.
"""
import math

import pytest
import torch

from conftest import (NON_FINITE_SLICES, SOFTMAXES, assert_report_passed, build_cases, check_non_finite_softmax, pinned_selection,
                      render_non_finite_softmax, render_softmax)

INF, NAN = math.inf, math.nan


@pytest.fixture(scope="module")
def softmax_modules(tmp_path_factory):
    return build_cases(render_softmax, SOFTMAXES, tmp_path_factory.mktemp("softmax"), "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SOFTMAXES))
def test_softmax_validates_on_the_cpu_build(name, softmax_modules):
    from kgen.validate import validate

    spec, module_dir = softmax_modules[name]
    report = validate(spec, module_dir, "cpu", selection=pinned_selection(name, spec))
    assert_report_passed(report, f"{name}: {SOFTMAXES[name]}")


NON_FINITE_FNS = ("softmax", "log_softmax", "logsumexp")
NON_FINITE_SHAPES = ("c24", "c300", "r1000")


@pytest.fixture(scope="module")
def non_finite_modules(tmp_path_factory):
    """Each (fn, shape) of test_non_finite_values_of_a_slice_are_pytorchs rendered as nf_FN_SHAPE, all built
    together (the builds share the machine's cores) and loaded."""
    from kgen.build import build_modules
    from kgen.validate import import_module_dir

    root = tmp_path_factory.mktemp("non_finite")
    dirs = [render_non_finite_softmax(fn, shape, root, f"nf_{fn}_{shape}")[1] for fn in NON_FINITE_FNS for shape in NON_FINITE_SHAPES]
    build_modules(dirs, "cpu")
    for d in dirs:
        import_module_dir(d)


@pytest.mark.slow
@pytest.mark.parametrize("fn", NON_FINITE_FNS)
@pytest.mark.parametrize("shape_name", NON_FINITE_SHAPES)
def test_non_finite_values_of_a_slice_are_pytorchs(fn, shape_name, non_finite_modules):
    """PyTorch in float64 on the CPU: a NaN in a slice makes its logsumexp and all its softmax outputs
    NaN; a +inf makes logsumexp +inf and the softmax NaN; a slice of -inf only gives -inf and NaN; -inf
    beside finite values gives 0 (softmax) and -inf (log_softmax). The stage op puts NaN and +-inf
    exactly there (conftest.check_non_finite_softmax), slice by slice."""
    y = check_non_finite_softmax(fn, shape_name, getattr(torch.ops.kgen, f"nf_{fn}_{shape_name}_stage0"), "cpu")
    first = y.movedim(1, -1).reshape(-1, y.shape[1])[:NON_FINITE_SLICES]  # slice k is row k
    if fn == "logsumexp":
        assert math.isnan(first[0, 0]) and first[1, 0] == INF and first[2, 0] == INF and first[3, 0] == -INF
        assert math.isnan(first[5, 0]) and torch.isfinite(first[4:5]).all() and torch.isfinite(first[6:]).all()
    else:
        assert torch.isnan(first[:4]).all() and torch.isnan(first[5]).all() and not torch.isnan(first[4]).any()
        assert not torch.isnan(first[6:]).any()


def test_a_softmax_over_channels_reads_a_channels_last_input_at_full_speed():
    """In channels_last a softmax over the channels finds each slice adjacent (priced as one read, so a convolution
    before it may write channels_last); over another dim, or over more channels than CHANNELS_LAST_SLICE_CHANNELS,
    the read is strided (priced STRIDED_READ_FACTOR times)."""
    from kgen.buffer import dense_buffer
    from kgen.families.softmax import CHANNELS_LAST_SLICE_CHANNELS, FAMILY
    from kgen.ir import Softmax

    def cl(channels):
        return dense_buffer((channels, 8, 8), (channels, 8, 8), "channels_last")

    assert FAMILY.reads_channels_last_fast(cl(64), [Softmax("softmax", dim=1)])
    assert not FAMILY.reads_channels_last_fast(cl(64), [Softmax("softmax", dim=2)])
    assert not FAMILY.reads_channels_last_fast(cl(2 * CHANNELS_LAST_SLICE_CHANNELS), [Softmax("softmax", dim=1)])
    assert not FAMILY.reads_channels_last_fast(cl(64))  # no op known: as the family says


@pytest.mark.parametrize("name, positions, lanes", [("sm_cl_tiles", 64, 8), ("lsm_cl_tiles", 256, 6), ("sm_cl3d_tiles", 256, 5)])
def test_a_softmax_over_channels_last_channels_takes_tiles(name, positions, lanes, tmp_path):
    """A softmax or log_softmax over the channels of a channels_last input reads them as they lie: a block's
    positions (as many as 40 KB of shared memory holds, at most 256) through shared memory, loads of whole
    vectors, each position's vectors loaded by neighbouring lanes together (at most 8, a divisor of its vectors)."""
    import json

    _, module_dir = render_softmax(name, tmp_path)
    (st,) = [s for p in json.loads((module_dir / "plan.json").read_text())["plans"] for s in p["stages"] if s["family"] == "softmax"]
    sc = st["schedule"]
    assert (sc["tile_positions"], sc["lanes_per_position"], sc["slice_threads"] * sc["tile_positions"]) == (positions, lanes, 256)
