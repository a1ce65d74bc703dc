import contextlib
import math
import os
import sys
from pathlib import Path

import pytest
import torch

# Plan for the default target (the H200) on any machine, so that rendering gives
# the committed generated/ files on a GPU with another SM count too.
os.environ.setdefault("KGEN_TARGET", "default")
# The backend's graphs and partitions run kgen's form, never measured against PyTorch's: a test of kgen's kernels
# must not pass through PyTorch's form because it timed faster (the fixture measured_forms turns measuring on).
os.environ.setdefault("KGEN_MEASURE", "0")

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SHIPPED = [p.stem for p in SPECS]
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

sys.path.insert(0, str(Path(__file__).resolve().parent))  # handwritten.py


@pytest.fixture(scope="session")
def built():
    """The shipped modules under generated/, built for this machine: name -> module dir."""
    from kgen.build import build_modules

    dirs = [ROOT / "generated" / n for n in SHIPPED]
    build_modules(dirs)
    return {d.name: d for d in dirs}


@pytest.fixture(scope="session")
def modules(built):
    from kgen.validate import import_module_dir

    return {n: import_module_dir(d) for n, d in built.items()}


@pytest.fixture
def measured_forms(monkeypatch):
    """kgen.runtime.MeasuredGraph measures its forms, as outside the tests."""
    monkeypatch.setenv("KGEN_MEASURE", "1")


@pytest.fixture
def measured_as_on_a_gpu(monkeypatch, measured_forms):
    """kgen.runtime.MeasuredGraph measures CPU tensors as a GPU's (replays too), the GPU's part stood in for:
    nothing to drain."""
    from kgen import runtime

    monkeypatch.setattr(runtime.MeasuredGraph, "_on_gpu", lambda self, args: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def load_model_file(path: Path):
    """A model file a test wrote (KernelBench's layout), imported as a module of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_model_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def conv_bn_blocks_model(blocks: int, size: int) -> str:
    """A model file's text (KernelBench's layout): ``blocks`` blocks of a 3x3 convolution, a batch norm and a ReLU
    over 4 channels, input [2, 4, size, size]: each block 4 parameters and 2 running statistics."""
    return f'''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels=4, blocks={blocks}):
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                                  nn.ReLU()) for _ in range(blocks)])

    def forward(self, x):
        return self.body(x)


def get_inputs():
    return [torch.rand(2, 4, {size}, {size})]


def get_init_inputs():
    return []
'''


def write_model_file(dir_path: Path, name: str, text: str) -> Path:
    """A model file in KernelBench's layout, ``text`` dedented, as ``dir_path/NAME.py``."""
    import textwrap

    path = dir_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


@contextlib.contextmanager
def fresh_kgen_cache(folder: Path):
    """KGEN_CACHE set to ``folder/cache`` (made here) while the block runs; its precompiled header is kgen's usual
    cache's, so that it is not made again."""
    from kgen.cache import kgen_cache

    cache = folder / "cache"
    cache.mkdir()
    pch = kgen_cache() / "pch"
    pch.mkdir(parents=True, exist_ok=True)
    (cache / "pch").symlink_to(pch)
    old = os.environ.get("KGEN_CACHE")
    os.environ["KGEN_CACHE"] = str(cache)
    try:
        yield cache
    finally:
        if old is None:
            del os.environ["KGEN_CACHE"]
        else:
            os.environ["KGEN_CACHE"] = old


def kgen_cli(*args):
    """kgen's command line run in this process (no interpreter start: `python -m kgen` imports torch, seconds a
    call), in the repository's directory: its exit status, stdout and stderr. An exception that escapes the
    command is in stderr as its traceback, as it would be in a process of its own."""
    import traceback
    import types

    from click.testing import CliRunner

    from kgen.cli import main

    here = os.getcwd()
    os.chdir(ROOT)  # (contextlib.chdir is Python 3.11's; the project takes 3.10)
    try:
        try:
            runner = CliRunner(mix_stderr=False)  # click 8.1 puts stderr in stdout unless told apart
        except TypeError:
            runner = CliRunner()  # click 8.2 on: apart always, and no such argument
        result = runner.invoke(main, [str(a) for a in args])
    finally:
        os.chdir(here)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return types.SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=stderr)


