"""How cuDNN and cuBLAS turn fp32 inputs into TF32 (PyTorch's TF32 switches on). For the GPU machine:

    python scripts/tf32_lab/cudnn_rounding.py

Inputs all equal to one bit pattern, weights all ones, 64 input channels: the output is 64 x the TF32
value used. H100, cuDNN 9.19 (stop 23): 1 + 0.75 x 2^-10 gives 64.0625 and 1 + 0.375 x 2^-10 gives 64, in the
1x1x1 and 3x3x3 convolutions and the matmul: rounded to nearest, not truncated.
"""
import torch, struct
torch.backends.cudnn.allow_tf32 = True
torch.backends.cuda.matmul.allow_tf32 = True
def f(bits): return struct.unpack('<f', struct.pack('<I', bits))[0]
for bits in (0x3F800C00, 0x3F800800, 0x3F801800):
    x = torch.full((1, 64, 8, 8, 8), f(bits), device='cuda')
    w = torch.ones(16, 64, 1, 1, 1, device='cuda')
    y = torch.nn.functional.conv3d(x, w)
    x2 = torch.full((1, 64, 18, 18, 18), f(bits), device='cuda'); w2 = torch.ones(16, 64, 3, 3, 3, device='cuda')
    y2 = torch.nn.functional.conv3d(x2, w2)
    m = torch.full((256, 64), f(bits), device='cuda') @ torch.ones(64, 256, device='cuda')
    print(hex(bits), 'exact 64x =', 64 * f(bits), 'conv1x1:', y.flatten()[0].item(), 'conv3x3x3 (/27):', y2.flatten()[0].item() / 27, 'matmul:', m[0, 0].item(),
          '| rna 64x =', 64 * f((bits + 0x1000) & 0xFFFFE000), 'trunc 64x =', 64 * f(bits & 0xFFFFE000))
