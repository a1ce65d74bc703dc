// dm_lab: div_max_gap_bias_sum on mma.sync with the output channels as M (kernel_cm.cu).
//
// Conv3d(8 -> 16, k 3) on x [N, 8, 16, 64, 64] (output 14 x 62 x 62), + bias, / 2, 2^3 max pool, then per
// sample the sum over channels and pooled positions (a partial per tile; the host adds them).
//
// The product's window loop takes M = 16 output positions, N = the 16 channels, so its A fragments are
// position pairs of the input window and ptxas copies the odd-kw ones into fresh register quads (1.2 moves per
// MMA). Turned around, M = the 16 output channels (one m16 tile, the weights: a register quad per tap, one
// LDS.128), N = 8 output positions, K = the 8 input channels of a tap. A B fragment is then (channel t,
// channel t + 4) at one position: two single registers, any window column, no pairs to straddle.
// Positions of an n-tile jn: lane group g (n = g) owns columns 4 b(g) + jn, b(g) = g / 2 + 4 (g % 2), so a
// thread's window is 6 columns of one box row per channel (two LDS.128), reused by 4 n-tiles x 3 kw taps,
// and the quarter-warps of an LDS.128 meet 8 different 16-byte bank groups (plane stride = 4 mod 32).
// A warp: 2 output planes x 2 rows x 32 columns x 16 channels (16 accumulator tiles), so the 2^3 pool is in
// the thread: planes j, rows i, n-tiles (jn, jn + 1); the accumulator's columns 2t, 2t + 1 are b = t, t + 4.
// A CTA: kWarpsH row pairs x 2 column halves; its box [8 channels][4 d][kTH + 2 h][72 w], TF32 in place.
//
// LAB_AREG: every tap's A fragment held in registers for the whole kernel (108 of them).
// LAB_WH (row-pair warps, default 4), LAB_BUFS (box buffers, 1 or 2), LAB_MINB (CTAs per SM for ptxas).
#include "conv_gemm.cuh"

using namespace kgen::conv_gemm;

#ifndef LAB_WH
#define LAB_WH 4
#endif
#ifndef LAB_BUFS
#define LAB_BUFS 2
#endif
#ifndef LAB_MINB
#define LAB_MINB 1
#endif
#ifndef LAB_KD_UNROLL
#define LAB_KD_UNROLL 1
#endif

namespace lab {

constexpr int kKdUnroll = LAB_KD_UNROLL;  // the kd loop (1: a loop; its A fragments are loaded per kd)
constexpr int kCin = 8, kD = 16, kH = 64, kW = 64;
constexpr int kPD = 7, kPH = 31, kPW = 31;
constexpr int kWarpsH = LAB_WH, kWarpsW = 2, kWarps = kWarpsH * kWarpsW, kThreads = 32 * kWarps;
constexpr int kTH = 2 * kWarpsH;            // output rows of a tile
constexpr int kHB = (62 + kTH - 1) / kTH;   // row blocks per plane pair
constexpr int kBD = 4, kBH = kTH + 2, kBW = 72;  // box; columns 64..71 stay zero
constexpr int kPlane = (kBD * kBH * kBW + 31) / 32 * 32 + 4;  // = 4 mod 32: conflict-free LDS.128 (see above)
constexpr int kBoxFloats = kCin * kPlane;
constexpr int kWFloats = 27 * 32 * 4;       // [tap][lane][4]: the A fragment of every tap
constexpr int kRows = kCin * kBD * kBH;     // box rows read from x
constexpr int kChunks = kRows * (kW / 4);   // 16-byte copies per box
constexpr int kPerThread = (kChunks + kThreads - 1) / kThreads;
constexpr int kOffW = LAB_BUFS * kBoxFloats, kOffScr = kOffW + kWFloats, kSmemFloats = kOffScr + 2 * kWarps;
static_assert(kSmemFloats * 4 <= 227 * 1024, "shared memory");

__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// The 16-byte copies of `tile`'s box that thread `tid` owns (copy k: chunk tid + k kThreads); rows past the
// input are zero-filled. With `round`, the same chunks are rounded to TF32 in place instead (after they landed).
template <bool kRound>
__device__ __forceinline__ void box_chunks(float* box, const float* __restrict__ x, int tile, int tid) {
  asm volatile("" : "+r"(tid));  // recomputed per tile: hoisted out of the tile loop, the 20 copies' offsets took ~80 registers
  const int n = tile / (kPD * kHB), pd = (tile / kHB) % kPD, hb = tile % kHB;
  const float* xs = x + (static_cast<long long>(n) * kCin * kD + 2 * pd) * kH * kW + hb * kTH * kW;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int e = tid + k * kThreads;
    if (kChunks % kThreads != 0 && e >= kChunks) break;
    const int row = e / 16, col = e % 16;
    const int bh = row % kBH, bd = (row / kBH) % kBD, c = row / (kBH * kBD);
    float* dst = box + c * kPlane + (bd * kBH + bh) * kBW + 4 * col;
    if (kRound) {
      float4 v = *reinterpret_cast<float4*>(dst);
      *reinterpret_cast<float4*>(dst) = make_float4(to_tf32(v.x), to_tf32(v.y), to_tf32(v.z), to_tf32(v.w));
    } else {
      const bool ok = hb * kTH + bh < kH;
      cp_async16(dst, ok ? xs + (c * kD + bd) * kH * kW + bh * kW + 4 * col : x, ok);
    }
  }
  if (!kRound) cp_async_commit();
}

