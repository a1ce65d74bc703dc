"""Autograd of the generated ops: the backward registered by kgen.runtime recomputes
the spec's ops as written (no rewrites) through PyTorch and takes their vjp.

What proves it correct:
- the formula (``pipeline_vjp`` over the spec's ops) agrees with finite
  differences in float64, for every shipped spec (at small spatial sizes: the
  ops' shapes are fixed in the built modules) and for every op kind;
- the real op's registered backward gives every input a gradient equal to
  eager PyTorch's on the independent hand-written models (float32, CPU; the
  GPU in the `cuda` tests); with validation (the forward equals the same
  function) the op's backward is the derivative of its forward;
- the same through torch.compile (a training step) and DDP.
"""
import ast
import inspect
import copy
import os
import subprocess
import sys

import pytest
import torch

from conftest import HAS_CUDA, ROOT, SHIPPED
from handwritten import MODELS
from kgen.errors import SpecError
from kgen.runtime import _call_below_autograd
from kgen.ir import build_pipeline, load_pipeline
from kgen.runtime import pipeline_vjp
from kgen.spec import load_spec, parse_spec, spec_from_data, spec_to_data

SPEC = {n: ROOT / "specs" / f"{n}.yaml" for n in SHIPPED}
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])
DEVICES = ["cpu", CUDA]


class _Recompute(torch.autograd.Function):
    """forward: the pipeline in the inputs' dtype; backward: the registered formula."""

    @staticmethod
    def forward(ctx, pipe, names, x, *params):
        ctx.pipe, ctx.names = pipe, names
        ctx.save_for_backward(x, *params)
        return pipe.run(x, dict(zip(names, params)))

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        return (None, None) + pipeline_vjp(ctx.pipe, ctx.names, x, params, grad, ctx.needs_input_grad[2:])


def _small(data: dict):
    """The pipeline of spec ``data`` with the smallest equal spatial size that still builds."""
    shape = data["input"]["shape"]
    for size in range(1, 17):
        data["input"]["shape"] = shape[:2] + [size] * (len(shape) - 2)
        try:
            return build_pipeline(spec_from_data(data, "small"))
        except SpecError:
            continue
    raise AssertionError("no small size builds")


