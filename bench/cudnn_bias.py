"""Each KernelBench level-2 problem's first convolution as cuDNN calls at the problem's sizes, with and without its
bias (kgen adds a deferred bias in the next stage, where ATen adds it in a pass of its own), NC[D]HW and
channels_last: a forward convolution as written; a transposed one as written and, at stride 1, as the
flipped-kernel forward call. Medians of CUDA events (kgen.bench.time_ms), TF32 allowed (PyTorch's default for
cuDNN). The rows (keys FORM_LAYOUT_BIAS: ``transposed_cl_nobias``, ``flipped_ncdhw_bias``, ``forward_cl_nobias``, ...) are the data
for conv_aten's rates of calls without a bias (reports/cudnn_bias_h200.json):

    python3 bench/cudnn_bias.py --kernelbench KernelBench/KernelBench --out reports/cudnn_bias_h200.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from kernelbench_backend import environment, load_problem, problem_file  # noqa: E402

from kgen.bench import time_ms  # noqa: E402

REPS = 15  # timed calls per form (median)

CONVS = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def calls(conv, x) -> dict:
    """name -> call of each form, layout and bias."""
    rank = x.dim() - 2
    transposed = isinstance(conv, (nn.ConvTranspose2d, nn.ConvTranspose3d))
    fwd = F.conv2d if rank == 2 else F.conv3d
    cl = torch.channels_last if rank == 2 else torch.channels_last_3d
    w, b = conv.weight.detach(), conv.bias.detach() if conv.bias is not None else None
    out = {}
    for layout, xl in (("ncdhw", x), ("cl", x.contiguous(memory_format=cl))):
        wl = w.contiguous(memory_format=cl) if layout == "cl" else w
        if transposed:
            t = F.conv_transpose2d if rank == 2 else F.conv_transpose3d
            args = dict(stride=conv.stride, padding=conv.padding, output_padding=conv.output_padding, groups=conv.groups)
            for bias in ("bias", "nobias"):
                out[f"transposed_{layout}_{bias}"] = lambda xl=xl, wl=wl, bb=b if bias == "bias" else None: t(xl, wl, bb, **args)
            if all(s == 1 for s in conv.stride) and conv.groups == 1 and not any(conv.output_padding):
                wf = w.flip(list(range(2, 2 + rank))).transpose(0, 1).contiguous()
                wf = wf.contiguous(memory_format=cl) if layout == "cl" else wf
                pad = [k - 1 - p for k, p in zip(conv.kernel_size, conv.padding)]
                for bias in ("bias", "nobias"):
                    out[f"flipped_{layout}_{bias}"] = lambda xl=xl, wf=wf, bb=b if bias == "bias" else None: fwd(xl, wf, bb, padding=pad)
        else:
            args = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
            for bias in ("bias", "nobias"):
                out[f"forward_{layout}_{bias}"] = lambda xl=xl, wl=wl, bb=b if bias == "bias" else None: fwd(xl, wl, bb, **args)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernelbench", type=Path, required=True, help="KernelBench's folder holding level2/")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--problems", default="1-100", help="numbers: 1,4,8 or 1-100")
    args = ap.parse_args()
    numbers = [n for part in args.problems.split(",") for n in
               (range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part else [int(part)])]
    rows = []
    for n in numbers:
        try:
            mod = load_problem(problem_file(args.kernelbench, 2, n), None)
            torch.manual_seed(0)
            model = mod.Model(*mod.get_init_inputs())
            conv = next((m for m in model.modules() if isinstance(m, CONVS)), None)
            if conv is None:
                continue
            x = mod.get_inputs()[0].cuda()
        except Exception as e:  # noqa: BLE001 - a problem that does not load is a row saying why
            rows.append({"problem": n, "error": str(e)[:100]})
            continue
        conv = conv.cuda()
        row = {"problem": n, "conv": f"{type(conv).__name__} {conv.in_channels}->{conv.out_channels} k{list(conv.kernel_size)} "
               f"s{list(conv.stride)} p{list(conv.padding)} op{list(getattr(conv, 'output_padding', (0,)))} g{conv.groups}",
               "input": list(x.shape)}
        for name, f in calls(conv, x).items():
            row[name] = round(time_ms(f, REPS), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x, conv, model
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"environment": environment("cuda"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