__global__ void __launch_bounds__(kThreads, LAB_MINB)
    cm_kernel(const float* __restrict__ x, const float* __restrict__ packed, const float* __restrict__ bias,
              float* __restrict__ partial, int batch) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const float* wts = smem + kOffW;
  float* scr = smem + kOffScr;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int hp = warp / kWarpsW, wh = warp % kWarpsW;
  const int tiles = batch * kPD * kHB;

  for (int e = tid; e < kWFloats / 4; e += kThreads) cp_async16(smem + kOffW + 4 * e, packed + 4 * e, true);
  for (int e = tid; e < LAB_BUFS * kCin * kBD * kBH * 2; e += kThreads) {
    const int r = e / 2, b = r / kRows, c = (r % kRows) / (kBD * kBH), row = r % (kBD * kBH);
    *reinterpret_cast<float4*>(smem + b * kBoxFloats + c * kPlane + row * kBW + kW + 4 * (e % 2)) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (blockIdx.x < tiles) box_chunks<false>(smem, x, blockIdx.x, tid);
  cp_async_wait<0>();
  if (blockIdx.x < tiles) box_chunks<true>(smem, x, blockIdx.x, tid);
  __syncthreads();

  const float bias_lo = __ldg(bias + g), bias_hi = __ldg(bias + g + 8);
#ifdef LAB_AREG
  float Areg[27][4];
#pragma unroll
  for (int i = 0; i < 27; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(wts + (i * 32 + lane) * 4);
    Areg[i][0] = v.x, Areg[i][1] = v.y, Areg[i][2] = v.z, Areg[i][3] = v.w;
  }
#endif
  const int woff = 32 * wh + 4 * ((g >> 1) + 4 * (g & 1));  // the thread's window columns
  int buf = 0, parity = 0;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float* box = smem + buf * kBoxFloats;
    const int next = tile + gridDim.x;
    if (LAB_BUFS == 2 && next < tiles) box_chunks<false>(smem + (buf ^ 1) * kBoxFloats, x, next, tid);

    float acc[2][2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int d = 0; d < 4; ++d) acc[a][b][c][d] = 0.f;
    const float* wb = box + t * kPlane + 2 * hp * kBW + woff;
#ifdef LAB_AREG
    // every tap's A fragment in registers (Areg, loaded once); plane by plane (32 accumulators live), plane 0's
    // 2 x 2 x 2 pool partial kept in pmax
    float pmax[2][2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float acc1[2][4][4];
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int d = 0; d < 4; ++d) acc1[b][c][d] = 0.f;
#pragma unroll
      for (int kd = 0; kd < 3; ++kd)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float* p = wb + ((kd + j) * kBH + r) * kBW;
          const float4 a0 = *reinterpret_cast<const float4*>(p), a1 = *reinterpret_cast<const float4*>(p + 4);
          const float4 b0 = *reinterpret_cast<const float4*>(p + 4 * kPlane), b1 = *reinterpret_cast<const float4*>(p + 4 * kPlane + 4);
          const float lo[6] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y}, hi[6] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y};
#pragma unroll
          for (int kw = 0; kw < 3; ++kw)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int kh = r - i;
              if (kh < 0 || kh > 2) continue;