def write_spec(dir_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = Path(dir_path) / name
    path.write_text(text)
    return path


def render_specs(root: Path, texts: dict) -> dict:
    """Each spec text of ``texts`` (name -> YAML) written as ``root/NAME.yaml`` and rendered into
    ``root/gen``; returns name -> (spec path, module dir)."""
    from kgen.render import render_spec, write_rendered

    out = {}
    for name, text in texts.items():
        spec = write_spec(root, text, f"{name}.yaml")
        write_rendered(render_spec(spec, Path(root) / "gen"), Path(root) / "gen")
        out[name] = (spec, Path(root) / "gen" / name)
    return out


# A test over both builds: the CUDA one is a GPU test (marked; skipped without a GPU).
BUILD_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


def build_and_validate(rendered: dict, device: str) -> None:
    """Build every module of ``rendered`` (render_specs' result) for ``device`` and validate each against the
    float64 reference of its spec."""
    from kgen.build import build_modules
    from kgen.validate import validate

    build_modules([d for _, d in rendered.values()], device)
    for name, (spec, d) in rendered.items():
        assert_report_passed(validate(spec, d, device), name)


def build_drawn_specs(root: Path, texts: list, prefix: str, where) -> tuple[list, Path]:
    """Seeded random specs (tests/test_random_*.py): each written as ``PREFIX_i.yaml``, rendered
    into ``root/gen`` and built together on the CPU; a failure names the spec (``where(i)``).
    Returns (spec paths, output root)."""
    from kgen.build import build_modules
    from kgen.errors import KgenError
    from kgen.render import render_spec, write_rendered

    out = root / "gen"
    paths = []
    for i, text in enumerate(texts):
        path = write_spec(root, text, f"{prefix}_{i}.yaml")
        try:
            write_rendered(render_spec(path, out), out)
        except KgenError as e:
            pytest.fail(f"rendering {where(i)}failed: {e}")
        paths.append(path)
    try:
        build_modules([out / f"{prefix}_{i}" for i in range(len(texts))], "cpu")
    except KgenError as e:
        pytest.fail(f"building the {prefix} pipelines failed: {e}\n" + "\n".join(where(i) for i in range(len(texts))))
    return paths, out


def validate_drawn_spec(paths: list, out: Path, prefix: str, i: int, where) -> None:
    """Validate the i-th module of ``build_drawn_specs`` on the CPU build; a failure names the spec."""
    from kgen.validate import validate

    report = validate(paths[i], out / f"{prefix}_{i}", "cpu")
    assert_report_passed(report, where(i))


def assert_report_passed(report, context: str = "", rel_l2: bool = False) -> None:
    """Fail unless a ``kgen.validate`` Report has cases and every one of them passed (what
    ``report.passed`` says: a report with no cases does not pass). The message starts with
    ``context`` (the spec, the batch, ...: any text, several lines too), then names each failing
    case with its problem, and its rel L2 error too with ``rel_l2``; or says there were no cases."""
    failures = [f"  {c.case}: " + (f"rel L2 {c.rel_l2:.3g}, " if rel_l2 else "") + c.problem
                for c in report.cases if not c.passed]
    if report.cases and not failures:
        return
    lines = [context.rstrip()] if context.strip() else []
    if not report.cases:
        lines.append(f"validating {report.name} on {report.device} gave no cases")
    else:
        lines.append(f"{len(failures)} of {len(report.cases)} cases of {report.name} on {report.device} failed:")
        lines += failures
    raise AssertionError("\n".join(lines))


def fake_tuning(spec, batches, fastest, root, dtype="float32"):
    """``kgen.tune.prepare`` for real (candidates planned and rendered, in ``dtype``), then invented times:
    ``fastest`` (a predicate on a candidate's choices, or a dict of them by batch) picks the winner
    at each batch; eager PyTorch is slower than every candidate."""
    import json

    from kgen import tune

    t = tune.prepare(spec, batches, tune.MAX_CANDIDATES, root, dtype)
    for m in t.measured:
        for b in t.batches:
            wins = (fastest if callable(fastest) else fastest[b])(m.plan.choices)
            m.ms[b] = 1.0 if wins else 2.0 + len(json.dumps(m.plan.choices)) / 1e3
    t.eager_pytorch_ms = {b: 3.0 for b in t.batches}
    return t


def spec_text(shape, ops, params=None, rewrites=None, batch=2, name="t", plan=None) -> str:
    """A spec as YAML text: input [N] + shape with a symbolic batch N (example value ``batch``)."""
    import yaml

    raw = {"name": name, "input": {"shape": ["N"] + list(shape), "dtype": "float32", "example": {"N": batch}}, "ops": ops}
    if params:
        raw["params"] = params
    if rewrites is not None:
        raw["rewrites"] = rewrites
    if plan:
        raw["plan"] = plan
    return yaml.safe_dump(raw, sort_keys=False)


def with_param(entry) -> dict:
    """An operand op of the op table (kgen.ops) as a spec op whose operand is the parameter ``p``, its other fields
    (constants: masked_fill's value) from the entry's example."""
    return {entry.name: {**{k: v for k, v in entry.example.items() if k not in ("scalar", "tensor")}, "param": "p"}}


def pipeline_of(text: str, path: str = "t.yaml"):
    from kgen.ir import build_pipeline
    from kgen.spec import parse_spec

    return build_pipeline(parse_spec(text, path))


# A norm's CUDA layouts (templates/norm): each spec picks a different stats_by / apply_by
# (input shape, ops, layout[, plan]).
CL_ATEN = {"conv": "aten", "conv_layout": "channels_last"}
NORM_LAYOUTS = {
    # a GEMM row's groups: 8 groups of 32 values, a warp each; apply over all outputs in order (pinned: the
    # layer_norm family's one pass is the cost model's choice, LAYER_NORMS' gn_rows)
    "norm_rows": ([256], ["relu", {"group_norm": {"num_groups": 8}}, "tanh"], ("warp", "flat")),
    # small groups over a 3x3 map, reduced over the channels by a warp per position
    "norm_small_max": ([64, 3, 3], [{"group_norm": {"num_groups": 16}}, {"max": {"dim": 1}}], ("warp", "warp")),
    "norm_small_mean": ([32, 5, 7], [{"group_norm": {"num_groups": 4}}, {"mean": {"dim": 1}}, "sigmoid"], ("warp", "warp")),
    # large groups: blocks per group, split; blocks along a channel
    "norm_large": ([8, 48, 48], [{"group_norm": {"num_groups": 2}}, "relu"], ("block", "channel")),
    # a channels_last convolution output (ATen's): rows of channels; transposed into NCDHW (24 channels:
    # 240 row threads, odd sizes), or reduced over the channels by a warp per row
    "norm_cl_rows": ([8, 6, 9, 11], [{"conv3d": {"out_channels": 24, "kernel_size": 3, "padding": 1}}, "relu",
                                     {"group_norm": {"num_groups": 3}}], ("rows", "transpose"), CL_ATEN),
    "norm_cl_max": ([8, 20, 21], [{"conv2d": {"out_channels": 128, "kernel_size": 3}}, {"group_norm": {"num_groups": 8}},
                                  {"max": {"dim": 1}}], ("rows", "warp"), CL_ATEN),
}


# ATen convolution stages whose channels_last input the generated copy makes (templates/conv_aten/kernel.cu.j2):
# few and odd channel counts (tiles of 1365 and 124 positions), 2-D and 3-D, and an input narrowed to the
# prefix a cropped (dead-region) output reads. (input shape, ops)
INPUT_COPIES = {
    "copy_c3_2d": ([3, 37, 41], [{"conv2d": {"out_channels": 16, "kernel_size": 3}}, {"group_norm": {"num_groups": 4}}]),
    "copy_c33_3d": ([33, 5, 7, 9], [{"conv3d": {"out_channels": 8, "kernel_size": 3, "padding": 1}}, "relu"]),
    "copy_narrowed": ([8, 24, 25, 26], [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 5, "stride": 2, "padding": 2}},
                                       {"max_pool3d": {"kernel_size": 6}}, {"sum": {"dim": [1], "keepdim": True}}]),
}


