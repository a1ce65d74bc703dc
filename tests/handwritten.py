"""Hand-written copies of the five users' models, exactly as given in the issue.

The tests check that the reference model kgen builds from each spec has the
same parameters, initialization and outputs as these.
"""
import torch
from torch import nn


class MaxpoolSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(32, 64, 5, stride=2, padding=2)
        self.max_pool1 = nn.MaxPool3d(kernel_size=2)
        self.max_pool2 = nn.MaxPool3d(kernel_size=3)

    def forward(self, x):
        x = self.conv_transpose(x)
        x = self.max_pool1(x)
        x = self.max_pool2(x)
        return torch.sum(x, dim=1, keepdim=True)


class DivMaxGapBiasSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(8, 16, (3, 3, 3))
        self.divisor = 2.0
        self.max_pool = nn.MaxPool3d((2, 2, 2))
        self.global_avg_pool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.bias = nn.Parameter(torch.randn(16, 1, 1, 1))
        self.sum_dim = 1

    def forward(self, x):
        x = self.conv(x)
        x = x / self.divisor
        x = self.max_pool(x)
        x = self.global_avg_pool(x)
        x = x + self.bias
        return torch.sum(x, dim=self.sum_dim)


class AvgpoolSigmoidSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 64, 3)
        self.avg_pool = nn.AvgPool2d(4)

    def forward(self, x):
        x = self.conv(x)
        x = self.avg_pool(x)
        x = torch.sigmoid(x)
        return torch.sum(x, dim=[1, 2, 3])


class ReluGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(64, 128, 3, bias=False)
        self.group_norm = nn.GroupNorm(num_groups=8, num_channels=128)

    def forward(self, x):
        return self.group_norm(torch.relu(self.conv_transpose(x)))


class InstnormClampMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 16, 3)
        self.multiplier = nn.Parameter(torch.randn(16, 1, 1, 1))
        self.instance_norm = nn.InstanceNorm3d(16)
        self.clamp_min, self.clamp_max = -1.0, 1.0

    def forward(self, x):
        x = self.conv(x)
        x = x * self.multiplier
        x = self.instance_norm(x)
        x = torch.clamp(x, self.clamp_min, self.clamp_max)
        x = x * self.multiplier
        return torch.max(x, dim=1)[0]


MODELS = {
    "maxpool_sum": MaxpoolSum,
    "div_max_gap_bias_sum": DivMaxGapBiasSum,
    "avgpool_sigmoid_sum": AvgpoolSigmoidSum,
    "relu_group_norm": ReluGroupNorm,
    "instnorm_clamp_max": InstnormClampMax,
}
