// dm_lab: kernel_cm.cu's form (mma.sync, output channels as M) with the box stored as channel pairs (kernel_cp.cu).
//
// kernel_cm.cu's B fragment (channel t, channel t + 4) at one position came from two LDS.128 vectors, so ptxas
// built a fresh aligned register pair for every MMA (IMAD.MOV: ~1163 in its SASS against 144 HMMA per kd).
// Here the box is [4 pair planes q][4 d][kBH h][kBW w][2]: element (q, d, h, w) holds (channel q, channel q + 4),
// so an LDS.128 gives the B fragments of two positions as two aligned pairs and no move is needed.
// The box is filled through registers (LDG.128 of channels q and q + 4, rounded to TF32, interleaved, STS.128)
// after the tile's epilogue, when the accumulators are dead; the other CTAs of the SM hide the loads' latency.
// Lane group g owns window columns 4 b(g) .. 4 b(g) + 5 with b(g) = (g & 4) | (g & 1) << 1 | (g >> 1) & 1:
// pair planes 4 mod 32 floats apart (q = t) and b two apart in a quarter-warp meet 8 different 16-byte groups.
//
// LAB_WH (row-pair warps, default 2), LAB_MINB (CTAs per SM for ptxas, default 3), LAB_AREG (all 27 taps'
// A fragments held in registers).
#include "conv_gemm.cuh"

using namespace kgen::conv_gemm;

#ifndef LAB_WH
#define LAB_WH 2
#endif
#ifndef LAB_MINB
#define LAB_MINB 3
#endif

namespace lab {

constexpr int kCin = 8, kD = 16, kH = 64, kW = 64;
constexpr int kPD = 7, kPH = 31, kPW = 31;
constexpr int kWarpsH = LAB_WH, kWarpsW = 2, kWarps = kWarpsH * kWarpsW, kThreads = 32 * kWarps;
constexpr int kTH = 2 * kWarpsH;            // output rows of a tile
constexpr int kHB = (62 + kTH - 1) / kTH;   // row blocks per plane pair
constexpr int kBD = 4, kBH = kTH + 2, kBW = 68;  // box; columns 64..67 stay zero
constexpr int kBoxRows = kBD * kBH;
constexpr int kPair = (kBoxRows * kBW * 2 + 31) / 32 * 32 + 4;  // pair plane stride, = 4 mod 32
constexpr int kBoxFloats = 4 * kPair;
constexpr int kWFloats = 27 * 32 * 4;       // [tap][lane][4]: the A fragment of every tap
constexpr int kOffW = kBoxFloats, kOffScr = kOffW + kWFloats, kSmemFloats = kOffScr + 2 * kWarps;
#ifdef LAB_AREG
constexpr int kKdUnroll = 3;  // areg is indexed by kd: unrolled, or it goes to local memory
#else
constexpr int kKdUnroll = 1;
#endif
static_assert(kSmemFloats * 4 * LAB_MINB <= 227 * 1024, "shared memory for LAB_MINB CTAs per SM");

__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ int block_of(int n) { return (n & 4) | (n & 1) << 1 | (n >> 1) & 1; }  // b(n)

// Fills the box of `tile` through registers: a slot (pair plane q, box row bh, 4 columns) per thread and
// kSlotsPerThread slots, each with the kBD depths at compile-time offsets (in x and in the box); rows past the
// input are zeros.
constexpr int kSlots = 4 * kBH * (kW / 4), kSlotsPerThread = kSlots / kThreads;
static_assert(kSlots % kThreads == 0, "whole slots per thread");
__device__ __forceinline__ void fill_box(float* box, const float* __restrict__ x, int tile, int tid) {
  asm volatile("" : "+r"(tid));  // recomputed per tile (hoisted out of the tile loop, the offsets cost registers)
  const int n = tile / (kPD * kHB), pd = (tile / kHB) % kPD, hb = tile % kHB;
  const float* xs = x + (static_cast<long long>(n) * kCin * kD + 2 * pd) * kH * kW + hb * kTH * kW;
  constexpr int kDepth = kH * kW, kChan = kD * kH * kW;
  float4 v[kSlotsPerThread][kBD][2];
#pragma unroll
  for (int m = 0; m < kSlotsPerThread; ++m) {
    const int s = tid + m * kThreads, q = s / (kBH * 16), bh = (s / 16) % kBH, col = s % 16;
    const bool ok = hb * kTH + bh < kH;
    const float* src = xs + q * kChan + bh * kW + 4 * col;
#pragma unroll
    for (int bd = 0; bd < kBD; ++bd)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        v[m][bd][e] = ok ? __ldg(reinterpret_cast<const float4*>(src + bd * kDepth + 4 * e * kChan)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int m = 0; m < kSlotsPerThread; ++m) {
    const int s = tid + m * kThreads, q = s / (kBH * 16), bh = (s / 16) % kBH, col = s % 16;
    float4* dst = reinterpret_cast<float4*>(box + q * kPair + (bh * kBW + 4 * col) * 2);
#pragma unroll
    for (int bd = 0; bd < kBD; ++bd) {
      const float4 a = v[m][bd][0], b = v[m][bd][1];
      dst[bd * kBH * kBW / 2] = make_float4(to_tf32(a.x), to_tf32(b.x), to_tf32(a.y), to_tf32(b.y));
      dst[bd * kBH * kBW / 2 + 1] = make_float4(to_tf32(a.z), to_tf32(b.z), to_tf32(a.w), to_tf32(b.w));
    }
  }
}

__device__ __forceinline__ void load_a(float (&a)[4], const float* wts, int tap, int lane) {
  const float4 v = *reinterpret_cast<const float4*>(wts + (tap * 32 + lane) * 4);
  a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
}

__global__ void __launch_bounds__(kThreads, LAB_MINB)
    cp_kernel(const float* __restrict__ x, const float* __restrict__ packed, const float* __restrict__ bias,
              float* __restrict__ partial, int batch) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* box = smem;
  const float* wts = smem + kOffW;
  float* scr = smem + kOffScr;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int hp = warp / kWarpsW, wh = warp % kWarpsW;
  const int tiles = batch * kPD * kHB;

  for (int e = tid; e < kWFloats / 4; e += kThreads) cp_async16(smem + kOffW + 4 * e, packed + 4 * e, true);
  cp_async_commit();
  for (int e = tid; e < 4 * kBoxRows * (kBW - kW) / 2; e += kThreads) {  // columns kW.. of every row: 0
    const int r = e / ((kBW - kW) / 2), q = r / kBoxRows, rr = r % kBoxRows;
    *reinterpret_cast<float4*>(box + q * kPair + (rr * kBW + kW) * 2 + 4 * (e % ((kBW - kW) / 2))) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (blockIdx.x < tiles) fill_box(box, x, blockIdx.x, tid);
  cp_async_wait<0>();
  __syncthreads();

  const float bias_lo = __ldg(bias + g), bias_hi = __ldg(bias + g + 8);
  const int woff = 32 * wh + 4 * block_of(g);  // the thread's window columns
#ifdef LAB_AREG
  float areg[27][4];
#pragma unroll
  for (int i = 0; i < 27; ++i) load_a(areg[i], wts, i, lane);
#endif
  int parity = 0;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float acc[2][2][4][4];  // [plane j][row i][n-tile jn][fragment]
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int d = 0; d < 4; ++d) acc[a][b][c][d] = 0.f;
    const float* wb = box + t * kPair + (2 * hp * kBW + woff) * 2;
#pragma unroll kKdUnroll
    for (int kd = 0; kd < 3; ++kd) {
#ifndef LAB_AREG
      float A[9][4];
#pragma unroll
      for (int i = 0; i < 9; ++i) load_a(A[i], wts, kd * 9 + i, lane);
#endif
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        // box row r of depths kd (plane 0) and kd + 1 (plane 1): up to 16 accumulators between an MMA and
        // the next one on the same accumulator
        float v[2][12];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float4* p = reinterpret_cast<const float4*>(wb + ((kd + j) * kBH + r) * kBW * 2);
          const float4 q0 = p[0], q1 = p[1], q2 = p[2];
          v[j][0] = q0.x, v[j][1] = q0.y, v[j][2] = q0.z, v[j][3] = q0.w, v[j][4] = q1.x, v[j][5] = q1.y;
          v[j][6] = q1.z, v[j][7] = q1.w, v[j][8] = q2.x, v[j][9] = q2.y, v[j][10] = q2.z, v[j][11] = q2.w;
        }
#pragma unroll
        for (int kw = 0; kw < 3; ++kw)
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int kh = r - i;
              if (kh < 0 || kh > 2) continue;
#ifdef LAB_AREG
              const float(&a)[4] = areg[(kd * 3 + kh) * 3 + kw];
#else
              const float(&a)[4] = A[kh * 3 + kw];
#endif
#pragma unroll
              for (int jn = 0; jn < 4; ++jn) mma_tf32(acc[j][i][jn], a, v[j][2 * (jn + kw)], v[j][2 * (jn + kw) + 1]);
            }
      }
    }

    // 2^3 max pool in the thread (planes j, rows i, n-tiles 2 jp, 2 jp + 1), + bias, / 2, summed.
    const int hb = tile % kHB, ph = hb * kTH / 2 + hp;
    float s = 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const int pw = 16 * wh + 2 * block_of(2 * t + half) + jp;
