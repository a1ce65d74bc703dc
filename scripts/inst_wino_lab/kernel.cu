// Lab (notes/next_conv_gemm.md 0i): instnorm_clamp_max's 3 -> 16 conv3d (k 3, [N, 3, 16, 32, 32]) as
// Winograd F(2,3) in all three dimensions, in fp32, with the bias and the max over the channels
// (the earlier labs' output, [N, 14, 30, 30]), to measure what 0i estimates: ~7,200 instructions
// per 2x2x2 output block x 16 channels against the direct loop's ~11,970. Driver: run.py.
//
// A thread keeps one 2x2x2 output block x 16 channels (the 128 accumulators the onepass kernel's
// threads hold); a CTA of 128 threads is the product's tile, 2 x 16 x 32 outputs (the 16th column
// block and, in the second row tile, the 8th row block fall outside 30 x 30 and are dropped).
// Transform: V = B^T d B per input channel (4x4x4 input tile), M = sum over channels of U . V with
// U = G g G^T (from float64, by the driver, laid out [pz][py][cin][px][co]), y = A^T M A.
// Per (pz, py) line of the transform domain the thread builds its 4 V values per channel from 4
// input rows (signs of B^T along z and y), accumulates M[px][co] over the channels, then applies the
// x part of A^T and adds the result into its outputs with A^T's z and y signs.
#include <cuda_runtime.h>

#include <type_traits>

#ifndef LAB_CPT
#define LAB_CPT 16  // output channels per thread: 16, or 8 (two threads per block, the input transform twice)
#endif
#ifndef LAB_BY
#define LAB_BY 8  // 2-row blocks per tile in H: 8 (tiles of 2 x 16 x 32 outputs) or 4 (2 x 8 x 32)
#endif
#ifndef LAB_CI_UNROLL
#define LAB_CI_UNROLL 1  // 1: the input-channel loop stays a loop (registers), 3: unrolled
#endif
#ifndef LAB_MINB
#define LAB_MINB 2
#endif

namespace {
constexpr int kCin = 3, kCout = 16, kD = 16, kH = 32, kW = 32, kOD = 14, kOH = 30, kOW = 30;
constexpr int kCiUnroll = LAB_CI_UNROLL;
constexpr int kCpt = LAB_CPT, kHalves = kCout / kCpt, kBY = LAB_BY, kThreads = 16 * kBY * kHalves;
constexpr int kTilesZ = kOD / 2, kTilesY = (kOH / 2 + kBY - 1) / kBY, kTilesPerSample = kTilesZ * kTilesY;
constexpr int kBoxZ = 4, kBoxY = 2 * kBY + 2, kPitch = 36;  // 34 columns used, padded for aligned float2 rows
constexpr int kBoxPlane = kBoxY * kPitch, kBoxC = kBoxZ * kBoxPlane, kBoxFloats = kCin * kBoxC;
constexpr int kLineFloats = kCin * 4 * kCout;  // U of one (pz, py) line
constexpr int kUFloats = 16 * kLineFloats;
constexpr int kSmemBytes = (kBoxFloats + kUFloats) * 4;

// B^T = [[1,0,-1,0],[0,1,1,0],[0,-1,1,0],[0,1,0,-1]]: row p is sign(p,0) d[idx(p,0)] + sign(p,1) d[idx(p,1)].
__host__ __device__ constexpr int bt_idx(int p, int j) { return p == 0 ? (j ? 2 : 0) : p == 1 ? (j ? 2 : 1) : p == 2 ? (j ? 1 : 2) : (j ? 3 : 1); }
__host__ __device__ constexpr bool bt_neg(int p, int j) { return j == 1 && p != 1; }
// A^T = [[1,1,1,0],[0,1,-1,-1]]
__host__ __device__ constexpr int at(int o, int p) { return o == 0 ? (p < 3 ? 1 : 0) : (p == 0 ? 0 : p == 1 ? 1 : -1); }

__device__ __forceinline__ float nan_max(float m, float v) { return (v > m || v != v) ? v : m; }

// Calls f(std::integral_constant<int, l>) for l = 0 .. L - 1, unrolled at compile time.
template <int L, class F>
__device__ __forceinline__ void for_lines(F&& f) {
  if constexpr (L > 0) {
    for_lines<L - 1>(f);
    f(std::integral_constant<int, L - 1>{});
  }
}

__global__ void __launch_bounds__(kThreads, LAB_MINB) wino_kernel(const float* __restrict__ x, const float* __restrict__ U,
                                                     const float* __restrict__ bias, float* __restrict__ out) {
  extern __shared__ float4 smem4[];
  float* box = reinterpret_cast<float*>(smem4);
  float* u = box + kBoxFloats;
  const int tid = threadIdx.x;
  const int n = blockIdx.x / kTilesPerSample, r = blockIdx.x % kTilesPerSample, tz = r / kTilesY, ty = r % kTilesY;
  for (int i = tid; i < kUFloats / 4; i += kThreads) reinterpret_cast<float4*>(u)[i] = reinterpret_cast<const float4*>(U)[i];
  const float* xs = x + static_cast<long long>(n) * kCin * kD * kH * kW;
  for (int i = tid; i < kCin * kBoxZ * kBoxY * kPitch; i += kThreads) {
    const int col = i % kPitch, row = i / kPitch % kBoxY, z = i / (kPitch * kBoxY) % kBoxZ, c = i / (kPitch * kBoxY * kBoxZ);
    const int gy = 2 * kBY * ty + row, gz = 2 * tz + z;
    box[i] = col < kW && gy < kH ? xs[((c * kD + gz) * kH + gy) * kW + col] : 0.f;
  }
  __syncthreads();
  const int bx = tid % 16, by = tid / 16 % kBY, half = tid / (16 * kBY);
  const float* base = box + 2 * by * kPitch + 2 * bx;
  float o[2][2][2][kCpt];
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int co = 0; co < kCpt; ++co) o[a][b][c][co] = 0.f;
  for_lines<16>([&](auto line) {
    constexpr int pz = decltype(line)::value / 4, py = decltype(line)::value % 4;
    {
      float m[4][kCpt];
#pragma unroll
      for (int px = 0; px < 4; ++px)
#pragma unroll
        for (int co = 0; co < kCpt; ++co) m[px][co] = 0.f;
#pragma unroll kCiUnroll
      for (int ci = 0; ci < kCin; ++ci) {
        float rr[4];
#pragma unroll
        for (int jz = 0; jz < 2; ++jz) {
#pragma unroll
          for (int jy = 0; jy < 2; ++jy) {
            const float* row = base + ci * kBoxC + bt_idx(pz, jz) * kBoxPlane + bt_idx(py, jy) * kPitch;
            const float2 lo = *reinterpret_cast<const float2*>(row), hi = *reinterpret_cast<const float2*>(row + 2);
            const float d[4] = {lo.x, lo.y, hi.x, hi.y};
            const bool neg = bt_neg(pz, jz) != bt_neg(py, jy);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              if (jz == 0 && jy == 0) rr[k] = d[k];  // (0, 0) is never negated
              else rr[k] = neg ? rr[k] - d[k] : rr[k] + d[k];
            }
          }
        }
        const float v[4] = {rr[0] - rr[2], rr[1] + rr[2], rr[2] - rr[1], rr[1] - rr[3]};
        const float* w = u + (pz * 4 + py) * kLineFloats + ci * 4 * kCout + half * kCpt;
#pragma unroll
        for (int px = 0; px < 4; ++px) {
#pragma unroll
          for (int q = 0; q < kCpt / 4; ++q) {
            const float4 wv = *reinterpret_cast<const float4*>(w + px * kCout + 4 * q);
            const float ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float& acc = m[px][4 * q + e];
              acc = fmaf(v[px], ws[e], acc);
            }
          }
        }
      }
#pragma unroll
      for (int co = 0; co < kCpt; ++co) {
        const float t[2] = {m[0][co] + m[1][co] + m[2][co], m[1][co] - m[2][co] - m[3][co]};
#pragma unroll
        for (int oz = 0; oz < 2; ++oz) {
#pragma unroll
          for (int oy = 0; oy < 2; ++oy) {
            const int s = at(oz, pz) * at(oy, py);  // folds: the loops are unrolled
            if (s == 0) continue;
#pragma unroll
            for (int ox = 0; ox < 2; ++ox) o[oz][oy][ox][co] = s > 0 ? o[oz][oy][ox][co] + t[ox] : o[oz][oy][ox][co] - t[ox];
          }
        }
      }
    }
  });
  // bias, max over the channels, store the block's valid outputs
  const int oy0 = 2 * kBY * ty + 2 * by, ox0 = 2 * bx, oz0 = 2 * tz;
  float b[kCpt];
