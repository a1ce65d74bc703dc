"""Which TF32 rounding do cuDNN's kernels apply to their operands? Each call's result (TF32 allowed, as
eager PyTorch) against float64 convolutions of the operands unrounded and rounded three ways: truncation,
ties away from zero (cvt.rna), ties to even (cvt.rn). The closest is the kernel's rounding: the others
are TF32's error apart, that one only the order of the fp32 sums (~1e-6).

H100, torch 2.11 (stop 39): the NC[D]HW forward TF32 kernels (KernelBench #52's and #17's 64 -> 128
channels) round ties away from zero, the channels_last ones ties to even; every transposed convolution
(3 -> 16 and 16 -> 32 with stride 2, 64 -> 128 with stride 1 and its flipped forward form), in either
layout, ties to even; #73's NCHW 8 -> 64 call is plain fp32. Used by conv_gemm (tf32_half_even) and
conv_aten (eager_rounding_only).

    python scripts/tf32_lab/cudnn_rounding.py
"""
import torch
import torch.nn.functional as F

def tf32(t, how):
    b = t.contiguous().view(torch.int32)
    if how == "trunc":
        r = b & ~0x1FFF
    elif how == "rna":
        r = (b + 0x1000) & ~0x1FFF
    else:  # rne
        r = (b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF
    return r.view(torch.float32).view_as(t)

def run(name, fn, x, w, layouts):
    refs = {}
    for how in ("none", "trunc", "rna", "rne"):
        xr, wr = (x, w) if how == "none" else (tf32(x, how), tf32(w, how))
        refs[how] = fn(xr.double(), wr.double())
    scale = refs["none"].abs().max().item()
    for lay, (xx, ww) in layouts.items():
        y = fn(xx, ww).double()
        errs = {h: (y - r).abs().max().item() / scale for h, r in refs.items()}
        best = min(errs, key=errs.get)
        print(f"{name:32s} {lay:14s} " + " ".join(f"{h} {e:.1e}" for h, e in errs.items()) + f"  -> {best}", flush=True)
    del refs

torch.manual_seed(0)
dev = "cuda"
cl2, cl3 = torch.channels_last, torch.channels_last_3d
for name, xs, cin, cout, k, d, tr, s, p in [
    ("#52 conv2d 64->128 k3", (64, 64, 128, 128), 64, 128, 3, 2, False, 1, 0),
    ("#17 conv2d 64->128 k3 N128", (128, 64, 128, 128), 64, 128, 3, 2, False, 1, 0),
    ("#73 conv2d 8->64 k3", (128, 8, 128, 128), 8, 64, 3, 2, False, 1, 0),
    ("#15 convT3d 16->32 k3 s2 p1", (16, 16, 16, 32, 32), 16, 32, 3, 3, True, 2, 1),
    ("#72 convT3d 3->16 k3 s2 p1", (64, 3, 32, 32, 32), 3, 16, 3, 3, True, 2, 1),
    ("rgn convT3d 64->128 k3", (16, 64, 32, 32, 32), 64, 128, 3, 3, True, 1, 0),
]:
    x = torch.randn(xs, device=dev)
    wshape = (cin, cout) + (k,) * d if tr else (cout, cin) + (k,) * d
    w = (torch.rand(wshape, device=dev) * 2 - 1) / (cin * k ** d) ** 0.5
    if tr:
        fn = (lambda a, b, s=s, p=p: F.conv_transpose3d(a, b, stride=s, padding=p))
    else:
        fn = (lambda a, b: F.conv2d(a, b))
    cl = cl3 if d == 3 else cl2
    lay = {"contiguous": (x, w), "channels_last": (x.to(memory_format=cl), w.to(memory_format=cl))}
    if tr and s == 1:  # the flipped-kernel forward conv (kgen's sub-pixel lowering at stride 1)
        wf = w.flip(2, 3, 4).transpose(0, 1).contiguous()
        lay["flipped fwd cl"] = (x.to(memory_format=cl), wf.to(memory_format=cl))
        fnf = lambda a, b: F.conv3d(a, b, padding=k - 1 - p)
        run(name + " (fwd form)", fnf, x, wf, {"flipped fwd cl": lay.pop("flipped fwd cl"), "flipped fwd nc": (x, wf)})
    run(name, fn, x, w, lay)
    torch.cuda.empty_cache()