def _gradcheck(pipe, seed=0, batch=2, double_backward=False):
    names = [a.name for a in pipe.tensor_args()]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pipe.input.concrete(batch), generator=g, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(a.shape, generator=g, dtype=torch.float64, requires_grad=True) for a in pipe.tensor_args()]
    fn = lambda x, *p: _Recompute.apply(pipe, names, x, *p)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, *params), fast_mode=True, rtol=1e-5, atol=1e-7)
    if double_backward:
        assert torch.autograd.gradgradcheck(fn, (x, *params), fast_mode=True, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", SHIPPED)
def test_backward_formula_matches_finite_differences(name):
    _gradcheck(_small(spec_to_data(load_spec(SPEC[name]))))


OP_KINDS = {  # kind -> (input shape, params, ops): every op kind, at small sizes
    "conv": ("[N, 3, 7, 6]", "", ["conv2d: {out_channels: 4, kernel_size: [3, 2], stride: 2, padding: 1, dilation: [1, 2]}"]),
    "conv1d_groups": ("[N, 4, 9]", "", ["conv1d: {out_channels: 6, kernel_size: 3, groups: 2, bias: false}"]),
    "conv_transpose": ("[N, 3, 4, 3, 3]", "",
                       ["conv_transpose3d: {out_channels: 2, kernel_size: 3, stride: 2, padding: 1, output_padding: 1}"]),
    "max_pool": ("[N, 2, 9, 8]", "", ["max_pool2d: {kernel_size: 3, stride: 2, padding: 1, ceil_mode: true}"]),
    "avg_pool": ("[N, 2, 7, 8]", "",
                 ["avg_pool2d: {kernel_size: 3, stride: 2, padding: 1, ceil_mode: true, count_include_pad: false}"]),
    "adaptive": ("[N, 2, 3, 4, 5]", "", ["adaptive_avg_pool3d: {output_size: 1}"]),
    "elementwise": ("[N, 3, 5, 4]", "p: {shape: [3, 1, 1]}", [
        "relu", "sigmoid", "clamp: {min: 0.55, max: 0.7}", "add: {scalar: 1.5}", "sub: {param: p}", "mul: {param: p}",
        "div: {scalar: -3.0}"]),
    "reductions": ("[N, 3, 5, 4]", "", ["mean: {dim: [2], keepdim: true}", "max: {dim: 1, keepdim: true}", "sum: {dim: [-1]}"]),
    "group_norm": ("[N, 6, 4, 3]", "p: {shape: [6, 1, 1]}", ["group_norm: {num_groups: 3}", "div: {param: p}"]),
    "instance_norm": ("[N, 3, 5, 4]", "", ["instance_norm: {affine: true, eps: 0.001}", "sum: {dim: [1, 2, 3]}"]),
}


@pytest.mark.parametrize("kind", sorted(OP_KINDS))
def test_backward_formula_of_every_op_kind(kind):
    shape, params, ops = OP_KINDS[kind]
    text = f"name: t\ninput: {{shape: {shape}}}\nparams: {{{params}}}\nops:\n" + "".join(f"  - {op}\n" for op in ops)
    _gradcheck(build_pipeline(parse_spec(text)), double_backward=kind == "group_norm")


@pytest.mark.parametrize("name", SHIPPED)
def test_module_embeds_its_spec_as_data(name, modules):
    module, spec = modules[name], load_spec(SPEC[name])
    assert spec_from_data(module.SPEC_DATA, "embedded") == spec_from_data(spec_to_data(spec), "embedded")
    assert build_pipeline(spec_from_data(module.SPEC_DATA, "x")).ops == load_pipeline(SPEC[name]).ops
    assert spec.description and spec.description not in (ROOT / "generated" / name / "__init__.py").read_text()


def test_variant_modules_embed_a_loadable_spec(tmp_path):
    """The no-rewrite variant (module NAME_norewrite, used by validate --baseline and bench)."""
    from kgen.variants import baseline_module

    module_dir = baseline_module(SPEC["div_max_gap_bias_sum"], root=tmp_path, build=False)
    tree = ast.parse((module_dir / "__init__.py").read_text())
    data = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SPEC_DATA")
    assert build_pipeline(spec_from_data(data, "x")).ops == load_pipeline(SPEC["div_max_gap_bias_sum"]).ops


def _grads(model, x, weight):
    (model(x) * weight).sum().backward()  # a linear loss: the upstream gradient is `weight` exactly
    return [x.grad] + [p.grad for _, p in model.named_parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SHIPPED)
def test_op_backward_equals_eager(name, device, modules):
    torch.manual_seed(0)
    ours = modules[name].Model().to(device)
    hand = MODELS[name]().to(device)
    hand.load_state_dict(ours.state_dict())
    pipe = load_pipeline(SPEC[name])
    x = torch.randn(pipe.input.concrete(1), device=device)
    weight = torch.randn(pipe.output.concrete(1), device=device)
    # deterministic: cuDNN's transposed-convolution (backward-data) algorithms may add with atomics, and two runs
    # that differ in the last bit flip ReLU's mask where the convolution's output is ~0 (a gradient of 0 or not)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False, deterministic=True):
        got = _grads(ours, x.clone().requires_grad_(True), weight)
        expected = _grads(hand, x.clone().requires_grad_(True), weight)
    names = ["x"] + [k for k, _ in ours.named_parameters()]
    assert [k for k, _ in hand.named_parameters()] == names[1:]
    for k, g, e in zip(names, got, expected):
        assert g is not None, f"{k} got no gradient"
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * float(e.abs().max()), msg=lambda m, k=k: f"{k}: {m}")


def test_only_requested_gradients(modules):
    m = modules["div_max_gap_bias_sum"]
    model = m.Model()
    x = torch.randn(load_pipeline(SPEC["div_max_gap_bias_sum"]).input.concrete(1))
    model.conv.weight.requires_grad_(False)
    model(x).sum().backward()  # x needs no gradient, the weight is frozen
    assert model.conv.weight.grad is None and model.conv.bias.grad is not None and model.bias.grad is not None
    x.requires_grad_(True)
    with torch.no_grad():
        assert model(x).grad_fn is None


