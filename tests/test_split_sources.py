"""A whole model's sources are rendered in parts that compile in parallel (kgen.render.SPLIT_FILES): kernel.cu and
kernel_cpu.cpp as runs of stages, binding.cpp with each run's calls of forward in a function of its own
(forward_partN) and the op in the first part. Split modules compute what the whole ones compute, bit for bit, in
both modes (the running statistics too), and validate; a render with fewer parts removes the others."""
import shutil

import pytest
import torch

from conftest import assert_report_passed, write_spec
from kgen import render
from kgen.build import Toolchain, _ninja_file, build_modules, compiled_sources, cuda_home, ptxas_report
from kgen.render import part_file, render_spec, split_stages, stale_files, write_rendered
from kgen.validate import import_module_dir, validate

# every kind of value forward passes between stages: a training-mode batch norm (the running statistics copied before
# the first, read by the second), a cat whose operand g is written in place (the cat's output allocated before the
# stages), parameters derived in eval mode, values read several stages later (x), two plans (training and eval mode)
SPEC = """
name: {name}
input: {{shape: [N, 4, 6, 6], example: {{N: 2}}}}
ops:
  - batch_norm: {{name: bn0}}
  - relu
  - conv2d: {{out_channels: 3, kernel_size: 3, padding: 1, name: conv0}}
  - sigmoid: {{as: g}}
  - cat: {{tensors: [g], dim: 1, from: x}}
  - batch_norm: {{name: bn1}}
  - relu
  - conv2d: {{out_channels: 4, kernel_size: 1, name: conv1}}
  - add: {{tensor: x}}
  - max_pool2d: {{kernel_size: 2}}
  - tanh
  - softmax: {{dim: 1}}
"""
COUNTS = (2, 3, 5)  # parts per file: the stages cut at different places
PARTS = 3  # the one whose files the other tests read


def test_split_stages_are_consecutive_runs_of_about_equal_weight():
    weights = [((0, i), w) for i, w in enumerate([5, 1, 1, 1, 1, 1, 10, 1, 1, 1])] + [((1, 0), 2), ((1, 1), 2)]
    parts = split_stages(weights, 4)
    assert len(parts) == 4 and all(parts)
    assert [k for p in parts for k in sorted(p)] == [k for k, _ in weights]  # in order, each stage once
    assert max(sum(dict(weights)[k] for k in p) for p in parts) <= 12  # the 10 alone or nearly
    assert split_stages(weights[:2], 5) == [frozenset({(0, 0)}), frozenset({(0, 1)})]  # no part without a stage
    assert split_stages(weights, 1) == [frozenset(k for k, _ in weights)]


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """SPEC rendered whole and split into each of COUNTS parts per file, all built for the CPU:
    (whole spec, whole module, {parts: (spec, module)})."""
    tmp = tmp_path_factory.mktemp("split")
    out = tmp / "gen"
    whole = write_spec(tmp, SPEC.format(name="split_whole"), "split_whole.yaml")
    write_rendered(render_spec(whole, out), out)
    split = {}
    for count in COUNTS:
        spec = write_spec(tmp, SPEC.format(name=f"split_part{count}"), f"split_part{count}.yaml")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(render, "PART_LINES", 1)
            m.setattr(render, "MAX_PARTS", count)
            write_rendered(render_spec(spec, out), out)
        split[count] = spec, out / f"split_part{count}"
    build_modules([out / "split_whole"] + [d for _, d in split.values()], "cpu")
    return whole, out / "split_whole", split


def test_every_split_file_has_its_parts(modules):
    _, whole, split = modules
    assert "kgen::channel_slice(" in (whole / "binding.cpp").read_text()  # g is written into the cat's output
    d = split[PARTS]
    d = d[1]
    for f in render.SPLIT_FILES:
        assert [p.name for p in render.part_files(whole, f)] == [f]
        assert [p.name for p in render.part_files(d, f)] == [part_file(f, k) for k in range(1, PARTS + 1)]
    first, second = (d / "binding.cpp").read_text(), (d / "binding_2.cpp").read_text()
    assert "TORCH_LIBRARY_FRAGMENT" in first and "TORCH_LIBRARY" not in second  # the op and its registration once
    assert "void forward_part2(" in second and "forward_part2(t, running, derived, scope," in first
    assert "// Part 2 of 3: stage" in second
    # the CPU build compiled each part (the names kgen build gives them), the CUDA build would compile each kernel part
    assert list((d / "_build").glob("cpu-*/binding_3.o")), "binding_3.cpp was not compiled"
    ninja = _ninja_file(d, Toolchain("cuda", "c++", "nvcc", [], [], []), "lib.so")
    for k in range(2, PARTS + 1):
        assert f"build kernel_{k}.cuda.o: nvcc {d / f'kernel_{k}.cu'}" in ninja
    assert [s for s, _ in compiled_sources(d, "cuda")].count("kernel.cu") == PARTS


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("training", [True, False])
def test_a_split_module_computes_what_the_whole_one_does(modules, count, training):
    _, whole, split = modules
    torch.manual_seed(0)
    a, b = import_module_dir(whole).Model(), import_module_dir(split[count][1]).Model()
    b.load_state_dict(a.state_dict())
    a.train(training), b.train(training)
    for x in (torch.randn(3, 4, 6, 6), torch.randn(1, 4, 6, 6) * 100):
        torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)
    for (n, s), (m, t) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n == m
        torch.testing.assert_close(t, s, rtol=0, atol=0)  # the running statistics updated alike (training mode)


def test_a_split_module_validates(modules):
    spec, d = modules[2][PARTS]
    assert_report_passed(validate(spec, d, "cpu"))  # the stage ops of every part too (registered by the first)


def test_rendering_with_fewer_parts_removes_the_others(modules):
    spec, d = modules[2][PARTS]
    out = d.parent
    whole = render_spec(spec, out)
    stale = stale_files(whole, out)
    assert {f"{d.name}/{part_file(f, k)}" for f in render.SPLIT_FILES for k in range(2, PARTS + 1)} <= set(stale)
    written = write_rendered(whole, out)
    assert f"{d.name}/kernel_2.cu" in written
    for f in render.SPLIT_FILES:
        assert [p.name for p in render.part_files(d, f)] == [f]
    assert stale_files(whole, out) == []


def test_a_stage_and_its_epilogue_stay_in_one_part():
    """forward calls a stage and the stage it runs as its epilogue (or whose statistics it gathers) as one: the
    split keeps them together."""
    weights = [((0, i), 1) for i in range(6)]
    for count in range(1, 7):
        parts = split_stages(weights, count, joined=frozenset({(0, 3), (0, 5)}))
        assert all(((0, 2) in p) == ((0, 3) in p) and ((0, 4) in p) == ((0, 5) in p) for p in parts)
        assert len(parts) == min(count, 4)


@pytest.mark.skipif(cuda_home() is None and shutil.which("nvcc") is None, reason="needs nvcc")
def test_each_kernel_part_compiles_on_its_own_with_nvcc(modules):
    """nvcc compiles each part of kernel.cu alone (its stages' launches declared in stages.h), and the parts hold
    the whole file's kernels (ptxas' report of each: no GPU needed)."""
    _, whole, split = modules
    d = split[PARTS][1]
    # (split_whole, split_partN: names of one length, so the mangled kernel names differ in the name alone)
    names = lambda m: sorted(k.name.replace(m.name, "NAME") for k in ptxas_report(m))  # noqa: E731
    assert names(d) == names(whole)