#pragma unroll
        for (int ch = 0; ch < 2; ++ch) {
          float m = -INFINITY;
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int e = 0; e < 2; ++e) m = nan_max(m, acc[j][i][2 * jp + e][2 * ch + half]);
          if (pw < kPW && ph < kPH) s += (m + (ch ? bias_hi : bias_lo)) * 0.5f;
        }
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) scr[parity * kWarps + warp] = s;
    __syncthreads();  // every warp is done with the box; scr is written
    if (tid == 0) {
      float tot = 0.f;
#pragma unroll
      for (int i = 0; i < kWarps; ++i) tot += scr[parity * kWarps + i];
      partial[tile] = tot;
    }
    const int next = tile + gridDim.x;
    if (next < tiles) {
      fill_box(box, x, next, tid);
      __syncthreads();
    }
    parity ^= 1;
  }
}

}  // namespace lab

extern "C" int lab_tiles_per_sample() { return lab::kPD * lab::kHB; }

extern "C" int lab_run(const float* x, const float* packed, const float* bias, float* partial, int batch, void* stream) {
  static int sms = 0;
  if (!sms) {
    cudaFuncSetAttribute(lab::cp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lab::kSmemFloats * 4);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  }
  const int tiles = batch * lab::kPD * lab::kHB;
  const int slots = sms * LAB_MINB;
  const int grid = tiles < slots ? tiles : slots;
  lab::cp_kernel<<<grid, lab::kThreads, lab::kSmemFloats * 4, static_cast<cudaStream_t>(stream)>>>(x, packed, bias, partial, batch);
  return static_cast<int>(cudaGetLastError());
}
