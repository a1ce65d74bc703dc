"""Which input/weight layouts make cuDNN run the avgpool (folded) and div_max
convolutions without converting tensors around them? One-shot diagnostic."""
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kgen.bench import time_ms

torch.manual_seed(0)
CASES = {
    "avgpool folded k6 s4": (torch.randn(128, 8, 384, 384, device="cuda"), torch.randn(64, 8, 6, 6, device="cuda"), 4, torch.channels_last),
    "div_max conv3d k3": (torch.randn(128, 8, 16, 64, 64, device="cuda"), torch.randn(16, 8, 3, 3, 3, device="cuda"), 1, torch.channels_last_3d),
}
with torch.no_grad():
    for name, (x, w, s, cl) in CASES.items():
        conv = F.conv2d if x.dim() == 4 else F.conv3d
        variants = {
            "x NCHW, w NCHW": (x, w),
            "x CL, w CL": (x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)),
            "x CL, w NCHW": (x.contiguous(memory_format=cl), w),
            "x NCHW, w CL": (x, w.contiguous(memory_format=cl)),
        }
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            for label, (xx, ww) in variants.items():
                y = conv(xx, ww, None, stride=s)
                ms = time_ms(lambda: conv(xx, ww, None, stride=s), 20)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    conv(xx, ww, None, stride=s)
                    torch.cuda.synchronize()
                kernels = [(e.key[:60], e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]
                print(f"{name:22s} {label:16s} bench={bench!s:5s} {ms:7.3f} ms  out CL={y.is_contiguous(memory_format=cl)}  "
                      + "; ".join(f"{k} {t:.0f}us" for k, t in kernels), flush=True)
        torch.backends.cudnn.benchmark = False
