"""Malformed specs: every problem is a SpecError naming the file and the key path, on one line.

Each case is a small spec written to a file under pytest's tmp_path. The message
must read ``<file>: <key>: <what is wrong>`` (``<file>: <what is wrong>`` when the
problem has no key, e.g. broken YAML), with no newline, so the CLI can print it as
one ``kgen: error:`` line.

Syntax problems (keys, types, ranges) come from ``kgen.spec.parse_spec``; meaning
(shapes, broadcasting, reduction dims, module names) from ``kgen.ir.build_pipeline``.
Every case says which of the two must reject it.
"""
from pathlib import Path

import pytest

from conftest import ROOT, SPECS, kgen_cli
from kgen.errors import KgenError, SpecError
from kgen.ir import build_pipeline, load_pipeline
from kgen.plan import EVAL_REWRITE, TRAIN_REWRITE
from kgen.rewrites import REWRITES
from kgen.spec import REWRITE_NAMES, load_spec, parse_spec

# A 5-d input most cases start from; {ops} is filled in per case.
HEAD5 = "name: t\ninput: {shape: [N, 4, 8, 8, 8], dtype: float32, example: {N: 2}}\n"
HEAD4 = "name: t\ninput: {shape: [N, 4, 8, 8], dtype: float32, example: {N: 2}}\n"

PARSE, BUILD = "parse_spec", "build_pipeline"

