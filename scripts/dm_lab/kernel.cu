// dm_lab: div_max_gap_bias_sum's convolution + bias + /2 + 2^3 max pool + global sum as one wgmma kernel.
//
// Conv3d(8 -> 16, k 3) on x [N, 8, 16, 64, 64] (output 14 x 62 x 62), then per sample the sum over channels
// and pooled positions of max over 2^3 windows of (conv + bias) / 2 (a partial per tile; the host adds them).
//
// M = positions: an m-block is one output row, 64 w positions (62 real), so its A operand is 64 consecutive
// positions of the input box (box.cuh: [2 channel quads][4 d][10 h][73 w][4 channels], TF32), read through a
// descriptor at the tap's offset: no im2col. N = 2 output d-planes x 16 channels: the weights of plane j at
// box depth sd are tap kd = sd - j, so box depths sd = 0..3 give both planes at once; sd = 0 and 3 feed one
// plane only (m64n16 on its half of the accumulators), sd = 1, 2 both (m64n32): no wasted products.
// A tile: sample n, output planes 2 pd, 2 pd + 1, output rows 8 hb .. 8 hb + 7; warpgroup wg takes rows
// 4 wg .. 4 wg + 3 (4 m-blocks). The 2 x 2 x 2 pool is in registers: d pairs are the two planes (columns
// j = 0, 1), h pairs the m-blocks 2p, 2p + 1, w pairs lanes 4 apart. The next tile's box is loaded (through
// registers, rounded to TF32) into the other buffer while this tile's MMAs run.
//
// Measured (notes/perf.md, stop 25): 0.542 ms at batch 128, 0.267 without the box loads; the loads do not hide.
// LAB_NOLOAD (timing only) skips them; LAB_N32 (timing only) puts every depth on one m64n32.
#include "box.cuh"

using namespace kgen::conv_gemm;

