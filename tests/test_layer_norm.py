"""The layer_norm family (templates/layer_norm) through the CPU build and validation.

Each spec of conftest.LAYER_NORMS (rows of 64, 48, 8, 12, 7, 512 and 1024 values; a 2-dim
row; affine on and off, no bias; prologue and post ops, a value in a register; a plain input,
sub-pixel phase tiles and a channels_last convolution output read in place) is rendered, built
for the CPU and validated against the float64 reference, with the adversarial cases (NaN and
+-inf in a row, data far from zero, constants) fed straight into the stage. The same specs run on
CUDA in tests/test_cuda.py and through ptxas in tests/test_ptxas.py.
"""
import pytest
import torch

from conftest import LAYER_NORMS, assert_report_passed, build_cases, pinned_selection, render_layer_norm


@pytest.fixture(scope="module")
def layer_norm_modules(tmp_path_factory):
    return build_cases(render_layer_norm, LAYER_NORMS, tmp_path_factory.mktemp("layer_norm"), "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYER_NORMS))
def test_layer_norm_validates_on_the_cpu_build(name, layer_norm_modules):
    from kgen.validate import validate

    spec, module_dir = layer_norm_modules[name]
    assert_report_passed(validate(spec, module_dir, "cpu", selection=pinned_selection(name, spec)), f"{name}: {LAYER_NORMS[name]}")


@pytest.mark.slow
def test_a_non_finite_value_makes_its_row_nan(layer_norm_modules):
    """PyTorch's layer_norm (float64 on the CPU too): a NaN or an infinity in a row makes every
    output of that row NaN, and only of that row; the stage op computes the same."""
    from kgen.validate import import_module_dir

    _, module_dir = layer_norm_modules["ln_r48"]
    import_module_dir(module_dir)
    stage = torch.ops.kgen.ln_r48_stage0
    x = torch.randn(2, 4, 7, 48)
    x[0, 1, 2, 5], x[1, 3, 6, 0], x[1, 0, 0, 47] = float("nan"), float("inf"), -float("inf")
    y = stage([x], [], [])
    expected = torch.relu(torch.nn.functional.layer_norm(x.double(), (48,)))
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    rows = torch.isnan(y).all(dim=-1)
    assert int(rows.sum()) == 3 and bool(rows[0, 1, 2] and rows[1, 3, 6] and rows[1, 0, 0])
    assert not torch.isnan(y).any(dim=-1).logical_and(~rows).any()  # a row is NaN everywhere or nowhere
    torch.testing.assert_close(y.double()[~torch.isnan(y)], expected[~torch.isnan(expected)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, tiles, parts", [("ln_cl_parts", 2, 2), ("ln_cl_uneven_parts", 1, 2), ("ln_cl_tiles", 16, 1)])
def test_the_tiles_form_sums_a_row_over_several_threads_where_the_block_has_them(name, tiles, parts, tmp_path):
    """The tiles form's block holds as many tiles as its shared memory and threads take; where their rows
    leave threads over, two or more sum each row (rows of at least 32 values: 16 or more each)."""
    import json

    _, module_dir = render_layer_norm(name, tmp_path)
    (st,) = [s for p in json.loads((module_dir / "plan.json").read_text())["plans"] for s in p["stages"] if s["family"] == "layer_norm"]
    sc = st["schedule"]
    assert (sc["form"], sc["tiles_per_block"], sc["row_parts"]) == ("tiles", tiles, parts)