# A channels_last convolution output read by an elementwise stage that writes the NC[D]HW output: the
# shared-memory tile (pool_reduce's schedule.transpose_channels), its channels per tile (0: threads walk the
# output, too few channels), its channels per 16-byte load (schedule.transpose_vector; 0: value by value,
# where the input is pooled) and the spec's dtype. (input shape, ops, tile channels, vector, dtype)
TRANSPOSE_TILES = {
    "tile_c40_3d": ([8, 5, 7, 9], [{"conv3d": {"out_channels": 40, "kernel_size": 3, "padding": 1}}, "relu",
                                   {"mul": {"scalar": 3.0}}], 32, 4, "float32"),
    "tile_c12_2d": ([3, 13, 17], [{"conv2d": {"out_channels": 12, "kernel_size": 3}}, "sigmoid"], 8, 4, "float32"),
    "tile_phases": ([8, 6, 7, 5], [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}},
                                   {"clamp": {"min": -1.0}}, {"div": {"scalar": 2.0}}], 16, 4, "float32"),
    "tile_pool": ([8, 9, 10, 11], [{"conv3d": {"out_channels": 24, "kernel_size": 3, "padding": 1}},
                                   {"max_pool3d": {"kernel_size": 2}}, "relu"], 16, 0, "float32"),
    "tile_c4_off": ([3, 9, 11], [{"conv2d": {"out_channels": 4, "kernel_size": 3}}, "tanh"], 0, 0, "float32"),
    # 80 channels: two tiles of 32 and a partial one; 80 positions per channel: stores of 8 positions
    "tile_c80_half": ([16, 12, 10], [{"conv2d": {"out_channels": 80, "kernel_size": 3}}, "gelu",
                                     {"mul": {"scalar": 0.5}}], 32, 8, "[bfloat16, float16]"),
    # one load per position (8 channels), 63 positions per channel: stores one at a time
    "tile_c8_half": ([4, 9, 11], [{"conv2d": {"out_channels": 8, "kernel_size": 3}}, "relu"], 8, 8, "float16"),
    # #100 in small: the 8 sub-pixel phase tiles of a transposed convolution, its bias deferred (PINNED_CHOICES), each position's
    # 16 channels two 16-byte loads from the tile of its phase; 693 positions per channel: stores one at a time
    "tile_phases_half": ([8, 6, 7, 5], [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}},
                                        {"clamp": {"min": -1.0}}, {"div": {"scalar": 2.0}}], 16, 8, "bfloat16"),
}


def render_cl_aten(name: str, shape, ops, root: Path, dtype: str = "float32") -> tuple[Path, Path, list[dict]]:
    """A spec (convolution pinned to ATen, channels_last; example batch 3) rendered under root/gen;
    returns (spec, module directory, the schedules of its pool_reduce stages over all plans). The
    convolution's output is what the stages read: sum_before_conv (which would sum a spatial mean's
    input first) is off."""
    import json

    from kgen.render import render_plan, write_rendered

    text = spec_text(shape, ops, name=name, batch=3, plan=CL_ATEN, rewrites={"sum_before_conv": False})
    spec = write_spec(root, text.replace("dtype: float32", f"dtype: {dtype}"), f"{name}.yaml")
    write_rendered(render_plan(pinned_selection(name, spec), root / "gen"), root / "gen")
    plan = json.loads((root / "gen" / name / "plan.json").read_text())
    schedules = [s["schedule"] for p in plan["plans"] for s in p["stages"] if s.get("kind") == "pool_reduce"]
    return spec, root / "gen" / name, schedules


def render_transpose_tile(name: str, root: Path) -> tuple[Path, Path]:
    """TRANSPOSE_TILES[name] rendered (render_cl_aten), checked to have the tile it stands for."""
    shape, ops, channels, vector, dtype = TRANSPOSE_TILES[name]
    spec, module_dir, schedules = render_cl_aten(name, shape, ops, root, dtype)
    assert [(s["transpose_channels"], s["transpose_vector"]) for s in schedules] == [(channels, vector)] * len(schedules), schedules
    return spec, module_dir