# (id, spec text, stage that must reject it, exact key path, substrings the message must contain)
CASES = [
    # ---- the file as a whole
    ("not_yaml", "name: t\ninput: {shape: [N, 4, 8\nops: [relu]\n", PARSE, "", ["not valid YAML", "line"]),
    ("not_yaml_bad_indent", "name: t\n  input: x\n bad: 1\n", PARSE, "", ["not valid YAML"]),
    ("top_level_list", "- name: t\n- ops: [relu]\n", PARSE, "", ["mapping at the top level"]),
    ("top_level_scalar", "just a string\n", PARSE, "", ["mapping at the top level"]),
    ("empty_file", "", PARSE, "", ["mapping at the top level"]),
    ("unknown_top_key", HEAD5 + "ops: [relu]\nresults: 3\n", PARSE, "results", ["unknown key", "ops", "outputs"]),
    ("outputs_not_a_list", HEAD5 + "ops: [relu]\noutputs: 3\n", PARSE, "outputs", ["non-empty list of at most 16 value names"]),
    ("missing_name", "input: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["missing required field"]),
    ("missing_input", "name: t\nops: [relu]\n", PARSE, "input", ["missing required field"]),
    ("missing_ops", HEAD5, PARSE, "ops", ["missing required field"]),
    ("name_with_dash", "name: Bad-Name\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["'Bad-Name'"]),
    ("name_starts_with_digit", "name: 1x\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["'1x'"]),
    ("name_not_a_string", "name: 5\ninput: {shape: [N, 4, 8, 8]}\nops: [relu]\n", PARSE, "name", ["identifier"]),
    ("description_not_string", HEAD4 + "description: [a, b]\nops: [relu]\n", PARSE, "description", ["string"]),
    # ---- input
    ("input_not_mapping", "name: t\ninput: [N, 4, 8, 8]\nops: [relu]\n", PARSE, "input", ["mapping"]),
    ("input_unknown_key", "name: t\ninput: {shape: [N, 4, 8, 8], layout: nchw}\nops: [relu]\n", PARSE, "input.layout", ["unknown key"]),
    ("input_missing_shape", "name: t\ninput: {dtype: float32}\nops: [relu]\n", PARSE, "input.shape", ["missing required field"]),
    ("input_shape_too_short", "name: t\ninput: {shape: [N]}\nops: [relu]\n", PARSE, "input.shape", ["2 to 5"]),
    ("input_shape_too_long", "name: t\ninput: {shape: [N, 4, 2, 2, 2, 2]}\nops: [relu]\n", PARSE, "input.shape", ["2 to 5"]),
    ("symbol_in_channels", "name: t\ninput: {shape: [N, C, 8, 8]}\nops: [relu]\n", PARSE, "input.shape[1]", ["batch dimension"]),
    ("symbol_in_spatial", "name: t\ninput: {shape: [N, 4, 8, H]}\nops: [relu]\n", PARSE, "input.shape[3]", ["batch dimension"]),
    ("zero_size", "name: t\ninput: {shape: [N, 4, 0, 8]}\nops: [relu]\n", PARSE, "input.shape[2]", ["positive integer", "0"]),
    ("float_size", "name: t\ninput: {shape: [N, 4, 8.0, 8]}\nops: [relu]\n", PARSE, "input.shape[2]", ["positive integer"]),
    ("bool_size", "name: t\ninput: {shape: [N, true, 8, 8]}\nops: [relu]\n", PARSE, "input.shape[1]", ["positive integer", "True"]),
    ("bad_batch_symbol", "name: t\ninput: {shape: [2N, 4, 8, 8]}\nops: [relu]\n", PARSE, "input.shape[0]", ["symbol"]),
    ("bad_dtype", "name: t\ninput: {shape: [N, 4, 8, 8], dtype: float64}\nops: [relu]\n", PARSE, "input.dtype", ["float64", "float32, bfloat16, float16"]),
    ("example_unknown_symbol", "name: t\ninput: {shape: [N, 4, 8, 8], example: {M: 2}}\nops: [relu]\n", PARSE, "input.example.M", ["unknown key"]),
    ("example_zero", "name: t\ninput: {shape: [N, 4, 8, 8], example: {N: 0}}\nops: [relu]\n", PARSE, "input.example.N", ["positive integer"]),
    # ---- ops: structure
    ("ops_empty", HEAD4 + "ops: []\n", PARSE, "ops", ["non-empty list"]),
    ("ops_not_list", HEAD4 + "ops: {relu: null}\n", PARSE, "ops", ["non-empty list"]),
    ("unknown_op", HEAD4 + "ops:\n  - conv4d: {out_channels: 2, kernel_size: 3}\n", PARSE, "ops[0]",
     ["'conv4d'", "known ops:", "conv3d", "max_pool2d", "group_norm", "adaptive_avg_pool3d"]),
    ("unknown_op_bare", HEAD4 + "ops: [relu, softmin]\n", PARSE, "ops[1]", ["'softmin'", "known ops:", "sigmoid"]),
    ("op_with_two_keys", HEAD4 + "ops:\n  - {relu: null, sigmoid: null}\n", PARSE, "ops[0]", ["exactly one key"]),
    ("op_not_mapping", HEAD4 + "ops:\n  - [relu]\n", PARSE, "ops[0]", ["exactly one key"]),
    ("op_fields_not_mapping", HEAD4 + "ops:\n  - relu: 3\n", PARSE, "ops[0].relu", ["mapping"]),
    # ---- ops: fields
    ("conv_missing_out_channels", HEAD5 + "ops:\n  - conv3d: {kernel_size: 3}\n", PARSE, "ops[0].conv3d.out_channels",
     ["missing required field"]),
    ("bare_conv_missing_field", HEAD5 + "ops: [relu, conv3d]\n", PARSE, "ops[1].conv3d.out_channels", ["missing required field"]),
    ("pool_missing_kernel", HEAD5 + "ops:\n  - max_pool3d: {stride: 2}\n", PARSE, "ops[0].max_pool3d.kernel_size",
     ["missing required field"]),
    ("reduce_missing_dim", HEAD5 + "ops:\n  - sum: {keepdim: true}\n", PARSE, "ops[0].sum.dim", ["missing required field"]),
    ("group_norm_missing_groups", HEAD5 + "ops: [group_norm]\n", PARSE, "ops[0].group_norm.num_groups", ["missing required field"]),
    ("conv_extra_field", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3, bias_init: 0}\n", PARSE,
     "ops[0].conv3d.bias_init", ["unknown key", "kernel_size", "out_channels"]),
    ("conv_in_channels_not_a_field", HEAD5 + "ops:\n  - conv3d: {in_channels: 4, out_channels: 4, kernel_size: 3}\n", PARSE,
     "ops[0].conv3d.in_channels", ["unknown key"]),
    ("avg_pool_has_no_dilation", HEAD5 + "ops:\n  - avg_pool3d: {kernel_size: 2, dilation: 2}\n", PARSE,
     "ops[0].avg_pool3d.dilation", ["unknown key"]),
    ("relu_takes_no_fields", HEAD5 + "ops:\n  - relu: {inplace: true}\n", PARSE, "ops[0].relu.inplace", ["unknown key"]),
    ("string_for_int", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: '3'}\n", PARSE, "ops[0].conv3d.kernel_size",
     ["positive integer", "'3'"]),
    ("bool_for_int", HEAD5 + "ops:\n  - conv3d: {out_channels: true, kernel_size: 3}\n", PARSE, "ops[0].conv3d.out_channels",
     ["positive integer", "True"]),
    ("bool_for_int_in_list", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3, stride: [1, true, 1]}\n", PARSE,
     "ops[0].conv3d.stride", ["positive integer"]),
    ("bool_for_int_groups", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3, groups: true}\n", PARSE,
     "ops[0].conv3d.groups", ["positive integer"]),
    ("bool_for_dim", HEAD5 + "ops:\n  - sum: {dim: true}\n", PARSE, "ops[0].sum.dim", ["dimension index"]),
    ("float_for_int", HEAD5 + "ops:\n  - max_pool3d: {kernel_size: 2.0}\n", PARSE, "ops[0].max_pool3d.kernel_size",
     ["positive integer", "2.0"]),
    ("float_for_num_groups", HEAD5 + "ops:\n  - group_norm: {num_groups: 2.0}\n", PARSE, "ops[0].group_norm.num_groups",
     ["positive integer"]),
    ("int_for_bool", HEAD5 + "ops:\n  - sum: {dim: 1, keepdim: 1}\n", PARSE, "ops[0].sum.keepdim", ["true or false"]),
    ("string_for_bool", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3, bias: 'no'}\n", PARSE,
     "ops[0].conv3d.bias", ["true or false"]),
    ("string_for_number", HEAD5 + "ops:\n  - mul: {scalar: two}\n", PARSE, "ops[0].mul.scalar", ["finite number"]),
    ("bool_for_number", HEAD5 + "ops:\n  - mul: {scalar: true}\n", PARSE, "ops[0].mul.scalar", ["finite number"]),
    ("inf_scalar", HEAD5 + "ops:\n  - add: {scalar: .inf}\n", PARSE, "ops[0].add.scalar", ["finite number"]),
    ("nan_eps", HEAD5 + "ops:\n  - instance_norm: {eps: .nan}\n", PARSE, "ops[0].instance_norm.eps", ["finite number"]),
    ("kernel_size_zero", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 0}\n", PARSE, "ops[0].conv3d.kernel_size",
     ["positive integer", "0"]),
    ("out_channels_negative", HEAD5 + "ops:\n  - conv3d: {out_channels: -1, kernel_size: 3}\n", PARSE,
     "ops[0].conv3d.out_channels", ["positive integer", "-1"]),
    ("stride_zero", HEAD5 + "ops:\n  - max_pool3d: {kernel_size: 2, stride: 0}\n", PARSE, "ops[0].max_pool3d.stride",
     ["positive integer"]),
    ("padding_negative", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3, padding: -1}\n", PARSE,
     "ops[0].conv3d.padding", ["non-negative integer"]),
    ("kernel_list_wrong_length", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: [3, 3]}\n", PARSE,
     "ops[0].conv3d.kernel_size", ["list of 3"]),
    ("kernel_list_with_zero", HEAD4 + "ops:\n  - max_pool2d: {kernel_size: [2, 0]}\n", PARSE, "ops[0].max_pool2d.kernel_size",
     ["list of 2"]),
    ("output_padding_negative", HEAD4 + "ops:\n  - conv_transpose2d: {out_channels: 4, kernel_size: 3, output_padding: -1}\n",
     PARSE, "ops[0].conv_transpose2d.output_padding", ["non-negative"]),
    ("adaptive_output_size_zero", HEAD5 + "ops:\n  - adaptive_avg_pool3d: {output_size: [2, 0, 1]}\n", PARSE,
     "ops[0].adaptive_avg_pool3d.output_size", ["positive integer"]),
    ("dim_empty_list", HEAD5 + "ops:\n  - sum: {dim: []}\n", PARSE, "ops[0].sum.dim", ["non-empty list"]),
    ("dim_repeated", HEAD5 + "ops:\n  - mean: {dim: [2, 2]}\n", PARSE, "ops[0].mean.dim", ["repeated"]),
    ("track_running_stats", HEAD5 + "ops:\n  - instance_norm: {track_running_stats: true}\n", PARSE,
     "ops[0].instance_norm.track_running_stats", ["not supported"]),
    ("module_name_not_ident", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3, name: Conv1}\n", PARSE,
     "ops[0].conv3d.name", ["'Conv1'"]),
    # ---- ops: cross-field rules
    ("scalar_and_param", HEAD5 + "params:\n  b: {shape: [4, 1, 1, 1]}\nops:\n  - add: {scalar: 1.0, param: b}\n", PARSE,
     "ops[0].add", ["exactly one of 'scalar', 'param' or 'tensor'"]),
    ("neither_scalar_nor_param", HEAD5 + "ops:\n  - sub: {}\n", PARSE, "ops[0].sub", ["exactly one of 'scalar', 'param' or 'tensor'"]),
    ("bare_binary_op", HEAD5 + "ops: [mul]\n", PARSE, "ops[0].mul", ["exactly one of 'scalar', 'param' or 'tensor'"]),
    ("div_by_zero", HEAD5 + "ops:\n  - div: {scalar: 0}\n", PARSE, "ops[0].div.scalar", ["division by zero"]),
    ("div_by_float_zero", HEAD5 + "ops:\n  - div: {scalar: -0.0}\n", PARSE, "ops[0].div.scalar", ["division by zero"]),
    ("clamp_min_above_max", HEAD5 + "ops:\n  - clamp: {min: 1.0, max: -1.0}\n", PARSE, "ops[0].clamp", ["larger than max"]),
    ("clamp_without_bounds", HEAD5 + "ops: [clamp]\n", PARSE, "ops[0].clamp", ["at least one of 'min' or 'max'"]),
    # ---- params
    ("params_not_mapping", HEAD5 + "params: [b]\nops: [relu]\n", PARSE, "params", ["mapping"]),
    ("param_bad_name", HEAD5 + "params:\n  Bias: {shape: [4]}\nops:\n  - add: {param: Bias}\n", PARSE, "params.Bias",
     ["identifier"]),
    ("param_bad_shape", HEAD5 + "params:\n  b: {shape: [4, 0]}\nops:\n  - add: {param: b}\n", PARSE, "params.b.shape",
     ["positive integers"]),
    ("param_missing_shape", HEAD5 + "params:\n  b: {init: ones}\nops:\n  - add: {param: b}\n", PARSE, "params.b.shape",
     ["positive integers"]),
    ("param_bad_init", HEAD5 + "params:\n  b: {shape: [4, 1, 1, 1], init: uniform}\nops:\n  - add: {param: b}\n", PARSE,
     "params.b.init", ["'uniform'", "randn"]),
    ("param_unknown_field", HEAD5 + "params:\n  b: {shape: [4], dtype: float32}\nops:\n  - add: {param: b}\n", PARSE,
     "params.b.dtype", ["unknown key"]),
    # ---- rewrites / precision / plan
    ("unknown_rewrite", HEAD5 + "ops: [relu]\nrewrites: {fold_everything: true}\n", PARSE, "rewrites.fold_everything",
     ["unknown key", "dead_region"]),
    ("rewrite_not_bool", HEAD5 + "ops: [relu]\nrewrites: {dead_region: 'off'}\n", PARSE, "rewrites.dead_region",
     ["true or false"]),
    ("rewrites_not_mapping", HEAD5 + "ops: [relu]\nrewrites: some\n", PARSE, "rewrites", ["true, false, or a mapping"]),
    ("bad_precision", HEAD5 + "ops: [relu]\nprecision: fp16\n", PARSE, "precision", ["'fp16'", "ieee", "tf32x3"]),
    ("bad_intermediates", HEAD5 + "ops: [relu]\nintermediates: fp16\n", PARSE, "intermediates", ["'fp16'", "eager", "float32"]),
    ("intermediates_not_a_string", HEAD5 + "ops: [relu]\nintermediates: [eager]\n", PARSE, "intermediates", ["eager, float32"]),
    ("bad_conv_layout", HEAD5 + "ops: [relu]\nplan: {conv_layout: nhwc}\n", PARSE, "plan.conv_layout",
     ["'nhwc'", "channels_last"]),
    ("bad_conv_norm", HEAD5 + "ops: [relu]\nplan: {conv_norm: twice}\n", PARSE, "plan.conv_norm",
     ["'twice'", "recompute", "written"]),
    ("plan_unknown_key", HEAD5 + "ops: [relu]\nplan: {tile: 32}\n", PARSE, "plan.tile", ["unknown key", "conv_layout"]),
    ("plan_not_mapping", HEAD5 + "ops: [relu]\nplan: [auto]\n", PARSE, "plan", ["mapping"]),
    # ---- meaning: reductions
    ("reduce_dim_out_of_range", HEAD5 + "ops:\n  - relu\n  - sum: {dim: 7}\n", BUILD, "ops[1].sum.dim", ["out of range", "7"]),
    ("reduce_negative_dim_out_of_range", HEAD5 + "ops:\n  - max: {dim: [-6]}\n", BUILD, "ops[0].max.dim", ["out of range"]),
    ("reduce_over_batch", HEAD5 + "ops:\n  - relu\n  - sum: {dim: [0, 1]}\n", BUILD, "ops[1].sum.dim", ["batch"]),
    ("reduce_over_batch_negative", HEAD4 + "ops:\n  - mean: {dim: -4}\n", BUILD, "ops[0].mean.dim", ["batch"]),
    ("reduce_repeated_after_normalizing", HEAD5 + "ops:\n  - sum: {dim: [1, -4]}\n", BUILD, "ops[0].sum.dim", ["repeated"]),
    ("reduce_dim_gone_after_reduction", HEAD4 + "ops:\n  - sum: {dim: 1}\n  - sum: {dim: 3}\n", BUILD, "ops[1].sum.dim",
     ["out of range"]),
    # ---- meaning: pools and convs
    ("pools_to_nothing", "name: t\ninput: {shape: [N, 2, 32, 32, 32]}\nops:\n  - relu\n  - max_pool3d: {kernel_size: 40}\n",
     BUILD, "ops[1].max_pool3d", ["pools to nothing"]),
    ("avg_pools_to_nothing", HEAD4 + "ops:\n  - avg_pool2d: {kernel_size: [2, 9]}\n", BUILD, "ops[0].avg_pool2d",
     ["pools to nothing"]),
    ("pool_padding_above_half", HEAD4 + "ops:\n  - max_pool2d: {kernel_size: 2, padding: 2}\n", BUILD, "ops[0].max_pool2d",
     ["at most half of the kernel"]),
    ("avg_pool_padding_above_half", HEAD5 + "ops:\n  - avg_pool3d: {kernel_size: 3, padding: [1, 2, 1]}\n", BUILD,
     "ops[0].avg_pool3d", ["at most half of the kernel"]),
    ("conv3d_on_4d_input", HEAD4 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 3}\n", BUILD, "ops[0].conv3d",
     ["5-d input"]),
    ("pool2d_on_5d_input", HEAD5 + "ops:\n  - relu\n  - max_pool2d: {kernel_size: 2}\n", BUILD, "ops[1].max_pool2d",
     ["4-d input"]),
    ("adaptive_pool_wrong_rank", HEAD4 + "ops:\n  - adaptive_avg_pool3d: {output_size: 1}\n", BUILD,
     "ops[0].adaptive_avg_pool3d", ["5-d input"]),
    ("conv_after_channel_reduction", HEAD4 + "ops:\n  - sum: {dim: 1}\n  - conv2d: {out_channels: 2, kernel_size: 1}\n", BUILD,
     "ops[1].conv2d", ["4-d input"]),
    ("conv_output_empty", HEAD4 + "ops:\n  - conv2d: {out_channels: 2, kernel_size: 9}\n", BUILD, "ops[0].conv2d",
     ["empty"]),
    ("conv_groups_not_dividing_in", HEAD4 + "ops:\n  - conv2d: {out_channels: 6, kernel_size: 1, groups: 3}\n", BUILD,
     "ops[0].conv2d", ["groups=3"]),
    ("conv_groups_not_dividing_out", HEAD4 + "ops:\n  - conv2d: {out_channels: 6, kernel_size: 1, groups: 4}\n", BUILD,
     "ops[0].conv2d", ["groups=4"]),
    ("output_padding_too_large", HEAD4 + "ops:\n  - conv_transpose2d: {out_channels: 4, kernel_size: 3, stride: 2, output_padding: 2}\n",
     BUILD, "ops[0].conv_transpose2d", ["output_padding"]),
    ("group_norm_groups_not_dividing", HEAD5 + "ops:\n  - conv3d: {out_channels: 16, kernel_size: 1}\n  - group_norm: {num_groups: 3}\n",
     BUILD, "ops[1].group_norm", ["num_groups=3", "16"]),
    ("group_norm_more_groups_than_channels", HEAD5 + "ops:\n  - group_norm: {num_groups: 8}\n", BUILD, "ops[0].group_norm",
     ["num_groups=8"]),
    # ---- meaning: parameters
    ("param_does_not_broadcast",
     HEAD5 + "params:\n  bias: {shape: [15, 1, 1, 1]}\nops:\n  - conv3d: {out_channels: 16, kernel_size: 3}\n  - add: {param: bias}\n",
     BUILD, "ops[1].add.param", ["'bias'", "[15, 1, 1, 1]", "does not broadcast"]),
    ("param_spatial_mismatch", HEAD5 + "params:\n  w: {shape: [4, 8, 8, 7]}\nops:\n  - mul: {param: w}\n", BUILD,
     "ops[0].mul.param", ["does not broadcast"]),
    ("param_over_batch", HEAD4 + "params:\n  w: {shape: [2, 4, 1, 1]}\nops:\n  - mul: {param: w}\n", BUILD,
     "ops[0].mul.param", ["does not broadcast"]),
    ("param_too_many_dims", HEAD4 + "params:\n  w: {shape: [1, 1, 4, 1, 1]}\nops:\n  - sub: {param: w}\n", BUILD,
     "ops[0].sub.param", ["more dims"]),
    ("param_after_reduction", HEAD5 + "params:\n  b: {shape: [4, 1, 1, 1]}\nops:\n  - sum: {dim: 1}\n  - add: {param: b}\n",
     BUILD, "ops[1].add.param", ["does not broadcast", "[N, 8, 8, 8]"]),
    ("unknown_param", HEAD5 + "params:\n  bias: {shape: [4, 1, 1, 1]}\nops:\n  - add: {param: bias}\n  - mul: {param: scale}\n",
     BUILD, "ops[1].mul.param", ["'scale'", "bias"]),
    ("unknown_param_none_declared", HEAD5 + "ops:\n  - mul: {param: scale}\n", BUILD, "ops[0].mul.param",
     ["'scale'", "none declared"]),
    ("unused_param", HEAD5 + "params:\n  bias: {shape: [4, 1, 1, 1]}\n  scale: {shape: [1]}\nops:\n  - add: {param: bias}\n",
     BUILD, "params.scale", ["'scale'", "no op uses it"]),
    # ---- meaning: module names
    ("two_convs_default_name",
     HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 1}\n  - relu\n  - conv3d: {out_channels: 4, kernel_size: 1}\n",
     BUILD, "ops[2].conv3d.name", ["'conv'", "ops[0].conv3d", "give this op a 'name'"]),
    ("two_norms_default_name", HEAD5 + "ops: [instance_norm, relu, instance_norm]\n", BUILD, "ops[2].instance_norm.name",
     ["'instance_norm'", "give this op a 'name'"]),
    ("module_name_clashes_with_param",
     HEAD5 + "params:\n  conv: {shape: [1]}\nops:\n  - conv3d: {out_channels: 4, kernel_size: 1}\n  - add: {param: conv}\n",
     BUILD, "ops[0].conv3d.name", ["clashes with the parameter 'conv'"]),
    ("param_ident_collides_with_module_tensor",
     HEAD5 + "params:\n  conv_bias: {shape: [1]}\nops:\n  - conv3d: {out_channels: 4, kernel_size: 1}\n  - add: {param: conv_bias}\n",
     BUILD, "params", ["collide", "conv_bias"]),
]