#pragma unroll
              for (int jn = 0; jn < 4; ++jn) mma_tf32(acc1[i][jn], Areg[(kd * 3 + kh) * 3 + kw], lo[jn + kw], hi[jn + kw]);
            }
        }
#pragma unroll
      for (int ch = 0; ch < 2; ++ch)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int jp = 0; jp < 2; ++jp) {
            float v = j ? pmax[ch][half][jp] : -INFINITY;
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int e = 0; e < 2; ++e) v = nan_max(v, acc1[i][2 * jp + e][2 * ch + half]);
            pmax[ch][half][jp] = v;
          }
    }
#pragma unroll
    for (int ch = 0; ch < 2; ++ch)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) acc[0][0][2 * jp][2 * ch + half] = pmax[ch][half][jp];  // read by the pool below
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int d = 0; d < 4; ++d)
            if (a || b || c % 2) acc[a][b][c][d] = -INFINITY;
#else
#pragma unroll kKdUnroll
    for (int kd = 0; kd < 3; ++kd) {
      float A[9][4];
#pragma unroll
      for (int i = 0; i < 9; ++i) {
        const float4 v = *reinterpret_cast<const float4*>(wts + ((kd * 9 + i) * 32 + lane) * 4);
        A[i][0] = v.x, A[i][1] = v.y, A[i][2] = v.z, A[i][3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float* p = wb + ((kd + j) * kBH + r) * kBW;
          const float4 a0 = *reinterpret_cast<const float4*>(p), a1 = *reinterpret_cast<const float4*>(p + 4);
          const float4 b0 = *reinterpret_cast<const float4*>(p + 4 * kPlane), b1 = *reinterpret_cast<const float4*>(p + 4 * kPlane + 4);
          const float lo[6] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y}, hi[6] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y};
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int kh = r - i;
            if (kh < 0 || kh > 2) continue;
#pragma unroll
            for (int kw = 0; kw < 3; ++kw)
#pragma unroll
              for (int jn = 0; jn < 4; ++jn) mma_tf32(acc[j][i][jn], A[kh * 3 + kw], lo[jn + kw], hi[jn + kw]);
          }
        }
    }

#endif

    // 2^3 max pool in the thread, + bias, / 2, summed over its valid pooled positions and channels.
    const int hb = tile % kHB, ph = hb * kTH / 2 + hp;
    float s = 0.f;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const int pw = 16 * wh + 8 * half + 2 * t + jp;
#pragma unroll
        for (int ch = 0; ch < 2; ++ch) {
          float v = -INFINITY;
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int e = 0; e < 2; ++e) v = nan_max(v, acc[j][i][2 * jp + e][2 * ch + half]);
          if (pw < kPW && ph < kPH) s += (v + (ch ? bias_hi : bias_lo)) * 0.5f;
        }
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) scr[parity * kWarps + warp] = s;
    if (LAB_BUFS == 2) {
      cp_async_wait<0>();
      if (next < tiles) box_chunks<true>(smem + (buf ^ 1) * kBoxFloats, x, next, tid);
    }
    __syncthreads();  // the box is read by every warp (the next one landed and rounded), scr is written
    if (tid == 0) {
      float tot = 0.f;
#pragma unroll
      for (int i = 0; i < kWarps; ++i) tot += scr[parity * kWarps + i];
      partial[tile] = tot;
    }
    if (LAB_BUFS == 1 && next < tiles) {
      box_chunks<false>(box, x, next, tid);
      cp_async_wait<0>();
      box_chunks<true>(box, x, next, tid);
      __syncthreads();
    }
    if (LAB_BUFS == 2) buf ^= 1;
    parity ^= 1;
  }
}

}  // namespace lab

extern "C" int lab_tiles_per_sample() { return lab::kPD * lab::kHB; }

extern "C" int lab_run(const float* x, const float* packed, const float* bias, float* partial, int batch, void* stream) {
  static int sms = 0;
  if (!sms) {
    cudaFuncSetAttribute(lab::cm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lab::kSmemFloats * 4);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  }
  const int tiles = batch * lab::kPD * lab::kHB;
  const int slots = sms * LAB_MINB;
  const int grid = tiles < slots ? tiles : slots;
  lab::cm_kernel<<<grid, lab::kThreads, lab::kSmemFloats * 4, static_cast<cudaStream_t>(stream)>>>(x, packed, bias, partial, batch);
  return static_cast<int>(cudaGetLastError());
}