@pytest.mark.parametrize("name", ["instnorm_clamp_max", "relu_group_norm"])
def test_calls_without_grad_mode_skip_autograd_and_match(name, modules):
    """Without grad mode the module's forward calls the op below the autograd key (no Python autograd
    kernel per call): the same bits as with grad mode, no graph; with grad mode a graph to the inputs."""
    m = modules[name]
    torch.manual_seed(0)
    model = m.Model()
    x = torch.randn(load_pipeline(SPEC[name]).input.concrete(2))
    graded = model(x)
    assert graded.grad_fn is not None  # the parameters require gradients
    with torch.no_grad():
        plain = model(x)
    with torch.inference_mode():
        inference = model(x)
    assert plain.grad_fn is None and torch.equal(plain, graded.detach()) and torch.equal(inference, plain)
    source = (ROOT / "generated" / name / "__init__.py").read_text()
    assert "return _REPLAY(_OP, " in source and "torch.compiler.is_compiling()" in source
    assert "torch._C._AutoDispatchBelowAutograd()" in inspect.getsource(_call_below_autograd)


def _training_step(model, x, weight, opt):
    opt.zero_grad()
    loss = (model(x) * weight).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _compiled_step_matches_eager(module, name, device, backend):
    torch.manual_seed(0)
    model = module.Model().to(device)
    eager = copy.deepcopy(model)
    pipe = load_pipeline(SPEC[name])
    x = torch.randn(pipe.input.concrete(2), device=device)
    weight = torch.randn(pipe.output.concrete(2), device=device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # forward + its backward graph
    opt, opt_eager = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(eager.parameters(), lr=0.01)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False, deterministic=True):  # see test_op_backward_equals_eager
        for _ in range(2):
            loss = _training_step(compiled, x, weight, opt)
            loss_eager = _training_step(eager, x, weight, opt_eager)
            torch.testing.assert_close(loss, loss_eager, rtol=1e-4, atol=1e-6)
    # a gradient that is zero in exact arithmetic (a bias before a norm without affine) is rounding
    # noise in both: judge every gradient against the model's largest one
    scale = max(float(q.grad.abs().max()) for q in eager.parameters())
    for (k, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5 * scale, msg=k)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


def test_torch_compile_training_step_cpu(modules):
    """AOTAutograd traces the registered backward (aot_eager: no inductor compile on the CPU)."""
    _compiled_step_matches_eager(modules["instnorm_clamp_max"], "instnorm_clamp_max", "cpu", "aot_eager")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", SHIPPED)
def test_torch_compile_training_step_cuda(name, modules):
    _compiled_step_matches_eager(modules[name], name, "cuda", "inductor")


def _ddp(backend, names, tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_step.py"), backend, str(tmp_path), *names],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in names:
        rank0, rank1 = (torch.load(tmp_path / f"{name}-{r}.pt") for r in (0, 1))
        assert rank0["grads"].keys() == rank0["eager_grads"].keys()
        # judged against the model's largest gradient: one that is zero in exact arithmetic
        # (a bias before a norm without affine) is rounding noise in both
        scale = max(float(e.abs().max()) for e in rank0["eager_grads"].values())
        for k, e in rank0["eager_grads"].items():
            for rank in (rank0, rank1):
                # (rtol as for torch.compile's step: kgen's backward recomputes the spec's ops, whose
                # reductions may round in another order than the hand-written model's)
                torch.testing.assert_close(rank["grads"][k], e, rtol=1e-3, atol=1e-5 * scale,
                                           msg=lambda m, k=k: f"{name}: {k}: {m}")
            assert torch.equal(rank0["params"][k], rank1["params"][k]), k  # the ranks stay in step


def test_ddp_training_step_gloo_cpu(built, tmp_path):
    _ddp("gloo", ["div_max_gap_bias_sum"], tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_training_step_nccl_two_gpus(built, tmp_path):
    _ddp("nccl", SHIPPED, tmp_path)
