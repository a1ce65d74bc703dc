// dm_lab: what kernel.cu and kernel_ws.cu share: the problem, the input box and the loading of its items.
//
// The box of a tile (sample n, output planes 2 pd, 2 pd + 1, output rows 8 hb .. 8 hb + 7) is
// [2 channel quads][4 d][10 h][kBW w][4 channels] in TF32. An item is 8 w positions of one box row (quad, d, h):
// 8 float4 loads (4 channels x 2) transposed in registers into 8 positions of 4 channels. With the default
// mapping consecutive threads take consecutive rows, kBW = 1 mod 8 positions apart, so a store phase of 8
// threads meets 8 different 16-byte bank groups. Timing switches: LAB_MAP_COALESCED, LAB_NOGLOBAL, LAB_NOSTORE.
#pragma once
#include "conv_gemm.cuh"

namespace lab {

using kgen::conv_gemm::to_tf32;

constexpr int kCin = 8, kD = 16, kH = 64, kW = 64;
constexpr int kOW = 62, kPD = 7, kPH = 31;
constexpr int kHB = 8;  // row blocks of 8 output rows (the last has 6 real)
constexpr int kBD = 4, kBH = 10, kBW = 73, kBoxPos = kBD * kBH * kBW, kQuads = kCin / 4;
constexpr int kBoxFloats = kQuads * kBoxPos * 4;
constexpr int kRows = kQuads * kBD * kBH, kItems = kRows * (kW / 8);

__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

struct BoxItem {
  float4 v[4][2];
  int row, w8;
  bool on;
};

template <int kStride>  // threads sharing the box: item k of thread t is t + kStride k
__device__ __forceinline__ void item_load(BoxItem& it, const float* __restrict__ x, int tile, int k, int t) {
  const int item = t + kStride * k;
  it.on = item < kItems;
  if (!it.on) return;
  const int n = tile / (kPD * kHB), pd = (tile / kHB) % kPD, hb = tile % kHB;
  constexpr int kC = kD * kH * kW;
#ifdef LAB_MAP_COALESCED  // consecutive threads: consecutive 8-position groups of a row (stores 8-way conflicted)
  it.row = item / (kW / 8);
  it.w8 = item % (kW / 8);
#else
  it.row = item % kRows;
  it.w8 = item / kRows;
#endif
  const int bh = it.row % kBH, bd = (it.row / kBH) % kBD, quad = it.row / (kBH * kBD);
#ifdef LAB_NOGLOBAL  // timing only: no global loads
  if (false) {
#else
  if (8 * hb + bh < kH) {
#endif
    const float4* p = reinterpret_cast<const float4*>(
        x + (static_cast<long long>(n) * kCin * kD + 2 * pd + 4 * quad * kD + bd) * kH * kW + (8 * hb + bh) * kW + 8 * it.w8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      it.v[i][0] = __ldg(p + i * (kC / 4));
      it.v[i][1] = __ldg(p + i * (kC / 4) + 1);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) it.v[i][0] = it.v[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

__device__ __forceinline__ void item_store(const BoxItem& it, float* box) {
  if (!it.on) return;
#ifdef LAB_NOSTORE  // timing only: the loaded values are not stored (a test the compiler cannot drop)
  if (it.v[0][0].x != 1.2345e-38f) return;
#endif
  float4* dst = reinterpret_cast<float4*>(box) + it.row * kBW + 8 * it.w8;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    dst[4 * h2 + 0] = make_float4(to_tf32(it.v[0][h2].x), to_tf32(it.v[1][h2].x), to_tf32(it.v[2][h2].x), to_tf32(it.v[3][h2].x));
    dst[4 * h2 + 1] = make_float4(to_tf32(it.v[0][h2].y), to_tf32(it.v[1][h2].y), to_tf32(it.v[2][h2].y), to_tf32(it.v[3][h2].y));
    dst[4 * h2 + 2] = make_float4(to_tf32(it.v[0][h2].z), to_tf32(it.v[1][h2].z), to_tf32(it.v[2][h2].z), to_tf32(it.v[3][h2].z));
    dst[4 * h2 + 3] = make_float4(to_tf32(it.v[0][h2].w), to_tf32(it.v[1][h2].w), to_tf32(it.v[2][h2].w), to_tf32(it.v[3][h2].w));
  }
}


// Shared memory before the first box: the packed weights (cp.async, committed) and the box columns past the
// input (w >= kW) of both buffers, zero for good.
__device__ __forceinline__ void prologue(float* smem, float* wts, const float* __restrict__ packed, int w_floats, int tid,
                                         int threads) {
  for (int e = tid; e < w_floats / 4; e += threads) kgen::conv_gemm::cp_async16(wts + 4 * e, packed + 4 * e, true);
  kgen::conv_gemm::cp_async_commit();
  for (int e = tid; e < 2 * kRows * (kBW - kW); e += threads)
    reinterpret_cast<float4*>(smem)[(e / (kBW - kW)) * kBW + kW + e % (kBW - kW)] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// This thread's share of one pooled row: the 2 x 2 x 2 max over two m-blocks' accumulators (rows h, h + 1;
// columns: plane 0 in blocks 0, 1 and plane 1 in blocks 2, 3; w pairs in lanes 4 apart), plus the bias, / 2,
// summed over its valid pooled positions and channels. `ph`: the pooled row; bias_c: this thread's channels'.
__device__ __forceinline__ float pooled_row_sum(const float (&a0)[4][4], const float (&a1)[4][4], int ph, int warp, int g,
                                                const float (&bias_c)[4]) {
  float s = 0.f;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float v = nan_max(nan_max(a0[nb][c], a0[nb + 2][c]), nan_max(a1[nb][c], a1[nb + 2][c]));
      v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, 4));
      const int w = 16 * warp + g + 8 * (c >> 1);
      if ((g & 1) == 0 && w < kOW && ph < kPH) s += (v + bias_c[2 * nb + (c & 1)]) * 0.5f;
    }
  return s;
}

}  // namespace lab