# Explicit names that repeat: no hint to add a name, since there is one already.
EXPLICIT_NAME_CLASH = (
    HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 1, name: c}\n  - conv3d: {out_channels: 4, kernel_size: 1, name: c}\n"
)


def _assert_one_line_error(err: SpecError, path, key: str, contains=()):
    msg = str(err)
    assert "\n" not in msg and "\r" not in msg, f"multi-line error: {msg!r}"
    assert err.path == str(path)
    assert err.key == key, f"key {err.key!r}, expected {key!r} in {msg!r}"
    prefix = f"{path}: {key}: " if key else f"{path}: "
    assert msg.startswith(prefix), f"{msg!r} does not start with {prefix!r}"
    assert msg[len(prefix):].strip(), "the message says nothing after the key"
    for s in contains:
        assert s in msg, f"{s!r} not in {msg!r}"


def test_cases_have_distinct_ids():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("text, stage, key, contains", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_spec_file(tmp_path, text, stage, key, contains):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_pipeline(path)
    _assert_one_line_error(e.value, path, key, contains)


@pytest.mark.parametrize("text, stage, key, contains", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_comes_from_the_right_stage(text, stage, key, contains):
    """Syntax is parse_spec's job; meaning is build_pipeline's (parse_spec must let it through)."""
    path = "somewhere/bad.yaml"
    if stage == PARSE:
        with pytest.raises(SpecError) as e:
            parse_spec(text, path)
    else:
        spec = parse_spec(text, path)
        with pytest.raises(SpecError) as e:
            build_pipeline(spec)
    _assert_one_line_error(e.value, path, key, contains)


def test_load_spec_names_the_file(tmp_path):
    path = tmp_path / "sub dir" / "my spec.yaml"
    path.parent.mkdir()
    path.write_text(HEAD5 + "ops:\n  - conv3d: {kernel_size: 3}\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    _assert_one_line_error(e.value, path, "ops[0].conv3d.out_channels", ["missing required field"])


def test_missing_file_is_a_spec_error(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as e:
        load_spec(path)
    _assert_one_line_error(e.value, path, "", ["cannot read spec"])


def test_explicit_module_name_clash_has_no_hint(tmp_path):
    path = tmp_path / "clash.yaml"
    path.write_text(EXPLICIT_NAME_CLASH)
    with pytest.raises(SpecError) as e:
        load_pipeline(path)
    _assert_one_line_error(e.value, path, "ops[1].conv3d.name", ["module name 'c' is already used by ops[0].conv3d"])
    assert "give this op a 'name'" not in str(e.value)


def test_two_convs_with_names_are_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(EXPLICIT_NAME_CLASH.replace("name: c}\n", "name: c1}\n", 1))
    pipe = load_pipeline(path)
    assert [op.module for op in pipe.ops] == ["c1", "c"]


def test_spec_error_is_a_kgen_error():
    """The CLI prints KgenError as one line; SpecError must be one."""
    assert issubclass(SpecError, KgenError)
    with pytest.raises(KgenError):
        parse_spec("name: [", "x.yaml")


# ---------------------------------------------------------------- known gaps (kgen bugs)


@pytest.mark.parametrize("value", ["true", "[true, true]", "1.0", "[1.0, 1]"])
def test_adaptive_output_size_rejects_bools_and_floats(value):
    """Bools and floats are not ints anywhere else; output_size must not take `true` or `1.0` for 1.

    kgen bug: spec._ones compares with ``v == 1`` / ``v == [1] * rank``, which True and 1.0 satisfy.
    """
    text = HEAD4 + f"ops:\n  - adaptive_avg_pool2d: {{output_size: {value}}}\n"
    with pytest.raises(SpecError) as e:
        parse_spec(text, "a.yaml")
    _assert_one_line_error(e.value, "a.yaml", "ops[0].adaptive_avg_pool2d.output_size")


def test_file_that_is_not_utf8_is_a_spec_error(tmp_path):
    """kgen bug: load_spec catches only OSError; Path.read_text raises UnicodeDecodeError here."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(HEAD4.encode() + b"description: caf\xe9\nops: [relu]\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    _assert_one_line_error(e.value, path, "")


def test_unknown_key_with_a_newline_is_still_one_line():
    """kgen bug: _no_extra puts the raw key into the key path, so a quoted key with "\\n" splits the message."""
    with pytest.raises(SpecError) as e:
        parse_spec(HEAD4 + 'ops: [relu]\n"out\\nputs": 1\n', "k.yaml")
    assert "\n" not in str(e.value), repr(str(e.value))


# ---------------------------------------------------------------- good specs


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_specs_load(path):
    pipe = load_pipeline(path)
    assert pipe.name == path.stem
    assert pipe.types[0].shape == tuple(load_spec(path).input_shape)
    assert len(pipe.types) == len(pipe.ops) + 1
    assert pipe.output.shape[0] == "N"


def test_rewrite_names_match_the_rewrite_table():
    # every switch a spec may name is a pass of the driver, or a mode's own plan of batch norm (kgen.plan)
    assert REWRITE_NAMES == tuple(name for name, _ in REWRITES) + (EVAL_REWRITE, TRAIN_REWRITE)


def test_rewrites_switch(tmp_path):
    """rewrites: false / a partial mapping are accepted and fill in every name."""
    off = parse_spec(HEAD5 + "ops: [relu]\nrewrites: false\n", "r.yaml")
    assert off.rewrites == {n: False for n in REWRITE_NAMES}
    some = parse_spec(HEAD5 + "ops: [relu]\nrewrites: {dead_region: false}\n", "r.yaml")
    assert some.rewrites == {n: n != "dead_region" for n in REWRITE_NAMES}


# ---------------------------------------------------------------- the command line

CLI_CASES = [
    ("syntax", HEAD5 + "ops:\n  - conv3d: {out_channels: 4, kernel_size: 0}\n", "ops[0].conv3d.kernel_size"),
    ("semantic", "name: t\ninput: {shape: [N, 2, 32, 32, 32]}\nops:\n  - relu\n  - max_pool3d: {kernel_size: 40}\n",
     "ops[1].max_pool3d"),
    ("yaml", "name: t\ninput: {shape: [N\n", ""),
]


def _render_check(tmp_path, spec_path):
    return kgen_cli("render", "--check", "--out", tmp_path / "out", spec_path)


@pytest.mark.parametrize("text, key", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_reports_a_bad_spec_on_one_line(tmp_path, text, key):
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(text)
    proc = _render_check(tmp_path, spec_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kgen: error: {spec_path}: ")
    if key:
        assert f"{spec_path}: {key}: " in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_not_utf8_spec_is_one_line(tmp_path):
    """kgen bug (see test_file_that_is_not_utf8_is_a_spec_error): the CLI shows a traceback."""
    spec_path = tmp_path / "latin1.yaml"
    spec_path.write_bytes(HEAD4.encode() + b"description: caf\xe9\nops: [relu]\n")
    proc = _render_check(tmp_path, spec_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"kgen: error: {spec_path}")


# ---- values, inputs and the constructor (kgen import's spec syntax)

INPUTS2 = "name: t\ninputs:\n  x: {shape: [N, 4]}\n  y: {shape: [N, 4]}\nexample: {N: 2}\n"
VALUE_CASES = [
    ("unknown_value", INPUTS2 + "ops:\n  - add: {tensor: z}\n", "ops[0].add.tensor", ["unknown value 'z'", "x, y"]),
    ("value_named_later", HEAD4 + "ops:\n  - add: {tensor: h}\n  - relu: {as: h}\n", "ops[0].add.tensor",
     ["unknown value 'h'", "named later"]),
    ("from_unknown", HEAD4 + "ops:\n  - relu: {from: q}\n", "ops[0].relu.from", ["unknown value 'q'"]),
    ("as_twice", HEAD4 + "ops:\n  - relu: {as: h}\n  - sigmoid: {as: h}\n", "ops[1].sigmoid.as", ["already the name of a value"]),
    ("as_names_a_param", HEAD4 + "params:\n  b: {shape: [4, 1, 1]}\nops:\n  - add: {param: b, as: b}\n", "ops[0].add.as",
     ["already the name of a parameter"]),
    ("value_does_not_broadcast", INPUTS2 + "ops:\n  - sum: {dim: 1, keepdim: true, as: s}\n  - add: {from: y, tensor: x}\n"
     "  - mul: {tensor: s}\n  - sum: {dim: 1}\n  - add: {tensor: y}\n", "ops[4].add.tensor", ["value 'y'", "does not broadcast"]),
    ("two_operands", INPUTS2 + "ops:\n  - add: {scalar: 1, tensor: y}\n", "ops[0].add", ["exactly one of 'scalar', 'param' or 'tensor'"]),
    ("view_without_param", HEAD4 + "ops:\n  - mul: {scalar: 2, view: [4]}\n", "ops[0].mul.view", ["applies to a 'param' only"]),
    ("view_wrong_size", HEAD4 + "params:\n  b: {shape: [4]}\nops:\n  - mul: {param: b, view: [1, 3, 1, 1]}\n",
     "ops[0].mul.view", ["cannot view parameter 'b'"]),
    ("as_is_not_an_op", HEAD4 + "ops:\n  - as: {name: h}\n", "ops[0]", ["unknown op 'as'", "as: NAME"]),
    ("op_unknown_key_lists_as", HEAD4 + "ops:\n  - relu: {named: h}\n", "ops[0].relu.named", ["unknown key", "as", "from"]),
    ("inputs_and_input", INPUTS2 + "input: {shape: [N, 4]}\nops: [relu]\n", "inputs", ["either 'input' or 'inputs'"]),
    ("inputs_other_batch", "name: t\ninputs:\n  x: {shape: [N, 4]}\n  y: {shape: [M, 4]}\nops: [relu]\n",
     "inputs.y.shape[0]", ["batch of the first"]),
    ("second_input_named_x", "name: t\ninputs:\n  a1: {shape: [N, 4]}\n  x: {shape: [N, 4]}\nops: [relu]\n", "inputs.x",
     ["only the first input may be named x"]),
    ("input_named_like_generated_code", "name: t\ninputs:\n  x: {shape: [N, 4]}\n  out: {shape: [N, 4]}\nops: [relu]\n",
     "inputs.out", ["a name the generated code uses"]),
    ("example_with_input", HEAD4 + "example: {N: 3}\nops: [relu]\n", "example", ["input.example"]),
    ("unused_param_read", HEAD4 + "params:\n  b: {shape: [4, 1, 1], unused: true}\nops:\n  - add: {param: b}\n",
     "params.b.unused", ["marked unused but an op reads it"]),
    ("param_init_inf", HEAD4 + "params:\n  b: {shape: [], init: .inf}\nops:\n  - add: {param: b}\n", "params.b.init",
     ["finite number"]),
    ("ctor_arg_keyword", HEAD4 + "constructor:\n  args: {class: 3}\nops: [relu]\n", "constructor.args.class",
     ["Python argument name"]),
    ("ctor_arg_string", HEAD4 + "constructor:\n  args: {mode: fast}\nops: [relu]\n", "constructor.args.mode",
     ["null, a boolean, a number"]),
    ("ctor_default_order", HEAD4 + "constructor:\n  args: {a: {default: 1}, b: 2}\nops: [relu]\n", "constructor.args.b",
     ["without a default follows one with a default"]),
    ("ctor_member_unknown", HEAD4 + "constructor:\n  members: [conv]\nops: [relu]\n", "constructor.members[0]",
     ["neither a submodule nor a parameter"]),
    ("ctor_source_odd", HEAD4 + "constructor:\n  source: 'a b;c.py'\nops: [relu]\n", "constructor.source", ["plain characters"]),
    ("dropout_p_one", HEAD4 + "ops:\n  - dropout: {p: 1.0}\n", "ops[0].dropout.p", ["probability in [0, 1)"]),
    ("matmul_two_operands", INPUTS2 + "params:\n  w: {shape: [4, 4]}\nops:\n  - matmul: {param: w, tensor: y}\n",
     "ops[0].matmul", ["exactly one of 'param' or 'tensor'"]),
    ("linear_wrong_features", HEAD4 + "ops:\n  - linear: {out_features: 3}\n  - linear: {out_features: 2, name: l2}\n"
     "  - matmul: {param: w}\nparams:\n  w: {shape: [3, 5]}\n", "ops[2].matmul", ["multiplies [.., 3] by [3, 5]", "2]"]),
    ("reshape_wrong_size", HEAD4 + "ops:\n  - reshape: {shape: [3, -1]}\n", "ops[0].reshape.shape", ["cannot view"]),
    ("layer_norm_wrong_shape", HEAD4 + "ops:\n  - layer_norm: {normalized_shape: [4]}\n", "ops[0].layer_norm",
     ["normalizes the last dims [4]"]),
]


@pytest.mark.parametrize("text, key, contains", [c[1:] for c in VALUE_CASES], ids=[c[0] for c in VALUE_CASES])
def test_bad_values_inputs_constructor(tmp_path, text, key, contains):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_pipeline(path)
    _assert_one_line_error(e.value, path, key, contains)
