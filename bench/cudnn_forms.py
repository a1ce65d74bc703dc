"""Whether cuDNN's channels_last call reproduces eager's NCHW call of a float32 convolution (TF32 allowed, PyTorch's
default) on this GPU: per shape, eager's call against (a) the channels_last call on operands rounded to TF32 ties
away from zero first (ConvStage.eager_rounding), (b) the NCHW call on those rounded operands with TF32 off (exact
products, fp32 sums), (c) the channels_last call on the raw operands, (d) the NCHW call with TF32 off. Each
column: max |difference| over max |eager|, and KernelBench's check (allclose, atol = rtol = 1e-4) after a
training-mode batch norm of both (a norm turns a TF32 difference into one above the tolerance). Then the kernel(s)
eager's call launches and the time of eager's call against (a). On a GPU machine:

    python3 bench/cudnn_forms.py
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

# name, batch, in channels, size, out channels, kernel, stride, padding: KernelBench level 3's ResNet basic block
# (#8) and ResNet-18's (#9) convolutions, and level 2 #17's
SHAPES = [
    ("basic block conv1 3->64 k3", 10, 3, 224, 64, 3, 1, 1),
    ("basic block conv2 64->64 k3", 10, 64, 224, 64, 3, 1, 1),
    ("basic block downsample 3->64 k1", 10, 3, 224, 64, 1, 1, 0),
    ("resnet18 conv1 3->64 k7 s2", 2, 3, 224, 64, 7, 2, 3),
    ("resnet18 64->64 k3 @56", 2, 64, 56, 64, 3, 1, 1),
    ("resnet18 64->128 k3 s2", 2, 64, 56, 128, 3, 2, 1),
    ("resnet18 128->128 k3 @28", 2, 128, 28, 128, 3, 1, 1),
    ("resnet18 64->128 k1 s2", 2, 64, 56, 128, 1, 2, 0),
    ("resnet18 256->256 k3 @14", 2, 256, 14, 256, 3, 1, 1),
    ("resnet18 512->512 k3 @7", 2, 512, 7, 512, 3, 1, 1),
    ("level 2 #17 3->16 k3", 128, 3, 256, 16, 3, 1, 0),
]
CHECK = 1e-4  # KernelBench's atol = rtol
CALLS = 20


def rounded_away(t: torch.Tensor) -> torch.Tensor:
    """float32 to TF32 (10 mantissa bits), ties away from zero, as cvt.rna (finite values)."""
    i = t.contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).reshape(t.shape)


def conv(x, w, stride, padding, tf32: bool, channels_last: bool) -> torch.Tensor:
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        if channels_last:
            x, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, w))
        return F.conv2d(x, w, None, stride, padding).contiguous()
    finally:
        torch.backends.cudnn.allow_tf32 = True


def kernels(fn) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " | ".join(e.key[:90] for e in prof.key_averages() if e.self_device_time_total > 0)


def ms(fn) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("cudnn_forms.py: needs a CUDA GPU (it measures cuDNN's calls)")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    bn = lambda y: F.batch_norm(y, None, None, training=True, eps=1e-5)  # noqa: E731
    for name, n, cin, size, cout, k, s, p in SHAPES:
        x = torch.randn(n, cin, size, size, device="cuda")
        w = torch.randn(cout, cin, k, k, device="cuda") / (cin * k * k) ** 0.5
        eager = conv(x, w, s, p, True, False)
        scale, normed = eager.abs().max().item(), bn(eager)
        forms = {"rounded channels_last": conv(rounded_away(x), rounded_away(w), s, p, True, True),
                 "rounded, exact products": conv(rounded_away(x), rounded_away(w), s, p, False, False),
                 "channels_last": conv(x, w, s, p, True, True),
                 "fp32": conv(x, w, s, p, False, False)}
        cols = [f"{form} {(y - eager).abs().max().item() / scale:.1e} "
                f"{'pass' if torch.allclose(bn(y), normed, atol=CHECK, rtol=CHECK) else 'FAIL'}" for form, y in forms.items()]
        print(f"{name}: " + ", ".join(cols))
        xr, wr = (rounded_away(t).contiguous(memory_format=torch.channels_last) for t in (x, w))
        print(f"    eager's kernels: {kernels(lambda: F.conv2d(x, w, None, s, p))}")
        print(f"    ms: eager {ms(lambda: F.conv2d(x, w, None, s, p)):.4f}, "
              f"rounded channels_last {ms(lambda: F.conv2d(xr, wr, None, s, p)):.4f}")


if __name__ == "__main__":
    main()