# A channels_last convolution output reduced over a spatial dim into an NC[D]HW output: the threads walk
# the outputs in the input's memory order (pool_reduce's schedule.kept_walk, dims 1 = channels), so their
# loads are adjacent. (input shape, ops, kept_walk)
KEPT_WALKS = {
    "walk_mean_d": ([8, 5, 7, 9], [{"conv3d": {"out_channels": 20, "kernel_size": 3, "padding": 1}},
                                   {"mean": {"dim": 2, "keepdim": True}}, "tanh"], [3, 4, 1]),
    "walk_max_h": ([3, 13, 17], [{"conv2d": {"out_channels": 12, "kernel_size": 3}}, {"max": {"dim": 2}}, "relu"], [3, 1]),
    "walk_phases": ([8, 6, 7, 5], [{"conv_transpose3d": {"out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1}},
                                   {"sum": {"dim": 3, "keepdim": True}}], [2, 4, 1]),
    "walk_pool": ([8, 9, 10, 11], [{"conv3d": {"out_channels": 24, "kernel_size": 3, "padding": 1}},
                                   {"max_pool3d": {"kernel_size": 2}}, {"mean": {"dim": 4}}], [2, 3, 1]),
}


def render_kept_walk(name: str, root: Path) -> tuple[Path, Path]:
    """KEPT_WALKS[name] rendered (render_cl_aten), checked to walk its outputs in the order it stands for."""
    shape, ops, walk = KEPT_WALKS[name]
    spec, module_dir, schedules = render_cl_aten(name, shape, ops, root)
    assert [s["kept_walk"] for s in schedules] == [walk] * len(schedules), schedules
    return spec, module_dir


def norm_layout_spec(name: str, directory: Path) -> Path:
    """NORM_LAYOUTS[name] written as directory/NAME.yaml (example batch 37)."""
    shape, ops, _, *plan = NORM_LAYOUTS[name]
    return write_spec(Path(directory), spec_text(shape, ops, name=name, batch=37, plan=plan[0] if plan else None), f"{name}.yaml")


def render_norm_layout(name: str, root: Path) -> tuple[Path, Path]:
    """NORM_LAYOUTS[name] written under root and rendered into root/gen, checked to have the
    layout it stands for; returns (spec, module directory)."""
    import json

    from kgen.render import render_plan, write_rendered

    spec = norm_layout_spec(name, root)
    write_rendered(render_plan(pinned_selection(name, spec), root / "gen"), root / "gen")
    plan = json.loads((root / "gen" / name / "plan.json").read_text())
    layouts = {(s["schedule"]["stats_by"], s["schedule"]["apply_by"]) for p in plan["plans"] for s in p["stages"]
               if s.get("kind") == "norm"}
    assert layouts == {NORM_LAYOUTS[name][2]}, layouts
    return spec, root / "gen" / name


# The layer_norm family's CUDA schedules (templates/layer_norm): each spec picks another row form.
# (input shape, ops, params, plan, example batch, (row_threads, vector), input form: "flat" | "phased" | "channels_last")
LAYER_NORMS = {
    # KernelBench level 2 #34's row of 64 (16 lanes per row, float4 loads) after a per-channel prologue, then gelu and a scale
    "ln_r64": ([5, 3, 64], [{"add": {"param": "s"}}, {"layer_norm": {"normalized_shape": [64]}}, "gelu", {"mul": {"scalar": 1.5}}],
               {"s": {"shape": [5, 1, 1]}}, None, 37, (16, 4), "flat"),
    # 48 values: a warp per row, its second slot half full (scalar loads); no affine part
    "ln_r48": ([4, 7, 48], [{"layer_norm": {"normalized_shape": [48], "elementwise_affine": False}}, "relu"],
               None, None, 37, (32, 1), "flat"),
    # a 2-dim row (6 x 8 = 48 values over H and W): a weight and no bias, its output kept in a register for a later op
    "ln_6x8": ([3, 6, 8], [{"layer_norm": {"normalized_shape": [6, 8], "bias": False, "as": "h"}}, "tanh",
                           {"mul": {"tensor": "h"}}], None, None, 37, (32, 1), "flat"),
    # rows of 8: 2 lanes per row (float4 loads), 16 rows per warp
    "ln_r8": ([3, 5, 8], [{"layer_norm": {"normalized_shape": [8], "eps": 0.01}}, {"hardtanh": {"min_val": -0.5, "max_val": 0.75}}],
              None, None, 37, (2, 4), "flat"),
    # a group norm's rows: a GEMM row's 8 groups of 32 channels (8 lanes per group, float4 loads, each value its
    # channel's weight and bias) between a prologue and an epilogue op; an instance norm over 5 x 7 maps (rows of
    # 35: a warp per row, scalar loads, no affine part)
    "gn_rows": ([256], ["relu", {"group_norm": {"num_groups": 8}}, "tanh"], None, None, 37, (8, 4), "flat"),
    "in_rows": ([6, 5, 7], [{"instance_norm": {}}, {"mul": {"scalar": 2.0}}], None, None, 37, (32, 1), "flat"),
    # a block per row: 512 values (float2 loads), and a 2-dim row of 1024 (float4 loads)
    "ln_r512": ([3, 512], [{"sub": {"scalar": 0.5}}, {"layer_norm": {"normalized_shape": [512]}}], None, None, 37, (256, 2), "flat"),
    "ln_32x32": ([2, 32, 32], [{"layer_norm": {"normalized_shape": [32, 32]}}, "silu"], None, None, 37, (256, 4), "flat"),
    # #34 in small: a strided transposed convolution by ATen as sub-pixel phase tiles (the cost model's choice at
    # batch 2048), read in place, its bias added in the prologue; rows of 12 (16 lanes per row, 12 of them with a value)
    "ln_phases": ([4, 3, 5, 6], [{"conv_transpose3d": {"out_channels": 6, "kernel_size": 4, "stride": 2, "padding": 1}},
                                 {"layer_norm": {"normalized_shape": [12]}}, "gelu", {"mul": {"scalar": 1.0}}],
                  None, {"conv": "aten", "conv_layout": "contiguous"}, 2048, (16, 1), "phased"),
    # a channels_last ATen convolution output, rows along its last dim: the tiles form (a thread per row, the
    # 7 x 5 tiles of a sample's rows through shared memory, 51 tiles per block: scalar loads), and 8 x 16 tiles
    # (float4 loads and stores) with a per-channel prologue
    "ln_cl": ([3, 6, 7], [{"conv2d": {"out_channels": 5, "kernel_size": 3, "padding": 1}}, {"layer_norm": {"normalized_shape": [7]}},
                          {"leaky_relu": {"negative_slope": 0.2}}], None, CL_ATEN, 37, (1, 1), "channels_last"),
    "ln_cl_tiles": ([3, 5, 8], [{"conv2d": {"out_channels": 16, "kernel_size": 3, "padding": 1}}, {"add": {"param": "s"}},
                                {"layer_norm": {"normalized_shape": [8]}}, "gelu"], {"s": {"shape": [16, 1, 1]}}, CL_ATEN, 37,
                    (1, 4), "channels_last"),
    # rows of 64 over 64 channels (#34's): 2 tiles per block, two threads sum each row (32 values each)
    "ln_cl_parts": ([8, 4, 64], [{"conv2d": {"out_channels": 64, "kernel_size": 3, "padding": 1}},
                                 {"layer_norm": {"normalized_shape": [64]}}, "gelu"], None, CL_ATEN, 37, (1, 4), "channels_last"),
    # rows of 45 over 120 channels: one tile per block, two threads sum each row's 23 and 22 values, stores
    # value by value
    "ln_cl_uneven_parts": ([3, 3, 45], [{"conv2d": {"out_channels": 120, "kernel_size": 3, "padding": 1}},
                                        {"layer_norm": {"normalized_shape": [45]}}], None, CL_ATEN, 5, (1, 4), "channels_last"),
    # rows of 9 over 6 channels: a tile of 54 values read as float2 pairs, the rows (odd) stored value by value
    "ln_cl_pairs": ([3, 7, 9], [{"conv2d": {"out_channels": 6, "kernel_size": 3, "padding": 1}}, {"layer_norm": {"normalized_shape": [9]}}],
                    None, CL_ATEN, 37, (1, 2), "channels_last"),
    # a channels_last input whose rows span two dims (6 x 7): read in place, a row's values a channel count apart
    "ln_cl_2d": ([3, 6, 7], [{"conv2d": {"out_channels": 5, "kernel_size": 3, "padding": 1}}, {"layer_norm": {"normalized_shape": [6, 7]}}],
                 None, CL_ATEN, 37, (32, 1), "channels_last"),
}


def render_one_stage_case(table: dict, family: str, schedule_keys: tuple, name: str, root: Path,
                          module: str | None = None) -> tuple[Path, Path]:
    """table[name] (shape, ops, params, plan, example batch, schedule, input form) written under root as module
    ``module`` (default: the name; a process loads each module name once: its ops are registered under it) and
    rendered into root/gen (pinned_selection's plans), checked to have one ``family`` stage whose schedule fields
    ``schedule_keys`` and input form (flat | phased | channels_last) are the ones it stands for; returns (spec,
    module directory)."""
    import json

    from kgen.render import render_plan, write_rendered

    module = module or name
    shape, ops, params, plan, batch, schedule, form = table[name]
    spec = write_spec(root, spec_text(shape, ops, params=params, name=module, batch=batch, plan=plan), f"{module}.yaml")
    write_rendered(render_plan(pinned_selection(name, spec), root / "gen"), root / "gen")
    stages = [s for p in json.loads((root / "gen" / module / "plan.json").read_text())["plans"] for s in p["stages"]
              if s["family"] == family]
    assert len(stages) == 1, stages
    sc, buf = stages[0]["schedule"], stages[0]["input_buffer"]
    assert tuple(sc[k] for k in schedule_keys) == schedule, sc
    got = "phased" if buf["phase_stride"] else buf["layout"] if buf["layout"] == "channels_last" else "flat"
    assert got == form, buf
    return spec, root / "gen" / module


def build_cases(render, names, root: Path, device: str, suffix: str = "") -> dict:
    """Each case name rendered by ``render(name, root, module)`` (module: the name + ``suffix``; a process loads
    each module name once) and all built together for ``device``: name -> (spec, module directory)."""
    from kgen.build import build_modules

    built = {name: render(name, root, name + suffix) for name in sorted(names)}
    build_modules([d for _, d in built.values()], device)
    return built


def render_layer_norm(name: str, root: Path, module: str | None = None) -> tuple[Path, Path]:
    """LAYER_NORMS[name] rendered (render_one_stage_case)."""
    return render_one_stage_case(LAYER_NORMS, "layer_norm", ("row_threads", "vector"), name, root, module)


# The softmax family's forms (kgen/families/softmax.py): shape, ops, params, plan, example batch,
# (form, slice_threads, cached), input form (flat | phased | channels_last).
SOFTMAXES = {
    # KernelBench level 2 #49 in small: softmax over 24 channels (not a power of two), a thread per
    # position, a per-channel prologue, then sigmoid
    "sm_c24": ([24, 5, 7], [{"add": {"param": "b"}}, {"softmax": {"dim": 1}}, "sigmoid"], {"b": {"shape": [24, 1, 1]}}, None, 37,
               ("columns", 1, True), "flat"),
    # #91's 128 channels in small: 4 lanes per slice, 8 positions apart, 32 values each
    "sm_c128": ([128, 3, 5], [{"softmax": {"dim": 1}}, {"add": {"param": "b"}}, "sigmoid"], {"b": {"shape": [128, 1, 1]}}, None, 37,
                ("columns", 4, True), "flat"),
    # 300 channels: 4 lanes of 75 values, more than registers hold, so the slice is read twice; log_softmax
    "lsm_c300": ([300, 3, 5], [{"log_softmax": {"dim": 1}}, {"mul": {"scalar": 0.5}}], None, None, 37, ("columns", 4, False), "flat"),
    # 48 channels over two lanes (24 values each); log_softmax
    "lsm_c48": ([48, 9], [{"log_softmax": {"dim": 1}}], None, None, 37, ("columns", 2, True), "flat"),
    # #58 in small: logsumexp over 16 channels of a 3-d volume, kept as a value for the ops after it
    "lse_c16": ([16, 4, 6, 5], [{"logsumexp": {"dim": 1, "keepdim": True, "as": "l"}}, {"add": {"scalar": 3.0}}, "sigmoid",
                                {"mul": {"tensor": "l"}}, {"sub": {"param": "b"}}, {"clamp": {"min": -1.0, "max": 1.0}}],
                {"b": {"shape": [1, 1, 1, 1]}}, None, 37, ("columns", 1, True), "flat"),
    # the middle axis: 6 slices' values 5 apart (columns), logsumexp without keepdim
    "lse_mid": ([4, 6, 5], [{"logsumexp": {"dim": 2}}, "relu"], None, None, 37, ("columns", 1, True), "flat"),
    # two consecutive dims as one axis of 30 values (rows: 32 lanes)
    "lse_hw": ([4, 6, 5], [{"logsumexp": {"dim": [2, 3], "keepdim": True}}, {"mul": {"param": "s"}}], {"s": {"shape": [4, 1, 1]}},
               None, 37, ("rows", 32, True), "flat"),
    # short rows: 10 values over 16 lanes, two slices per warp
    "sm_r10": ([6, 10], ["tanh", {"softmax": {"dim": 2}}], None, None, 37, ("rows", 16, True), "flat"),
    # #99 and #84 in small: a GEMM row of 1000 (256 threads, 4 values each, the last slot partial), gelu before
    "sm_r1000": ([1000], ["gelu", {"softmax": {"dim": 1}}], None, None, 37, ("rows", 256, True), "flat"),
    # a row of 8192: 512 threads, 16 values each; log_softmax
    "lsm_r8192": ([8192], [{"mul": {"param": "s"}}, {"log_softmax": {"dim": 1}}], {"s": {"shape": [8192]}}, None, 4,
                  ("rows", 512, True), "flat"),
    # #45 / #64: logsumexp of a row of 4100 values without keepdim (a [N] output), then leaky_relu
    "lse_r4100": ([4100], [{"logsumexp": {"dim": 1}}, {"leaky_relu": {"negative_slope": 0.2}}], None, None, 5,
                  ("rows", 512, True), "flat"),
    # #38 in small: a view merging dims 2-4, the softmax over it and the view back (rewrites.softmax_through_reshape):
    # a slice of 90 values over three dims, a bias and a clamp before, a scale after, in one stage
    "sm_spanned": ([4, 3, 5, 6], [{"add": {"param": "b"}}, {"clamp": {"min": 0.0, "max": 1.0}}, {"reshape": {"shape": [4, 90]}},
                                  {"softmax": {"dim": 2}}, {"reshape": {"shape": [4, 3, 5, 6]}}, {"mul": {"scalar": 2.0}}],
                   {"b": {"shape": [4, 1, 1, 1]}}, None, 37, ("rows", 32, True), "flat"),
    # a row of 40000: 1024 threads, 40 values each (more than registers hold: read twice)
    "sm_r40000": ([40000], [{"softmax": {"dim": 1}}, {"mul": {"scalar": 3.0}}], None, None, 3, ("rows", 1024, False), "flat"),
    # a strided transposed convolution by ATen as sub-pixel phase tiles (pinned: PINNED_CHOICES), read in place,
    # its bias in the prologue
    "sm_phases": ([4, 3, 5, 6], [{"conv_transpose3d": {"out_channels": 10, "kernel_size": 4, "stride": 2, "padding": 1}},
                                 {"softmax": {"dim": 1}}, "sigmoid"],
                  None, {"conv": "aten", "conv_layout": "contiguous"}, 37, ("columns", 1, True), "phased"),
    # #91 in small: a softmax over the 128 channels of a channels_last ATen convolution output, through
    # shared-memory tiles of 64 positions, 4 threads per slice, float4 loads (8 lanes per position)
    "sm_cl_tiles": ([8, 6, 10], [{"conv2d": {"out_channels": 128, "kernel_size": 3, "padding": 1}}, {"softmax": {"dim": 1}},
                                 {"add": {"param": "b"}}, "sigmoid"], {"b": {"shape": [128, 1, 1]}}, CL_ATEN, 37,
                    ("tiles", 4, True), "channels_last"),
    # log_softmax over 24 channels: tiles of 256 positions, a thread per slice, 6 lanes per position's vectors
    "lsm_cl_tiles": ([3, 5, 7], [{"conv2d": {"out_channels": 24, "kernel_size": 3, "padding": 1}}, {"log_softmax": {"dim": 1}}],
                     None, CL_ATEN, 37, ("tiles", 1, True), "channels_last"),
    # a 3-d channels_last output, 10 channels (float2 loads, 5 lanes per position), a prologue before the softmax
    "sm_cl3d_tiles": ([4, 3, 5, 6], [{"conv3d": {"out_channels": 10, "kernel_size": 3, "padding": 1}}, {"mul": {"scalar": 2.0}},
                                     {"softmax": {"dim": 1}}], None, {"conv": "aten", "conv_layout": "channels_last"}, 37,
                      ("tiles", 1, True), "channels_last"),
    # a channels_last ATen convolution output, read in place
    "lse_cl": ([3, 6, 7], [{"conv2d": {"out_channels": 12, "kernel_size": 3, "padding": 1}}, {"logsumexp": {"dim": 1, "keepdim": True}}],
               None, CL_ATEN, 37, ("columns", 1, True), "channels_last"),
}


# Cases (of SOFTMAXES, LAYER_NORMS, NORM_LAYOUTS, TRANSPOSE_TILES) planned with choices pinned (decision point -> option) rather
# than by the cost model: the sub-pixel lowering of a transposed convolution, which the cost model takes or not as
# conv_work is refit; the norm family's kernels for groups the layer_norm family holds in registers.
PINNED_CHOICES = {"sm_phases": {"subpixel_conv_transpose @ ops[0].conv_transpose3d": "on"},
                  "ln_phases": {"subpixel_conv_transpose @ ops[0].conv_transpose3d": "on"},
                  "tile_phases_half": {"subpixel_conv_transpose @ ops[0].conv_transpose3d": "on",
                                       "defer_conv_bias @ ops[0].conv_transpose3d": "on"},
                  "norm_rows": {"pipeline": "kgen", "implementation @ ops[0].relu": "norm"}}


def pinned_selection(name: str, spec: Path):
    """The plans case ``name`` (written as ``spec``) is rendered and validated with: the cost model's,
    or the plan of its pinned choices (PINNED_CHOICES)."""
    from kgen.ir import load_pipeline
    from kgen.plan import Selection, Variant, choose_plans, make_plan

    pipe = load_pipeline(spec)
    if name not in PINNED_CHOICES:
        return choose_plans(pipe)
    why = "pinned by the test (conftest.PINNED_CHOICES)"
    plan = make_plan(pipe, choices=PINNED_CHOICES[name], reason=why)
    assert plan.choices == PINNED_CHOICES[name], plan.choices
    return Selection(pipe, [Variant(plan, why=why, dtype=pipe.dtype)], why, candidates=[plan])


def render_softmax(name: str, root: Path, module: str | None = None) -> tuple[Path, Path]:
    """SOFTMAXES[name] rendered (render_one_stage_case)."""
    return render_one_stage_case(SOFTMAXES, "softmax", ("form", "slice_threads", "cached"), name, root, module)


# Shapes (without the batch) whose dim-1 slices test_softmax.py and test_cuda.py fill with NaN and
# infinities: columns held in registers by 1 and by 4 lanes, read twice; rows held by a block, read twice.
NON_FINITE_SOFTMAX_SHAPES = {"c24": [24, 3, 4], "c128": [128, 3, 4], "c300": [300, 3, 4], "r1000": [1000], "r40000": [40000]}
NON_FINITE_SLICES = 8  # slices non_finite_slices fills (the batch gives at least these)


def non_finite_slices(shape) -> torch.Tensor:
    """Normal values of ``shape`` (batch first) whose slices along dim 1 (in order of the other dims)
    hold: a NaN; a +inf; -inf and +inf; -inf only; -inf in half and finite values; NaN and +inf; ties;
    values x 1e3 (exp overflows without the max subtracted); the rest normal."""
    x = torch.randn(shape)
    s = x.movedim(1, -1).reshape(-1, shape[1])  # a copy: slice k is row k
    length = shape[1]
    assert s.shape[0] >= NON_FINITE_SLICES, s.shape
    s[0, length // 3] = math.nan
    s[1, length - 1] = math.inf
    s[2, 0], s[2, length // 2] = -math.inf, math.inf
    s[3, :] = -math.inf
    s[4, : length // 2] = -math.inf
    s[5, 1], s[5, length - 2] = math.nan, math.inf
    s[6, :] = 0.75
    s[7, :] *= 1e3
    moved = list(shape[:1]) + list(shape[2:]) + [length]
    return s.reshape(moved).movedim(-1, 1).contiguous()


def render_non_finite_softmax(fn: str, shape_name: str, root: Path, module: str) -> tuple[Path, Path]:
    """``fn`` (softmax, log_softmax or logsumexp with keepdim) over dim 1 of NON_FINITE_SOFTMAX_SHAPES[shape_name],
    after x * 1 (exact; the op alone is also the aten family's candidate), rendered into root/gen."""
    from kgen.render import render_spec, write_rendered

    op = {fn: {"dim": 1, "keepdim": True}} if fn == "logsumexp" else {fn: {"dim": 1}}
    shape = NON_FINITE_SOFTMAX_SHAPES[shape_name]
    spec = write_spec(root, spec_text(shape, [{"mul": {"scalar": 1.0}}, op], name=module), f"{module}.yaml")
    write_rendered(render_spec(spec, root / "gen"), root / "gen")
    return spec, root / "gen" / module


def check_non_finite_softmax(fn: str, shape_name: str, stage, device: str) -> torch.Tensor:
    """The stage op of render_non_finite_softmax on non_finite_slices against PyTorch in float64 on the
    CPU: NaN and +-inf exactly where it has them, the finite values within fp32 rounding; returns the output."""
    shape = NON_FINITE_SOFTMAX_SHAPES[shape_name]
    torch.manual_seed(11)
    x = non_finite_slices([NON_FINITE_SLICES if len(shape) == 1 else 2] + shape)
    y = stage([x.to(device)], [], []).cpu()
    ref = torch.logsumexp(x.double(), 1, keepdim=True) if fn == "logsumexp" else getattr(torch, fn)(x.double(), 1)
    for what in (torch.isnan, torch.isposinf, torch.isneginf):
        got, want = what(y), what(ref)
        assert torch.equal(got, want), f"{what.__name__}: at {int((got & ~want).sum())} extra, {int((want & ~got).sum())} missing"
    finite = torch.isfinite(ref)
    torch.testing.assert_close(y.double()[finite], ref[finite], rtol=1e-5, atol=1e-6)
    return y


# conv_gemm in 16 bits (tests/test_conv_gemm_half.py, tests/test_ptxas.py): each form of the generated convolution with
# 16-bit loads and stores, name -> (spec text in bfloat16 and float16, the main loop, the epilogue: Store or
# Fused.{staged, elementwise, registers}); plan.conv: gemm, so that the generated convolution computes it at these small sizes.
def _conv16(name, shape, ops, batch=2, params=None):
    text = spec_text(shape, ops, params=params, batch=batch, name=name, plan={"conv": "gemm"})
    return text.replace("dtype: float32", "dtype:\n  - bfloat16\n  - float16")


CONV16 = {
    # window loop, a max pool and a channel sum on the staged tile (the conv's bias added there)
    "c16_window_pool": (_conv16("c16_window_pool", [8, 12, 20], [{"conv2d": {"out_channels": 16, "kernel_size": 3, "padding": 1}}, "relu",
                                               {"max_pool2d": {"kernel_size": 2}}, {"sum": {"dim": 1}}]), "window", "staged"),
    # W = 11: scalar loads (no 8-byte pieces); the convolution is the last op: the Store adds its own bias
    "c16_store_bias": (_conv16("c16_store_bias", [4, 9, 11], [{"conv2d": {"out_channels": 8, "kernel_size": 3}}]), "window", "store"),
    # stride 2: the generic loop; an elementwise epilogue
    "c16_generic": (_conv16("c16_generic", [8, 15, 16], [{"conv2d": {"out_channels": 16, "kernel_size": 3, "stride": 2}}, "tanh"]),
                    "generic", "elementwise"),
    # 3-d, everything reduced, no pool: the epilogue on the accumulators
    "c16_registers": (_conv16("c16_registers", [4, 5, 7, 16], [{"conv3d": {"out_channels": 8, "kernel_size": 3}}, {"mul": {"scalar": 0.5}},
                                              {"sum": {"dim": [1, 2, 3, 4]}}]), "window", "registers"),
    # 32 output channels, 8 input channels, 2-d: the wgmma loop (BoxRegs' 16-bit loads)
    "c16_wgmma": (_conv16("c16_wgmma", [8, 16, 16], [{"conv2d": {"out_channels": 32, "kernel_size": 3, "padding": 1}}, "sigmoid"]),
                  "wgmma", "elementwise"),
    # ... with W = 15: BoxRegs' scalar loads
    "c16_wgmma_odd": (_conv16("c16_wgmma_odd", [8, 16, 15], [{"conv2d": {"out_channels": 32, "kernel_size": 3, "padding": 1}}, "relu"]),
                      "wgmma", "elementwise"),
}


# conv_gemm's fused-pool kernels in 16 bits (tests/test_conv_gemm_half.py, tests/test_ptxas.py): name -> (spec text in
# bfloat16 and float16, the candidate the cost model takes, pool_ring's per_channel: a bool, or one per dtype). Each convolution keeps its bias
# (16-bit plans): the kernel adds it to the output rounded to the dtype.
POOL16 = {
    # phase_pool: 8 sub-pixel phases, max pools composed (2 then 2: a window of 2 strides), the channel sum
    "pp16": (_conv16("pp16", [8, 5, 9, 10], [{"conv_transpose3d": {"out_channels": 64, "kernel_size": 4, "stride": 2, "padding": 1}},
                                             {"max_pool3d": {"kernel_size": 2}}, {"max_pool3d": {"kernel_size": 2}},
                                             {"sum": {"dim": 1, "keepdim": True}}]), "conv_gemm:phase_pool", None),
    # pool_ring: a negative scale before the pool (rounded there), the per-channel mean, a bias, then the channel
    # sum: nothing amplifies the roundings, so in bfloat16 the mean and the sum are one sum (rewrites.reduction_algebra)
    # and the kernel reduces everything; in float16 the sum would not fit the dtype: a partial per channel, the
    # channel sum a stage of its own; 12 of 16 channels, odd D and H (a partial row block)
    "ring16_channels": (_conv16("ring16_channels", [8, 9, 21, 64],
                                [{"conv3d": {"out_channels": 12, "kernel_size": 3}}, {"div": {"scalar": -2.0}},
                                 {"max_pool3d": {"kernel_size": 2}}, {"adaptive_avg_pool3d": {"output_size": [1, 1, 1]}},
                                 {"add": {"param": "b"}}, {"sum": {"dim": 1}}], params={"b": {"shape": [12, 1, 1, 1], "init": "randn"}}),
                        "conv_gemm:pool_ring", {"bfloat16": False, "float16": True}),
    # ... without the channel sum: a partial per channel, the per-channel means and the bias the model's output
    "ring16_per_channel": (_conv16("ring16_per_channel", [8, 9, 21, 64],
                                   [{"conv3d": {"out_channels": 12, "kernel_size": 3}}, {"div": {"scalar": -2.0}},
                                    {"max_pool3d": {"kernel_size": 2}}, {"adaptive_avg_pool3d": {"output_size": [1, 1, 1]}},
                                    {"add": {"param": "b"}}], params={"b": {"shape": [12, 1, 1, 1], "init": "randn"}}),
                           "conv_gemm:pool_ring", True),
    # pool_ring, everything reduced: tanh before the pool, rows of 60 positions
    "ring16_all": (_conv16("ring16_all", [8, 6, 13, 60], [{"conv3d": {"out_channels": 16, "kernel_size": 3}}, "tanh",
                                                          {"max_pool3d": {"kernel_size": 2}}, {"sum": {"dim": [1, 2, 3, 4]}}]),
                   "conv_gemm:pool_ring", False),
}


# Mamba2's two sites (KernelBench level 3, 48): the exponential of one value, transposed, multiplies a matmul's
# result (p); a chain after a matmul (its named value read inside the chain, an operand of the same rank) then a
# transpose and a sum with a third value (q)
PERMUTE_CHAIN_SPEC = """
name: permute_chain
inputs:
  x: {shape: [N, 3, 4, 5]}
  s: {shape: [N, 4, 3, 5]}
  y: {shape: [N, 3, 5, 5]}
  w: {shape: [N, 3, 4, 1]}
  z: {shape: [N, 4, 3, 5]}
example: {N: 2}
ops:
  - exp: {from: s, as: e}
  - matmul: {from: x, tensor: y, as: m}
  - transpose: {dim0: 1, dim1: 2, from: e, as: et}
  - div: {tensor: et, from: m, as: p}
  - matmul: {from: x, tensor: y}
  - relu: {as: r}
  - mul: {tensor: w}
  - sub: {tensor: r}
  - transpose: {dim0: 1, dim1: 2}
  - add: {tensor: z, as: q}
outputs: [p, q]
"""


# Elementwise stages over views whose innermost values stay adjacent (pool_reduce's vector map kernel reads them
# 16 bytes at a time: buffer.element_vectors): a permute of outer dims, a slice of rows (its first row 48 bytes in
# for float32, aligned to the vector; 24 for bfloat16, so the value-by-value kernel at run time), a slice of each
# row's values (one value in: aligned to no vector; its row stride of 12 leaves no whole bfloat16 vectors at all),
# an expand along the last dim (each vector one value repeated: one load, the store a vector)
VIEW_VECTORS_SPEC = """
name: view_vectors
inputs:
  x: {shape: [N, 3, 4, 8], dtype: [float32, bfloat16]}
  y: {shape: [N, 4, 3, 8], dtype: [float32, bfloat16]}
  z: {shape: [N, 3, 6, 12], dtype: [float32, bfloat16]}
  w: {shape: [N, 3, 4, 1], dtype: [float32, bfloat16]}
example: {N: 2}
ops:
  - permute: {dims: [0, 2, 1, 3]}
  - exp: {}
  - mul: {tensor: y, as: p}
  - slice: {dim: 2, start: 1, end: 5, from: z}
  - sigmoid: {as: rows}
  - slice: {dim: 3, start: 1, end: 9, from: z}
  - neg: {as: shifted}
  - expand: {shape: [3, 4, 8], from: w}
  - mul: {tensor: x, as: spread}
outputs: [p, rows, shifted, spread]
"""


# NetVLAD's (KernelBench level 3, 46): a broadcast product computed first, read by a sub after a matmul and its
# transpose (kgen.rewrites.commute_operand_chain moves its chain to the sub)
NETVLAD_SPEC = """
name: netvlad
inputs:
  x: {shape: [N, 6, 4]}
  y: {shape: [N, 6, 5]}
example: {N: 2}
params:
  c: {shape: [1, 5, 4], init: randn}
ops:
  - sum: {dim: 1, keepdim: true}
  - expand: {shape: [5, 4]}
  - mul: {param: c, as: m}
  - transpose: {dim0: 1, dim1: 2, from: x}
  - matmul: {tensor: y}
  - transpose: {dim0: 1, dim1: 2}
  - sub: {tensor: m}
  - relu
"""
