"""What the folded convolution of rewrites.batch_stats_pass must compute to match eager within KernelBench's
1e-4 (CPU, float64; the TF32 roundings emulated on the bits).

KernelBench #72 in training mode: y = conv_transpose3d(x, w) in TF32 (eager's cuDNN call rounds both operands
ties to even: cudnn_rounding.py), then batch norm with the batch's statistics, then two 2^3 average pools.
batch_stats_pass takes the statistics from the TF32 convolution (as eager's) and the pooled values from the
convolution folded with the 4^3 pool. The statistics divide by the spread of y, so the pooled values must be
eager's to far better than TF32's rounding. Variants of the folded convolution against eager, in units of
KernelBench's tolerance (atol + rtol * |eager|; above 1 fails):

    exact float64 pipeline (no TF32)                          ~1.8
    x in fp32, folded weights in fp32                         ~4.3
    x rounded, TF32 of the folded (unrounded) weights         ~4.1
    x rounded, TF32 of weights folded from rounded ones       ~1.0
    x in fp32, weights folded from rounded ones               ~1.7
    x rounded, weights folded from rounded ones, fp32 kept    ~0   (what conv_gemm's eager_products computes)

so the folded convolution multiplies x rounded ties to even by the weights folded from their TF32 values
and kept in fp32 (split TF32 with the input's lo part zero): eager's products in another order.

    PYTHONPATH=. python scripts/tf32_lab/folded_batch_stats.py [batch]
"""
import sys

import torch
import torch.nn.functional as F

from kgen.ir import Conv
from kgen.lowering import Folded, LoweredConv


def tf32_even(t: torch.Tensor) -> torch.Tensor:
    """float32 -> TF32 (10 mantissa bits), ties to even, as cvt.rn.tf32.f32; returned in float64."""
    b = t.float().contiguous().view(torch.int32).to(torch.int64)
    low, lsb = b & 0x1FFF, (b >> 13) & 1
    up = (low > 0x1000) | ((low == 0x1000) & (lsb == 1))
    return ((b & ~0x1FFF) + up.to(torch.int64) * 0x2000).to(torch.int32).view(torch.float32).double()


def main(batch: int = 4):
    torch.manual_seed(0)
    m = torch.nn.ConvTranspose3d(3, 16, 3, stride=2, padding=1)
    x = torch.rand(batch, 3, 32, 32, 32)  # KernelBench's inputs
    w, b = m.weight.detach(), m.bias.detach().double()
    conv = Conv(key="c", kind="conv_transpose3d", in_channels=3, out_channels=16, kernel=(3, 3, 3), stride=(2, 2, 2),
                padding=(1, 1, 1), output_padding=(0, 0, 0))
    fold = Folded(pool_kernel=(4, 4, 4), pool_stride=(4, 4, 4))
    lc = LoweredConv(key="c", conv=conv, lowering=fold)

    def statistics(xx, ww):
        y = F.conv_transpose3d(xx, ww, b, stride=2, padding=1)
        var, mean = torch.var_mean(y, dim=[0, 2, 3, 4], correction=0)
        return y, mean.view(1, -1, 1, 1, 1), (1 / torch.sqrt(var + 1e-5)).view(1, -1, 1, 1, 1)

    def pipeline(xx, ww):
        y, mean, scale = statistics(xx, ww)
        return F.avg_pool3d(F.avg_pool3d((y - mean) * scale, 2), 2)

    eager = pipeline(tf32_even(x), tf32_even(w))
    _, mean, scale = statistics(tf32_even(x), tf32_even(w))  # batch_stats_pass's: the TF32 convolution's

    def folded(xx, wf):
        p = F.conv3d(xx, wf, b, stride=lc.stride, padding=lc.padding)[:, :, :15, :15, :15]
        return (p - mean) * scale

    def fold_of(ww):
        return fold.weight(conv, ww.float()).double()

    def report(name, out):
        d = (out - eager).abs()
        print(f"{name:56s} max |diff| {d.max():.2e}, / tolerance {(d / (1e-4 + 1e-4 * eager.abs())).max():.2f}")

    report("exact float64 pipeline (no TF32)", pipeline(x.double(), w.double()))
    report("x in fp32, folded weights in fp32", folded(x.double(), fold_of(w)))
    report("x rounded, TF32 of the folded (unrounded) weights", folded(tf32_even(x), tf32_even(fold_of(w))))
    report("x rounded, TF32 of weights folded from rounded ones", folded(tf32_even(x), tf32_even(fold_of(tf32_even(w)))))
    report("x in fp32, weights folded from rounded ones", folded(x.double(), fold_of(tf32_even(w))))
    report("x rounded, weights folded from rounded ones, fp32 kept", folded(tf32_even(x), fold_of(tf32_even(w))))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
