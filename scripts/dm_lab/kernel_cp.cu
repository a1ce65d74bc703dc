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
// LAB_SLOTS: depth slots of the ring (4; 6: the next step's depths are stored before the barrier).
// LAB_NOAHEAD: no row-ahead window loads.
// LAB_PRE: slots of the next step's fill whose loads are issued before this step's MMAs (0..3).
// Timing only: LAB_NOFILL (no refills), LAB_NOMMA (no MMAs).
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
#ifndef LAB_PRE
#define LAB_PRE 0
#endif
#ifndef LAB_SLOTS
#define LAB_SLOTS 4
#endif

namespace lab {

constexpr int kCin = 8, kD = 16, kH = 64, kW = 64;
constexpr int kPD = 7, kPH = 31, kPW = 31;
constexpr int kWarpsH = LAB_WH, kWarpsW = 2, kWarps = kWarpsH * kWarpsW, kThreads = 32 * kWarps;
constexpr int kTH = 2 * kWarpsH;            // output rows of a tile
constexpr int kHB = (62 + kTH - 1) / kTH;   // row blocks per plane pair
constexpr int kBD = LAB_SLOTS, kBH = kTH + 2, kBW = 68;  // box: a ring of kBD depth slots; columns 64..67 stay zero
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

// Fills depths d0 .. d0 + kCount - 1 of step `step`'s sample and row block into their ring slots (depth d in
// slot d % 4) through registers: a slot (pair plane q, box row bh, 4 columns) per thread and kSlotsPerThread
// slots, the depths at compile-time offsets in x; rows past the input are zeros.
constexpr int kSlots = 4 * kBH * (kW / 4), kSlotsPerThread = kSlots / kThreads;
static_assert(kSlots % kThreads == 0, "whole slots per thread");
// Slots kM0 .. kM1 - 1 of this thread: the loads (into v) and the stores (rounded to TF32, interleaved).
template <int kCount, int kM0, int kM1>
__device__ __forceinline__ void load_slots(float4 (*v)[kCount][2], const float* __restrict__ x, int step, int d0, int tid) {
  asm volatile("" : "+r"(tid));  // recomputed per step (hoisted out of the loop, the offsets cost registers)
  const int n = step / (kPD * kHB), hb = (step / kPD) % kHB;
  constexpr int kDepth = kH * kW, kChan = kD * kH * kW;
  const float* xs = x + static_cast<long long>(n) * kCin * kChan + d0 * kDepth + hb * kTH * kW;
#pragma unroll
  for (int m = kM0; m < kM1; ++m) {
    const int s = tid + m * kThreads, q = s / (kBH * 16), bh = (s / 16) % kBH, col = s % 16;
    const bool ok = hb * kTH + bh < kH;
    const float* src = xs + q * kChan + bh * kW + 4 * col;
#pragma unroll
    for (int i = 0; i < kCount; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        v[m - kM0][i][e] = ok ? __ldg(reinterpret_cast<const float4*>(src + i * kDepth + 4 * e * kChan)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

template <int kCount, int kM0, int kM1>
__device__ __forceinline__ void store_slots(float* box, const float4 (*v)[kCount][2], int d0, int tid) {
  asm volatile("" : "+r"(tid));
#pragma unroll
  for (int m = kM0; m < kM1; ++m) {
    const int s = tid + m * kThreads, q = s / (kBH * 16), bh = (s / 16) % kBH, col = s % 16;
    float* row = box + q * kPair + (bh * kBW + 4 * col) * 2;
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      float4* dst = reinterpret_cast<float4*>(row + ((d0 + i) % kBD) * kBH * kBW * 2);
      const float4 a = v[m - kM0][i][0], b = v[m - kM0][i][1];
      dst[0] = make_float4(to_tf32(a.x), to_tf32(b.x), to_tf32(a.y), to_tf32(b.y));
      dst[1] = make_float4(to_tf32(a.z), to_tf32(b.z), to_tf32(a.w), to_tf32(b.w));
    }
  }
}

template <int kCount>
__device__ __forceinline__ void fill_depths(float* box, const float* __restrict__ x, int step, int d0, int tid) {
  float4 v[kSlotsPerThread][kCount][2];
  load_slots<kCount, 0, kSlotsPerThread>(v, x, step, d0, tid);
  store_slots<kCount, 0, kSlotsPerThread>(box, v, d0, tid);
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
  // steps (sample, row block, plane pair pd), pd fastest: this CTA's contiguous share; along pd the box is a
  // ring of depth slots, so a step loads only its two new depths
  const int begin = static_cast<long long>(blockIdx.x) * tiles / gridDim.x;
  const int end = static_cast<long long>(blockIdx.x + 1) * tiles / gridDim.x;
  if (begin < end) fill_depths<4>(box, x, begin, 2 * (begin % kPD), tid);
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
  for (int tile = begin; tile < end; ++tile) {
    const int rot = 2 * (tile % kPD) % kBD;  // the ring slot of box depth 0
    const int next = tile + 1, npd = next % kPD;
    // the next step's two new depths of the first kPre slots, loaded now, stored after this step's MMAs
    constexpr int kPre = LAB_PRE;
    float4 pv[kPre > 0 ? kPre : 1][2][2];
    if constexpr (kPre > 0) {
      if (next < end && npd != 0) load_slots<2, 0, kPre>(pv, x, next, 2 * npd + 2, tid);
    }
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
      // box row r of depths kd (plane 0) and kd + 1 (plane 1), loaded one row ahead of its MMAs; the MMAs of a
      // row keep up to 16 accumulators between an MMA and the next one on the same accumulator
      float v[2][12], vn[2][12];
      auto load_row = [&](float (&w)[2][12], int r) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float4* p = reinterpret_cast<const float4*>(wb + (((rot + kd + j) % kBD) * kBH + r) * kBW * 2);
          const float4 q0 = p[0], q1 = p[1], q2 = p[2];
          w[j][0] = q0.x, w[j][1] = q0.y, w[j][2] = q0.z, w[j][3] = q0.w, w[j][4] = q1.x, w[j][5] = q1.y;
          w[j][6] = q1.z, w[j][7] = q1.w, w[j][8] = q2.x, w[j][9] = q2.y, w[j][10] = q2.z, w[j][11] = q2.w;
        }
      };
#ifdef LAB_NOAHEAD  // each row's window loaded right before its MMAs (24 registers fewer)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        load_row(v, r);
#else
      load_row(v, 0);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r < 3) load_row(vn, r + 1);
#endif
#ifdef LAB_NOMMA  // timing only
        if (v[0][0] == 1.2345e-38f && v[1][5] == 1.2345e-38f) acc[0][0][0][0] += 1.f;
#else
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
#endif
#ifndef LAB_NOAHEAD
        if (r < 3) {
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int k = 0; k < 12; ++k) v[j][k] = vn[j][k];
        }
#endif
      }
    }

    // with 6 slots the next step's two new depths go to the two slots this step does not read: stored now
    constexpr bool kEarly = kBD == 6 && LAB_PRE == kSlotsPerThread;
    if constexpr (kEarly) {
      if (next < end && npd != 0) store_slots<2, 0, LAB_PRE>(box, pv, 2 * npd + 2, tid);
    }

    // 2^3 max pool in the thread (planes j, rows i, n-tiles 2 jp, 2 jp + 1), + bias, / 2, summed.
    const int hb = tile / kPD % kHB, ph = hb * kTH / 2 + hp;
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
#ifdef LAB_NOFILL  // timing only: every step computes on the first step's box
    if (false) {
#else
    if (next < end && (npd == 0 || !kEarly)) {  // (early stores are visible after the barrier above)
#endif
      if (npd == 0) {
        fill_depths<4>(box, x, next, 0, tid);  // a new row block: the whole box
      } else {
        // its two new depths, into the slots of the two retired
        if constexpr (kPre > 0 && !kEarly) store_slots<2, 0, kPre>(box, pv, 2 * npd + 2, tid);
        if constexpr (kPre < kSlotsPerThread) {
          float4 v[kSlotsPerThread - kPre > 0 ? kSlotsPerThread - kPre : 1][2][2];
          load_slots<2, kPre, kSlotsPerThread>(v, x, next, 2 * npd + 2, tid);
          store_slots<2, kPre, kSlotsPerThread>(box, v, 2 * npd + 2, tid);
        }
      }
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
  const int grid = tiles < slots ? tiles : slots;  // persistent: each CTA a contiguous share of the steps
  lab::cp_kernel<<<grid, lab::kThreads, lab::kSmemFloats * 4, static_cast<cudaStream_t>(stream)>>>(x, packed, bias, partial, batch);
  return static_cast<int>(cudaGetLastError());
}
