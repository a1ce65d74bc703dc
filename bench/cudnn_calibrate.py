"""Calibration data for the cost model's cuDNN convolutions (kgen.families.conv_aten.conv_work): each spec's
first convolution at its example batch, in every form a conv_aten stage can call it (as written, NC[D]HW and
channels_last; a strided transposed one also as its sub-pixel phase convolutions; a stride-1 transposed one also
as the flipped-kernel forward convolution), each timed with TF32 allowed (PyTorch's default) and with TF32 off,
beside conv_work's estimate of the same call. "fp32 kernel" means TF32 allowed gave the same bits as TF32 off:
cuDNN picked an fp32 kernel anyway. With --dtype bfloat16 or float16: the input, weights and bias in that dtype,
each form timed once (TF32 does not apply) beside conv_work's 16-bit estimate. GPU machine:

    PYTHONPATH=. python bench/cudnn_calibrate.py --out cal.json SPEC.yaml ...
    PYTHONPATH=. python bench/cudnn_calibrate.py --dtype bfloat16 --out cal_bf16.json SPEC.yaml ...
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from kgen.bench import time_ms
from kgen.cost import work_s
from kgen.families.conv_aten import conv_work
from kgen.ir import Conv, load_pipeline
from kgen.lowering import LoweredConv
from kgen.rewrites import subpixel_conv_transpose
from kgen.target import current

FWD = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def fmt_of(layout, rank):
    if layout == "contiguous":
        return torch.contiguous_format
    return torch.channels_last if rank == 2 else torch.channels_last_3d


def measure(calls, reps):
    """calls: list of zero-argument functions making one form's cuDNN calls. -> (TF32-allowed ms, TF32-off ms,
    whether TF32 allowed gave fp32 bits)."""
    run = lambda: [c() for c in calls]  # noqa: E731
    with torch.no_grad():
        torch.backends.cudnn.allow_tf32 = False
        ref = run()
        off = time_ms(run, reps)
        torch.backends.cudnn.allow_tf32 = True
        got = run()
        on = time_ms(run, reps)
    same = all(torch.equal(a, b) for a, b in zip(ref, got))
    return on, off, same


def forms(pipe, x: torch.Tensor):
    """(form name, layout, [call], [conv_work estimate args]) for each way conv_aten can run the pipeline's
    first op, a convolution (on x's device: "meta" gives the estimate arguments without a GPU)."""
    conv = pipe.ops[0]
    rank = conv.rank
    n, L = x.shape[0], tuple(x.shape[2:])
    cin, cout, g = conv.in_channels, conv.out_channels, conv.groups
    bias = torch.randn(cout, device=x.device, dtype=x.dtype)
    out = []
    for layout in ("contiguous", "channels_last"):
        f = fmt_of(layout, rank)
        xl = x.contiguous(memory_format=f)
        if conv.transposed:
            w = torch.randn(cin, cout // g, *conv.kernel, device=x.device, dtype=x.dtype).contiguous(memory_format=f)
            call = lambda xl=xl, w=w: TRANSPOSED[rank](xl, w, bias, conv.stride, conv.padding,  # noqa: E731
                                                       conv.output_padding, g, conv.dilation)
        else:
            w = torch.randn(cout, cin // g, *conv.kernel, device=x.device, dtype=x.dtype).contiguous(memory_format=f)
            call = lambda xl=xl, w=w: FWD[rank](xl, w, bias, conv.stride, conv.padding, conv.dilation, g)  # noqa: E731
        y = call()
        flops = 2 * n * cin // g * cout * math.prod(conv.kernel) * (math.prod(L) if conv.transposed else math.prod(y.shape[2:]))
        est = dict(flops=flops, read=x.numel(), written=y.numel(), n=cout // g, k=cin // g * math.prod(conv.kernel),
                   layout=layout, transposed_stride=tuple(conv.stride) if conv.transposed else None, channels=cin // g, bias=True,
                   kernel=tuple(conv.kernel))
        out.append(("as written", layout, [call], [est]))
        del y
    lowered = subpixel_conv_transpose(pipe)[0][0]  # the rewrite's own test of where sub-pixel phases apply
    if isinstance(lowered, LoweredConv):
        phases = lowered.lowering.phases(conv, L, None)
        name = "flipped kernel" if len(phases) == 1 else f"{len(phases)} sub-pixel phases"
        for layout in ("contiguous", "channels_last"):
            f = fmt_of(layout, rank)
            xin = x[(slice(None), slice(None)) + tuple(slice(0, e) for e in phases[0].input_extent)].contiguous(memory_format=f)
            calls, ests = [], []
            for ph in phases:
                w = torch.randn(cout, cin, *ph.taps, device=x.device, dtype=x.dtype).contiguous(memory_format=f)
                calls.append(lambda w=w, ph=ph: FWD[rank](xin, w, bias, 1, ph.padding))
                ests.append(dict(flops=2 * n * cin * cout * math.prod(ph.taps) * math.prod(ph.count), read=xin.numel(),
                                 written=n * cout * math.prod(ph.conv_out), n=cout, k=cin * math.prod(ph.taps),
                                 layout=layout, transposed_stride=None, channels=cin, bias=True, phase=len(phases) > 1))
            out.append((name, layout, calls, ests))
    return out


def first_convolutions(specs, dtype):
    """(pipeline, its first op (a convolution), its example batch, form, layout, calls, estimate arguments) for
    each form of each spec that starts with a convolution, its input on CUDA in ``dtype``."""
    for path in specs:
        pipe = load_pipeline(path)
        conv = pipe.ops[0]
        if not isinstance(conv, Conv):
            continue
        batch = pipe.example_batch()
        torch.manual_seed(0)
        x = torch.randn(pipe.input.concrete(batch), device="cuda", dtype=dtype)
        for name, layout, calls, ests in forms(pipe, x):
            yield pipe, conv, batch, name, layout, calls, ests
        del x
        torch.cuda.empty_cache()


def row_of(pipe, conv, batch, name, layout, calls, ests, **times) -> dict:
    return dict(spec=pipe.name, conv=f"{conv.kind} {conv.in_channels}->{conv.out_channels} k{list(conv.kernel)} "
                f"s{list(conv.stride)} p{list(conv.padding)}", batch=batch, form=name, layout=layout, calls=len(calls),
                k=ests[0]["k"], n=ests[0]["n"], gflop=sum(e["flops"] for e in ests) / 1e9, **times)


def model_ms(ests, target, **kw) -> float:
    return 1e3 * sum(work_s(w, target) for e in ests for w in conv_work("c", target=target, **kw, **e))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = ap.parse_args()
    target, half = current(), args.dtype != "float32"
    rows = []
    for pipe, conv, batch, name, layout, calls, ests in first_convolutions(args.specs, getattr(torch, args.dtype)):
        try:
            if half:  # one time: TF32 does not apply
                with torch.no_grad():
                    ms = time_ms(lambda: [c() for c in calls], args.reps)  # noqa: B023
            else:
                on, off, fp32_bits = measure(calls, args.reps)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        if half:
            row = row_of(pipe, conv, batch, name, layout, calls, ests, dtype=args.dtype, ms=ms,
                         model_ms=model_ms(ests, target, dtype=args.dtype))
            said = f"{ms:8.3f} ms  model {row['model_ms']:8.3f}"
        else:
            row = row_of(pipe, conv, batch, name, layout, calls, ests, tf32_allowed_ms=on, tf32_off_ms=off,
                         fp32_kernel=fp32_bits, model_tf32_ms=model_ms(ests, target, fp32=False),
                         model_fp32_ms=model_ms(ests, target, fp32=True))
            said = (f"allowed {on:8.3f} ms ({'fp32' if fp32_bits else 'tf32'})  off {off:8.3f}  "
                    f"model tf32 {row['model_tf32_ms']:8.3f} fp32 {row['model_fp32_ms']:8.3f}")
        rows.append(row)
        print(f"{row['spec'][:44]:44s} {name[:20]:20s} {layout[:6]:6s} K={row['k']:5d} N={row['n']:4d} "
              f"{row['gflop']:8.2f} GF  {said}", flush=True)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    json.dump({**out, "dtype": args.dtype} if half else out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
