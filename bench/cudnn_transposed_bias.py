"""Each KernelBench level-2 problem's first transposed convolution as cuDNN calls, at the problem's sizes: as written
with and without its bias (kgen adds a deferred bias in the next stage), NC[D]HW and channels_last; for stride 1
also the flipped-kernel forward call. Medians of CUDA events, TF32 allowed (PyTorch's default for cuDNN). Writes
the rows as JSON (reports/cudnn_transposed_h200.json):

    python3 bench/cudnn_transposed_bias.py --kernelbench KernelBench/KernelBench --out reports/cudnn_transposed_h200.json
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


def ms(f, reps=15):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return round(sorted(ts)[len(ts) // 2], 4)


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--kernelbench", type=Path, required=True, help="KernelBench's folder holding level2/")
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()
KB = args.kernelbench
rows = []
for n in range(1, 101):
    try:
        mod = load_problem(problem_file(KB, 2, n), None)
    except Exception:
        continue
    src = problem_file(KB, 2, n).read_text()
    if "ConvTranspose" not in src:
        continue
    torch.manual_seed(0)
    try:
        model = mod.Model(*mod.get_init_inputs())
        conv = next(m for m in model.modules() if isinstance(m, (nn.ConvTranspose2d, nn.ConvTranspose3d)))
        x = mod.get_inputs()[0].cuda()
    except Exception as e:
        rows.append({"problem": n, "error": str(e)[:100]})
        continue
    conv = conv.cuda()
    rank = x.dim() - 2
    T = F.conv_transpose2d if rank == 2 else F.conv_transpose3d
    C = F.conv2d if rank == 2 else F.conv3d
    cl = torch.channels_last if rank == 2 else torch.channels_last_3d
    w, b = conv.weight.detach(), conv.bias.detach() if conv.bias is not None else None
    row = {"problem": n, "conv": f"{conv.in_channels}->{conv.out_channels} k{list(conv.kernel_size)} s{list(conv.stride)} "
           f"p{list(conv.padding)} op{list(conv.output_padding)} g{conv.groups}", "input": list(x.shape)}
    args = dict(stride=conv.stride, padding=conv.padding, output_padding=conv.output_padding, groups=conv.groups)
    for layout, xl, wl in (("ncdhw", x, w), ("cl", x.contiguous(memory_format=cl), w.contiguous(memory_format=cl))):
        row[f"t_{layout}_bias"] = ms(lambda: T(xl, wl, b, **args))
        row[f"t_{layout}_nobias"] = ms(lambda: T(xl, wl, None, **args))
        if all(s == 1 for s in conv.stride) and conv.groups == 1 and not any(conv.output_padding):
            wf = w.flip(list(range(2, 2 + rank))).transpose(0, 1).contiguous()
            wf = wf.contiguous(memory_format=cl) if layout == "cl" else wf
            pad = [k - 1 - p for k, p in zip(conv.kernel_size, conv.padding)]
            row[f"f_{layout}_bias"] = ms(lambda: C(xl, wf, b, padding=pad))
            row[f"f_{layout}_nobias"] = ms(lambda: C(xl, wf, None, padding=pad))
    print(json.dumps(row), flush=True)
    rows.append(row)
    del x, conv, model
    torch.cuda.empty_cache()
args.out.write_text(json.dumps({"environment": environment("cuda"), "rows": rows}, indent=1) + "\n")
