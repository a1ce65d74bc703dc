// dm_lab, warp-specialized: the MMAs of kernel.cu in one consumer warpgroup, the box loads in a producer
// warpgroup (kernel.cu's loads, issued by the warps that issue the MMAs, did not overlap them: 0.544 ms
// against 0.267 without the loads).
//
// Consumer (warpgroup 0): a tile is 8 output rows (8 m-blocks of 64 w) x 2 output planes x 16 channels; every
// box depth sd = 0..3 is one m64n32k8 per (kh, kw, m-block): the weights are packed as 5 blocks of 16
// channels [zero, kd 2, kd 1, kd 0, zero], so depth sd reads blocks 3 - sd, 4 - sd (plane 0: tap sd, plane
// 1: tap sd - 1; a zero block where the tap does not exist). 128 accumulators, no separate edge sets.
// A zero weight times an infinite input is NaN where eager has +-inf: this form fails the lab's inf case
// (CHECK FAILED there); it is kept for its timings (notes/perf.md stop 25).
// Producer (warpgroup 1): fills the other box buffer; full / empty named barriers per buffer.
#include "box.cuh"

using namespace kgen::conv_gemm;

namespace lab {

constexpr int kTapFloats = kQuads * 80 * 4;  // per (kh, kw): [quad][5 blocks x 16 channels][4]
constexpr int kWFloats = 9 * kTapFloats;
constexpr int kOffW = 2 * kBoxFloats, kOffScr = kOffW + kWFloats, kSmemFloats = kOffScr + 8;
constexpr int kThreads = 256;
constexpr int kPerThread = (kItems + 127) / 128;  // the producer's items per tile
#ifndef LAB_INFLIGHT
#define LAB_INFLIGHT 2
#endif
constexpr int kInflight = LAB_INFLIGHT;
enum Barrier { kFull0 = 1, kEmpty0 = 3, kConsumers = 5 };

__device__ __forceinline__ void named_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }

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
  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();

  if (wg == 1) {  // producer
    int i = 0;
#pragma unroll 1
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
      const int b = i & 1;
      float* box = smem + b * kBoxFloats;
      if (i >= 2) named_sync(kEmpty0 + b, kThreads);
#ifdef LAB_CPASYNC
      // 4-byte asynchronous copies straight into the interleaved layout (consecutive threads: consecutive w),
      // then the producer rounds the box in place.
      {
        const int n = tile / (kPD * kHB), pd = (tile / kHB) % kPD, hb = tile % kHB;
        const int w = lt % kW;
        const float* xs = x + (static_cast<long long>(n) * kCin * kD + 2 * pd) * kH * kW + 8 * hb * kW + w;
#pragma unroll 8
        for (int k = 0; k < kCin * kBD * kBH * kW / 128; ++k) {
          const int rc = lt / kW + 2 * k, rr = rc % (kBD * kBH), ch = rc / (kBD * kBH);
          const int bd = rr / kBH, bh = rr % kBH;
          const bool ok = 8 * hb + bh < kH;
          cp_async4(box + (((ch >> 2) * kBD * kBH + rr) * kBW + w) * 4 + (ch & 3), xs + (ch * kD + bd) * kH * kW + (ok ? bh : 0) * kW, ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        named_sync(6, 128);  // every producer thread's copies have landed
        float4* b4 = reinterpret_cast<float4*>(box);
#pragma unroll 4
        for (int f = lt; f < kRows * kBW; f += 128) {
          const float4 v = b4[f];
          b4[f] = make_float4(to_tf32(v.x), to_tf32(v.y), to_tf32(v.z), to_tf32(v.w));
        }
      }
#else
#pragma unroll 1
      for (int k0 = 0; k0 < kPerThread; k0 += kInflight) {
        BoxItem it[kInflight];
#pragma unroll
        for (int k = 0; k < kInflight; ++k)
          if (k0 + k < kPerThread) item_load<128>(it[k], x, tile, k0 + k, lt);
#pragma unroll
        for (int k = 0; k < kInflight; ++k)
          if (k0 + k < kPerThread) item_store(it[k], box);
      }
#endif
      fence_async_shared();
      named_arrive(kFull0 + b, kThreads);
    }
    return;
  }

  // consumer
  float bias_c[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) bias_c[c] = __ldg(bias + 8 * (c >> 1) + 2 * t + (c & 1));
  const uint64_t w_desc = smem_desc(smem_addr(wts), 80 * 16, 128);
  float acc[8][4][4];
  int i = 0;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++i) {
    const int hb = tile % kHB, b = i & 1;
    const uint64_t a_desc = smem_desc(smem_addr(smem + b * kBoxFloats), kBoxPos * 16, 128);
#pragma unroll
    for (int a = 0; a < 8; ++a)
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[a][nb][c] = 0.f;
          pin(acc[a][nb][c]);
        }
    named_sync(kFull0 + b, kThreads);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < 9; ++step) {
      const int kh = step / 3, kw = step % 3;
      const uint64_t wb = w_desc + (step * kTapFloats) / 4;
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        const uint64_t ab = a_desc + ((mb + kh) * kBW + kw);
#pragma unroll
        for (int sd = 0; sd < 4; ++sd) Wgmma<32>::mma(acc[mb], ab + sd * kBH * kBW, wb + (3 - sd) * 16);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    named_arrive(kEmpty0 + b, kThreads);  // the producer may refill this buffer
#pragma unroll
    for (int a = 0; a < 8; ++a)
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
#pragma unroll
        for (int c = 0; c < 4; ++c) pin(acc[a][nb][c]);
    float s = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) s += pooled_row_sum(acc[2 * p], acc[2 * p + 1], 4 * hb + p, warp, g, bias_c);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) scr[4 * b + warp] = s;
    named_sync(kConsumers, 128);
    if (lt == 0) partial[tile] = scr[4 * b] + scr[4 * b + 1] + scr[4 * b + 2] + scr[4 * b + 3];
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
