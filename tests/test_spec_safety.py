"""Specs that try to break kgen: reserved names, sizes beyond the kernels' index
range, scalars that are not float32, hostile YAML and files that are not specs.
Each is refused at spec time with one line naming the file and the key."""
import os
import threading

import pytest
import torch

from kgen.errors import KgenError, SpecError
from kgen.ir import build_pipeline, load_pipeline
from kgen.names import reserved_reason
from kgen.spec import MAX_FILE_BYTES, load_spec, parse_spec, spec_from_data, spec_to_data
from test_spec_errors import HEAD4, HEAD5, _assert_one_line_error

PARSE, BUILD = "parse_spec", "build_pipeline"
CONV = "ops:\n  - conv2d: {{out_channels: 4, kernel_size: 3, name: {}}}\n"
PARAM = "params:\n  {0}: {{shape: [4, 1, 1]}}\nops:\n  - mul: {{param: {0}}}\n"
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)

# (id, spec text, stage that must reject it, key path, substrings of the message)
CASES = [
    # ---- names: the module's, parameters', submodules'
    ("name_python_keyword", "name: class\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["'class'", "Python keyword"]),
    ("name_lambda", "name: lambda\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["Python keyword"]),
    ("name_cpp_keyword", "name: int\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["C++ keyword"]),
    ("name_op_namespace_attribute", "name: name\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["kgen's own ops"]),
    ("name_stage_op", "name: foo_stage1\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["kgen's own ops"]),
    ("name_too_long", f"name: {'a' * 65}\ninput: {{shape: [N, 4, 8, 8]}}\nops: [relu]\n", PARSE, "name", ["65 characters", "64"]),
    ("name_10000_chars", f"name: {'a' * 10000}\ninput: {{shape: [N, 4, 8, 8]}}\nops: [relu]\n", PARSE, "name", ["10000 characters"]),
    ("param_lambda", HEAD4 + PARAM.format("lambda"), PARSE, "params.lambda", ["Python keyword"]),
    ("param_int", HEAD4 + PARAM.format("int"), PARSE, "params.int", ["C++ keyword"]),
    ("param_errno_macro", HEAD4 + PARAM.format("errno"), PARSE, "params.errno", ["C/C++/CUDA"]),
    ("param_torch", HEAD4 + PARAM.format("torch"), PARSE, "params.torch", ["'torch'"]),
    ("param_forward", HEAD4 + PARAM.format("forward"), PARSE, "params.forward", ["torch.nn.Module"]),
    ("param_training", HEAD4 + PARAM.format("training"), PARSE, "params.training", ["torch.nn.Module"]),
    ("param_state_dict", HEAD4 + PARAM.format("state_dict"), PARSE, "params.state_dict", ["torch.nn.Module"]),
    ("param_x", HEAD4 + PARAM.format("x"), PARSE, "params.x", ["generated code"]),
    ("param_binding_local", HEAD4 + PARAM.format("batch"), PARSE, "params.batch", ["generated code"]),
    ("param_stage_local", HEAD4 + PARAM.format("t1"), PARSE, "params.t1", ["generated code"]),
    ("param_cuda_vector_type", HEAD4 + PARAM.format("float4"), PARSE, "params.float4", ["generated code"]),
    ("param_too_long", HEAD4 + PARAM.format("p" * 65), PARSE, f"params.{'p' * 65}", ["65 characters"]),
    ("conv_named_forward", HEAD4 + CONV.format("forward"), PARSE, "ops[0].conv2d.name", ["torch.nn.Module"]),
    ("conv_named_cuda", HEAD4 + CONV.format("cuda"), PARSE, "ops[0].conv2d.name", ["'cuda'"]),
    ("conv_named_class", HEAD4 + CONV.format("class"), PARSE, "ops[0].conv2d.name", ["Python keyword"]),
    ("norm_named_eval", HEAD4 + "ops:\n  - group_norm: {num_groups: 2, name: eval}\n", PARSE, "ops[0].group_norm.name",
     ["torch.nn.Module"]),
    ("symbol_too_long", f"name: t\ninput: {{shape: [{'N' * 65}, 4, 8, 8]}}\nops: [relu]\n", PARSE, "input.shape[0]", ["symbol"]),
    # ---- sizes: 32-bit dims and index ranges, the element cap
    ("out_channels_1e9", HEAD4 + "ops:\n  - conv2d: {out_channels: 1000000000, kernel_size: 3}\n", BUILD, "ops[0].conv2d",
     ["elements per sample", "KGEN_MAX_ELEMENTS"]),
    ("spatial_1e12", "name: t\ninput: {shape: [N, 4, 1000000000000, 8]}\nops: [relu]\n", PARSE, "input.shape[2]",
     ["2**31 - 1"]),
    ("input_over_cap", "name: t\ninput: {shape: [N, 65536, 65536, 8]}\nops: [relu]\n", BUILD, "input.shape",
     ["elements per sample"]),
    ("padding_1e20", HEAD4 + "ops:\n  - conv2d: {out_channels: 4, kernel_size: 3, padding: 100000000000000000000}\n", PARSE,
     "ops[0].conv2d.padding", ["2**31 - 1"]),
    ("padding_float_1e20", HEAD4 + "ops:\n  - conv2d: {out_channels: 4, kernel_size: 3, padding: 1e20}\n", PARSE,
     "ops[0].conv2d.padding", ["1e+20"]),
    ("padding_past_int32", HEAD4 + "ops:\n  - conv2d: {out_channels: 4, kernel_size: 3, padding: 2000000000}\n", BUILD,
     "ops[0].conv2d", ["32-bit index range"]),
    ("pool_window_past_int32", "name: t\ninput: {shape: [N, 1, 2147483000, 1]}\nops:\n  - max_pool2d: {kernel_size: [1000, 1]}\n",
     BUILD, "ops[0].max_pool2d", ["32-bit index range"]),
    ("weight_over_cap", "name: t\ninput: {shape: [N, 65536, 1, 1]}\nops:\n  - conv2d: {out_channels: 300000, kernel_size: 1}\n",
     BUILD, "ops[0].conv2d", ["the weight", "KGEN_MAX_ELEMENTS"]),
    ("param_over_cap", HEAD4 + "params:\n  p: {shape: [4, 100000, 100000]}\nops:\n  - mul: {param: p}\n", BUILD,
     "params.p.shape", ["elements"]),
    # ---- scalars: finite in float32
    ("scalar_1e300", HEAD4 + "ops:\n  - mul: {scalar: 1e300}\n", PARSE, "ops[0].mul.scalar", ["not finite in float32"]),
    ("scalar_10_400", HEAD4 + "ops:\n  - mul: {scalar: 1" + "0" * 400 + "}\n", PARSE, "ops[0].mul.scalar",
     ["not finite in float32", "..."]),
    ("scalar_underflows", HEAD4 + "ops:\n  - div: {scalar: 1.0e-50}\n", PARSE, "ops[0].div.scalar", ["rounds to 0"]),
    ("clamp_inf", HEAD4 + "ops:\n  - clamp: {max: .inf}\n", PARSE, "ops[0].clamp.max", ["finite number"]),
    ("eps_beyond_float32", HEAD4 + "ops:\n  - group_norm: {num_groups: 2, eps: 1.0e+39}\n", PARSE, "ops[0].group_norm.eps",
     ["float32"]),
    # ---- YAML
    ("duplicate_top_key", "name: a\nname: b\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name",
     ["duplicate key", "line 2"]),
    ("duplicate_nested_key", HEAD4 + "ops:\n  - conv2d: {out_channels: 4, kernel_size: 3, kernel_size: 5}\n", PARSE,
     "ops[0].conv2d.kernel_size", ["duplicate key"]),
    ("duplicate_input_key", "name: t\ninput:\n  shape: [N, 4, 8, 8]\n  shape: [N, 4, 9, 9]\nops: [relu]\n", PARSE,
     "input.shape", ["duplicate key"]),
    ("deep_nesting", "name: t\ninput: {shape: [N, 4, 8, 8]}\nops: " + "[" * 20000 + "]" * 20000 + "\n", PARSE, "",
     ["nested deeper than"]),
    ("recursive_alias", "name: t\ninput: {shape: [N, 4, 8, 8]}\nops: &o [relu, *o]\n", PARSE, "ops[1]", ["alias"]),
    ("long_value_echo", "name: t\ninput: {shape: [N, 4, 8, 8], dtype: " + "f" * 5000 + "}\nops: [relu]\n", PARSE,
     "input.dtype", ["unsupported dtype 'fff", "..."]),
    ("huge_dim_index", HEAD4 + "ops:\n  - sum: {dim: 1" + "0" * 3000 + "}\n", PARSE, "ops[0].sum.dim", ["dimension index", "..."]),
    ("param_with_many_dims", HEAD4 + "params:\n  p: {shape: [" + ", ".join(["1"] * 3000) + "]}\nops:\n  - mul: {param: p}\n", PARSE,
     "params.p.shape", ["at most 5", "..."]),
    ("nul_character", "name: t\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\x00\n", PARSE, "", ["not valid YAML"]),
]


def test_cases_have_distinct_ids():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("text, stage, key, contains", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_spec(tmp_path, text, stage, key, contains):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_pipeline(path)
    _assert_one_line_error(e.value, path, key, contains)
    assert len(str(e.value)) < 400  # no value is echoed beyond a short prefix
    if stage == BUILD:  # syntax is fine: parse_spec lets it through
        parse_spec(text, "x.yaml")


def test_billion_laughs_fails_small(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(LAUGHS + "name: *i\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert "expands to more than" in str(e.value) and len(str(e.value)) < 200


def test_a_few_aliases_are_fine():
    spec = parse_spec(
        "name: t\ninput: {shape: [N, 4, 8, 8]}\nops:\n  - max_pool2d: &p {kernel_size: 2}\n  - max_pool2d: *p\n", "ok.yaml"
    )
    assert [o.args["kernel_size"] for o in spec.ops] == [(2, 2), (2, 2)]


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    result = []
    reader = threading.Thread(target=lambda: result.append(_error_of(lambda: load_spec(fifo))), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert result and "not a regular file" in result[0]


def _error_of(fn) -> str:
    try:
        fn()
    except SpecError as e:
        return str(e)
    return "no error"


def test_a_directory_is_refused(tmp_path):
    assert _error_of(lambda: load_spec(tmp_path)) == f"{tmp_path}: not a regular file"


def test_a_huge_file_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: t\n" + "#" * MAX_FILE_BYTES + "\n")
    assert "a spec may have at most 1048576" in _error_of(lambda: load_spec(path))


def test_a_long_path_is_cut_in_the_message(tmp_path):
    path = tmp_path / ("d" * 200) / ("s" * 200 + ".yaml")
    msg = _error_of(lambda: load_spec(path))
    assert "cannot read spec" in msg and len(msg) < 300


def test_the_element_cap_follows_the_environment(monkeypatch):
    text = HEAD4 + "ops:\n  - conv2d: {out_channels: 40, kernel_size: 3}\n"  # 40 x 6 x 6 = 1440 per sample
    build_pipeline(parse_spec(text, "x.yaml"))
    monkeypatch.setenv("KGEN_MAX_ELEMENTS", "1000")
    with pytest.raises(SpecError, match="1440 elements per sample; at most 1000"):
        build_pipeline(parse_spec(text, "x.yaml"))
    monkeypatch.setenv("KGEN_MAX_ELEMENTS", "lots")
    with pytest.raises(KgenError, match="KGEN_MAX_ELEMENTS must be a positive integer, got 'lots'"):
        build_pipeline(parse_spec(text, "x.yaml"))


def test_every_module_attribute_is_reserved():
    public = [n for n in dir(torch.nn.Module()) if not n.startswith("_") and n.islower()]
    assert public and all(reserved_reason(n) for n in public)
    for fine in ("scale", "bias", "weight_2", "input", "sum", "conv", "my_norm", "sel"):
        assert reserved_reason(fine) is None, fine


def test_numbers_written_with_an_exponent_are_numbers():
    spec = parse_spec(HEAD4 + "ops:\n  - mul: {scalar: 1e-3}\n  - add: {scalar: -2E2}\n", "x.yaml")
    assert [o.args["scalar"] for o in spec.ops] == [1e-3, -200.0]


def test_spec_data_round_trip(tmp_path):
    from conftest import SPECS

    for p in SPECS:
        spec = load_spec(p)
        data = spec_to_data(spec)
        assert "description" not in data
        again = spec_from_data(data, str(p))
        assert again == spec.__class__(**{**spec.__dict__, "description": ""})


def _many_inputs(n: int) -> str:
    """A spec of ``n`` inputs [N, 2, 3] concatenated along dim 1 (DenseNet's dense layer), then scaled and relu."""
    names = ["x"] + [f"in{i}" for i in range(1, n)]
    lines = ["name: many_inputs", "inputs:"] + [f"  {k}: {{shape: [N, 2, 3]}}" for k in names]
    lines += ["example: {N: 2}", "params:", f"  w: {{shape: [{2 * n}, 1]}}", "ops:",
              f"  - cat: {{dim: 1, tensors: [{', '.join(names[1:])}]}}", "  - mul: {param: w}", "  - relu"]
    return "\n".join(lines) + "\n"


def test_the_input_limit_keeps_the_op_within_the_dispatchers_arguments(tmp_path):
    """Each input is one argument of the op kgen::NAME (the rest are at most 4): MAX_INPUTS inputs are taken and
    keep the op under PyTorch's 64 arguments; one more is refused naming the limit."""
    from kgen.render import op_arguments
    from kgen.spec import DISPATCHER_MAX_ARGS, MAX_INPUTS

    path = tmp_path / "many.yaml"
    path.write_text(_many_inputs(MAX_INPUTS))
    pipe = load_pipeline(path)
    assert len(pipe.input_names) == MAX_INPUTS and len(op_arguments(pipe)) < DISPATCHER_MAX_ARGS
    # the longest op: every input, both lists, the mode and the update weights (a batch norm) fill the limit
    path.write_text(_many_inputs(MAX_INPUTS) + "  - batch_norm: {}\n")
    assert len(op_arguments(load_pipeline(path))) == DISPATCHER_MAX_ARGS
    path.write_text(_many_inputs(MAX_INPUTS + 1))
    with pytest.raises(SpecError) as e:
        load_pipeline(path)
    _assert_one_line_error(e.value, path, "inputs", [f"expected 1 to {MAX_INPUTS} inputs, got {MAX_INPUTS + 1}"])


def test_the_longest_op_renders_builds_and_validates_on_the_cpu(tmp_path):
    """A cat of MAX_INPUTS inputs (DenseNet's dense layers) and a batch norm: the op's 64 arguments, PyTorch's
    limit, rendered, built for the CPU, registered with the dispatcher as the library loads, equal to float64."""
    from conftest import build_and_validate, render_specs
    from kgen.spec import MAX_INPUTS

    rendered = render_specs(tmp_path, {"many_inputs": _many_inputs(MAX_INPUTS) + "  - batch_norm: {}\n"})
    binding = (rendered["many_inputs"][1] / "binding.cpp").read_text()
    assert f"Tensor in{MAX_INPUTS - 1}, Tensor[] params, Tensor[] buffers, bool training, float[] factors" in binding
    build_and_validate(rendered, "cpu")
