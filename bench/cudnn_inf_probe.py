"""Eager's 16-bit cuDNN convolutions with an inf in the input, and with a result beyond the dtype's range:
how many outputs are inf against float64's arithmetic on the same rounded values, whether any saturates to the
dtype's largest finite value. For the GPU machine:

    python bench/cudnn_inf_probe.py
"""
import argparse

import torch

F = torch.nn.functional


def count(y, y64, dt):
    fmax = torch.finfo(dt).max
    return (f"inf: eager {int(y.isinf().sum())}, float64 {int(y64.isinf().sum())}; "
            f"+-max: eager {int((y.abs() == fmax).sum())}; NaN: eager {int(y.isnan().sum())}, float64 {int(y64.isnan().sum())}")


def main():
    torch.manual_seed(0)
    print("cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    for dt in (torch.float16, torch.bfloat16):
        for shape in ((2, 8, 9, 21, 64), (2, 8, 21, 64), (2, 32, 16, 16, 16)):
            conv = F.conv3d if len(shape) == 5 else F.conv2d
            x = torch.randn(shape, device="cuda")
            w = torch.randn(12, shape[1], *[3] * (len(shape) - 2), device="cuda")
            x[(0, 1) + (2,) * (len(shape) - 2)] = float("inf")
            xd, wd = x.to(dt), w.to(dt)
            print(dt, conv.__name__, shape, count(conv(xd, wd).float(), conv(xd.double(), wd.double()), dt))
            big = conv(torch.full_like(xd, 200.0), torch.full_like(wd, 200.0)).float()
            print("   beyond the range:", sorted(set(big.flatten().tolist()))[:3])
        x = torch.randn(2, 8, 9, 21, 20, device="cuda")
        x[0, 1, 2, 2, 2] = float("inf")
        w = torch.randn(8, 12, 3, 3, 3, device="cuda")
        xd, wd = x.to(dt), w.to(dt)
        print(dt, "conv_transpose3d", count(F.conv_transpose3d(xd, wd).float(), F.conv_transpose3d(xd.double(), wd.double()), dt))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
