"""Which precision cuDNN runs a spec's first convolution in when TF32 is allowed (PyTorch's default): the
convolution alone on random normal input at the spec's example batch (cuDNN's choice depends on it), TF32 allowed against not allowed; identical bits mean
cuDNN ran fp32 kernels (then a TF32 generated convolution would be less accurate than eager). BATCHES=1,2,3
adds those batches (`kgen validate` runs batches 1 to 3: KernelBench #11's transposed call is fp32 at batch 1
only). GPU machine:

    PYTHONPATH=. BATCHES=1,2,3 python bench/cudnn_precision.py SPEC.yaml ...
"""
import argparse
import os

import torch
import yaml

CONVS = {"conv1d": torch.nn.Conv1d, "conv2d": torch.nn.Conv2d, "conv3d": torch.nn.Conv3d,
         "conv_transpose1d": torch.nn.ConvTranspose1d, "conv_transpose2d": torch.nn.ConvTranspose2d,
         "conv_transpose3d": torch.nn.ConvTranspose3d}
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("specs", nargs="+", help="spec files whose first op is a convolution")
for path in ap.parse_args().specs:
    spec = yaml.safe_load(open(path))
    (kind, args), = spec["ops"][0].items()
    if kind not in CONVS:
        print(f"{spec['name']}: first op {kind}, not a convolution")
        continue
    example = spec["input"].get("example", {})
    kw = {k: v for k, v in args.items() if k in ("stride", "padding", "dilation", "groups", "bias", "output_padding")}
    extra = [int(b) for b in os.environ.get("BATCHES", "").split(",") if b]
    for batch in sorted({*extra, *(v for v in example.values())}) or [2]:
        shape = [batch if isinstance(d, str) else d for d in spec["input"]["shape"]]
        torch.manual_seed(0)
        conv = CONVS[kind](shape[1], args["out_channels"], args["kernel_size"], **kw).cuda()
        x = torch.randn(shape, device="cuda")
        with torch.no_grad():
            torch.backends.cudnn.allow_tf32 = True
            a = conv(x)
            torch.backends.cudnn.allow_tf32 = False
            b = conv(x)
            ref = conv.double()(x[:2].double())  # the first two samples: float64 memory
            conv.float()
            a, b = a[:2], b[:2]
        torch.backends.cudnn.allow_tf32 = True
        err = lambda y: float(((y.double() - ref).norm() / ref.norm()))  # noqa: E731
        print(f"{spec['name']}: {kind} {shape[1]}->{args['out_channels']} k{args['kernel_size']} batch {batch}: "
              f"{'fp32 (identical bits)' if torch.equal(a, b) else 'TF32'}; rel L2 against float64: TF32 allowed "
              f"{err(a):.2e}, fp32 {err(b):.2e}")