#pragma unroll
  for (int co = 0; co < kCpt; ++co) b[co] = bias[half * kCpt + co];
  float mx[2][2][2];
#pragma unroll
  for (int oz = 0; oz < 2; ++oz)
#pragma unroll
    for (int oy = 0; oy < 2; ++oy)
#pragma unroll
      for (int ox = 0; ox < 2; ++ox) {
        mx[oz][oy][ox] = o[oz][oy][ox][0] + b[0];
#pragma unroll
        for (int co = 1; co < kCpt; ++co) mx[oz][oy][ox] = nan_max(mx[oz][oy][ox], o[oz][oy][ox][co] + b[co]);
      }
  if constexpr (kHalves == 2) {  // the second half's maxima through shared memory (the box is free now)
    __syncthreads();
    float* other = box + (tid % (16 * kBY)) * 8;
    if (half == 1)
#pragma unroll
      for (int i = 0; i < 8; ++i) other[i] = mx[i / 4][i / 2 % 2][i % 2];
    __syncthreads();
    if (half == 1) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) mx[i / 4][i / 2 % 2][i % 2] = nan_max(mx[i / 4][i / 2 % 2][i % 2], other[i]);
  }
  if (oy0 >= kOH || ox0 >= kOW) return;
#pragma unroll
  for (int oz = 0; oz < 2; ++oz)
#pragma unroll
    for (int oy = 0; oy < 2; ++oy) {
      const float2 res = make_float2(mx[oz][oy][0], mx[oz][oy][1]);
      *reinterpret_cast<float2*>(out + ((static_cast<long long>(n) * kOD + oz0 + oz) * kOH + oy0 + oy) * kOW + ox0) = res;
    }
}
}  // namespace

extern "C" int lab_run(const float* x, const float* U, const float* bias, float* out, int batch, cudaStream_t stream) {
  static bool set = false;  // a lab: one GPU
  if (!set) {
    const cudaError_t err = cudaFuncSetAttribute(wino_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    set = true;
  }
  if (batch > 0) wino_kernel<<<batch * kTilesPerSample, kThreads, kSmemBytes, stream>>>(x, U, bias, out);
  return static_cast<int>(cudaGetLastError());
}