namespace lab {

constexpr int kTapFloats = kQuads * 48 * 4;            // per (kh, kw): [quad][3 kd blocks (kd = 2, 1, 0) x 16 channels][4]
constexpr int kWFloats = 9 * kTapFloats;
constexpr int kOffW = 2 * kBoxFloats, kOffScr = kOffW + kWFloats, kSmemFloats = kOffScr + 16;  // scr: per-warp sums, two sets (tile parity)
constexpr int kThreads = 256;

// The whole box of `tile` (the first tile's, before the loop), an item at a time (box.cuh).
constexpr int kPerThread = (kItems + kThreads - 1) / kThreads;
__device__ __forceinline__ void load_box(float* box, const float* __restrict__ x, int tile, int tid) {
#pragma unroll 1
  for (int k = 0; k < kPerThread; ++k) {
    BoxItem it;
    item_load<kThreads>(it, x, tile, k, tid);
    item_store(it, box);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    divmax_kernel(const float* __restrict__ x, const float* __restrict__ packed, const float* __restrict__ bias,
                  float* __restrict__ partial, int batch) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* wts = smem + kOffW;
  float* scr = smem + kOffScr;
  const int tid = threadIdx.x, wg = tid >> 7, lt = tid & 127;
  const int warp = lt >> 5, lane = lt & 31, g = lane >> 2, t = lane & 3;
  const int tiles = batch * kPD * kHB;

  prologue(smem, wts, packed, kWFloats, tid, kThreads);
  if (blockIdx.x < tiles) load_box(smem, x, blockIdx.x, tid);
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();

  float bias_c[4];  // this thread's channels: 8 nb + 2 t + (c & 1)
#pragma unroll
  for (int c = 0; c < 4; ++c) bias_c[c] = __ldg(bias + 8 * (c >> 1) + 2 * t + (c & 1));

  const uint64_t w_desc = smem_desc(smem_addr(wts), 48 * 16, 128);
  float acc[4][4][4];
  // Depths 0 and 3 feed one plane each: m64n16 into accumulators of their own (an n16 MMA on half of an
  // n32 accumulator set makes ptxas serialize all MMAs), added in after the last MMA.
  float edge[4][2][2][4];
  int buf = 0;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int hb = tile % kHB;
    float* box = smem + buf * kBoxFloats;
    float* nbox = smem + (buf ^ 1) * kBoxFloats;
    const int next = tile + gridDim.x;
    BoxItem it;
    static_assert(kPerThread <= 3, "the box items of a thread are loaded at steps 0, 3, 6");
    const uint64_t a_desc = smem_desc(smem_addr(box + (4 * wg) * kBW * 4), kBoxPos * 16, 128);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[a][b][c] = 0.f;
          edge[a][b >> 1][b & 1][c] = 0.f;
          pin(acc[a][b][c]);  // zeroed before the first MMA, not between MMAs (ptxas would serialize them)
          pin(edge[a][b >> 1][b & 1][c]);
        }
    wgmma_fence();
#pragma unroll
    for (int kh = 0; kh < 3; ++kh)
#pragma unroll
      for (int kw = 0; kw < 3; ++kw) {
        const int step = kh * 3 + kw;
#ifndef LAB_NOLOAD
        // The next tile's box, one item every 3 steps: loads issued here, stored two steps later, so the loads'
        // latency passes under this tile's MMAs (a warp issuing MMAs waits while the MMA queue is full).
        if (step % 3 == 0 && next < tiles) item_load<kThreads>(it, x, next, step / 3, tid);
        if (step % 3 == 2 && next < tiles) item_store(it, nbox);
#endif
        const uint64_t wb = w_desc + (step * kTapFloats) / 4;  // descriptor addresses count 16 bytes
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) {
          const uint64_t ab = a_desc + ((mb + kh) * kBW + kw);
#ifdef LAB_N32
          Wgmma<32>::mma(acc[mb], ab + 0 * kBH * kBW, wb + 2 * 16);  // timing only
          Wgmma<32>::mma(acc[mb], ab + 1 * kBH * kBW, wb + 1 * 16);
          Wgmma<32>::mma(acc[mb], ab + 2 * kBH * kBW, wb + 0 * 16);
          Wgmma<32>::mma(acc[mb], ab + 3 * kBH * kBW, wb + 0 * 16);
#else
          Wgmma<16>::mma(edge[mb][0], ab + 0 * kBH * kBW, wb + 2 * 16);  // depth 0: plane 0, tap kd 0
          Wgmma<32>::mma(acc[mb], ab + 1 * kBH * kBW, wb + 1 * 16);  // depth 1: kd 1, 0
          Wgmma<32>::mma(acc[mb], ab + 2 * kBH * kBW, wb + 0 * 16);  // depth 2: kd 2, 1
          Wgmma<16>::mma(edge[mb][1], ab + 3 * kBH * kBW, wb + 0 * 16);  // depth 3: plane 1, tap kd 2
#endif
        }
      }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          pin(acc[a][b][c]);
          pin(edge[a][b >> 1][b & 1][c]);
          acc[a][b][c] += edge[a][b >> 1][b & 1][c];
        }

    float s = 0.f;
#pragma unroll
    for (int p = 0; p < 2; ++p) s += pooled_row_sum(acc[2 * p], acc[2 * p + 1], 4 * hb + 2 * wg + p, warp, g, bias_c);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) scr[8 * buf + (tid >> 5)] = s;
    fence_async_shared();
    __syncthreads();  // the next box is in, both warpgroups are done with this one, scr is written
    if (tid == 0) {
      float tot = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) tot += scr[8 * buf + i];
      partial[tile] = tot;
    }
    buf ^= 1;
  }
}

}  // namespace lab

extern "C" int lab_run(const float* x, const float* packed, const float* bias, float* partial, int batch, void* stream) {
  static int sms = 0;
  if (!sms) {
    cudaFuncSetAttribute(lab::divmax_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lab::kSmemFloats * 4);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  }
  const int tiles = batch * lab::kPD * lab::kHB;
  const int grid = tiles < sms ? tiles : sms;
  lab::divmax_kernel<<<grid, lab::kThreads, lab::kSmemFloats * 4, static_cast<cudaStream_t>(stream)>>>(x, packed, bias, partial, batch);
  return static_cast<int>(cudaGetLastError());
}
