// pool_ring.cuh: a 3 x 3 x 3 convolution into at most 16 channels (stride 1, no padding), then a
// 2 x 2 x 2 max pool, then everything reduced: one mma.sync kernel (TF32, fp32 accumulators) whose
// epilogue is the pool_reduce stage's math. The convolution output is never written. Ordinary C++
// templates: the generated stage supplies a problem struct `P` (members below) and an epilogue struct `E`.
//
// The GEMM is turned around: M = the 16 output channels (one m16 tile: a tap's weights are one A
// fragment, a register quad loaded with one LDS.128), N = 8 output positions, K = 8 input channels of a
// tap. With M = positions (the window loop), a thread's A fragment is a position pair of its input window
// and ptxas copies the odd-kw ones into fresh register quads; here a B fragment is (channel t, channel t + 4)
// at one position, and the input box is stored as such pairs ([octet][4 pair planes][ring slot][h][w][2]),
// so one LDS.128 gives two positions' fragments as two aligned register pairs: no moves.
//
// A warp: 2 output planes x 2 rows x 32 columns x 16 channels (4 n-tiles per row; lane group g owns the
// columns 4 b(g) + jn, jn < 4, b(g) = (g & 4) | (g & 1) << 1 | (g >> 1) & 1), so the thread's window is 6
// columns of a box row (3 LDS.128), used by 4 n-tiles x 3 kw taps, and the 2 x 2 x 2 pool windows are the
// thread's own accumulators (planes, rows, n-tiles jn, jn + 1). Pair planes are 4 mod 32 floats apart and b
// differs by 2 in a quarter-warp, so an LDS.128 meets 8 different 16-byte bank groups.
// A CTA (4 warps: 2 row pairs x 2 column halves) computes a step: sample n, 4 output rows (row block rb),
// output planes 2 pd, 2 pd + 1. A CTA takes a contiguous share of the steps, pd fastest, and its box is a ring
// of 4 depth slots (depth d in slot d % 4): a step loads only its 2 new depths, issued into registers before
// its MMAs and stored (rounded to TF32, interleaved) once every warp is done with the box.
// Per step, the threads' pooled values are combined in a fixed order into one partial (E::write); where the
// reduction keeps the channels (P::kPerChannel), into one partial per channel (the lanes of a channel pair,
// then the warps, in order).
//
// 16-bit input (P::Elem, conv_gemm.cuh): a fill loads 4 values as stored (8 bytes) and converts them as it
// stores them to the ring (every 16-bit value is exact in TF32); the weights come packed from the binding's
// fp32 copy. Before the epilogue's first op each accumulator becomes the convolution's output as eager's
// tensor holds it (conv_output: rounded to Elem where P::kRoundOutput says, plus the bias where E::kConvBias
// says, rounded again).
//
// Measured (docs/performance.md, edd7557; lab dm_lab/kernel_cp.cu): div_max_gap_bias_sum's 8 -> 16
// convolution + pool + sum at batch 128 in 0.273 ms on the H100 against the window loop's 0.338.
//
// Members of P (all static constexpr):
//   kCin, kCout                     channels (kCin a multiple of 8; kCout at most 16)
//   kInD, kInH, kInW                input size (kInW a multiple of 4, at most 64)
//   kPooledD, kPooledH, kPooledW    pooled output size (floor mode)
//   kPerChannel                     (optional, false where absent) a partial per step and channel
//   Elem, kRoundOutput              (16-bit plans) the input's type; whether the output is rounded to it
// E: Params; pre(p, n, c, d, h, w, v) (the stage's ops before the pool), post(p, n, c, pd, ph, pw, v) (after
// it), identity(), combine(a, b), write(p, n, j, v) (the partial of step j of sample n; per channel:
// write(p, n, j, c, v)).
#pragma once

#include "conv_gemm.cuh"

namespace kgen {
namespace conv_gemm {
namespace pool_ring {

constexpr int kThreads = 128;   // 4 warps
constexpr int kCtasPerSm = 2;   // ptxas's register budget (the prefetch: the lab's 190 registers)
constexpr int kKernel = 3;      // taps per dim
constexpr int kTaps = kKernel * kKernel * kKernel;
constexpr int kRowsPerStep = 4;  // output rows of a step (2 warp row pairs)
constexpr int kRing = 4;         // depth slots: a step's 2 planes read 4 depths
constexpr int kBoxRows = kRowsPerStep + kKernel - 1;
constexpr int kBoxW = 68;        // columns of a box row: 64 computed + 2 of halo, rounded to 4; past kInW zero
constexpr int kPrefetchSlots = 3;  // fill slots of a thread loaded before the MMAs (the rest after)

// Whether the reduction keeps the channels (P::kPerChannel): a partial per step and channel.
template <class P, class = void>
struct PerChannel : std::false_type {};
template <class P>
struct PerChannel<P, std::void_t<decltype(P::kPerChannel)>> : std::bool_constant<P::kPerChannel> {};
template <class P>
inline constexpr bool kPerChannel = PerChannel<P>::value;

template <class P>
struct RingGeometry {
  static_assert(P::kCin % 8 == 0 && P::kCout <= 16, "8k input channels, at most 16 output channels");
  static_assert(P::kInW % 4 == 0 && P::kInW <= 64, "input rows of at most 64 positions, 16-byte pieces");
  static constexpr int kOctets = P::kCin / 8;
  static constexpr int kRowBlocks = (2 * P::kPooledH + kRowsPerStep - 1) / kRowsPerStep;
  static constexpr int kSteps = P::kPooledD * kRowBlocks;  // per sample: the partials stage E combines
  static constexpr int kPair = (kRing * kBoxRows * kBoxW * 2 + 31) / 32 * 32 + 4;  // pair plane stride: 4 mod 32
  static constexpr int kBoxFloats = kOctets * 4 * kPair;
  static constexpr int kPackedFloats = kOctets * kTaps * 32 * 4;  // [octet][tap][lane][4]: A fragments
  static constexpr int kKept = kPerChannel<P> ? 16 : 1;           // partials per step (per channel: one m16 tile's)
  static constexpr int kScratchFloats = 2 * (kThreads / 32) * kKept;  // per-warp sums, two steps apart
  static constexpr int kSmemBytes = 4 * (kBoxFloats + kPackedFloats + kScratchFloats);
  static constexpr int kPieces = P::kInW / 4;  // 16-byte pieces of an input row
  static constexpr int kSlots = kOctets * 4 * kBoxRows * kPieces;  // (pair plane, box row, piece) of a fill
  static constexpr int kSlotsPerThread = (kSlots + kThreads - 1) / kThreads;
  static constexpr int kPre = kSlotsPerThread < kPrefetchSlots ? kSlotsPerThread : kPrefetchSlots;
};

__device__ __forceinline__ int column_block(int n) { return (n & 4) | (n & 1) << 1 | (n >> 1) & 1; }  // b(n)

// Fill slot s of a box: (pair plane q, box row bh, 16-byte piece of the row).
struct Slot {
  int q, bh, piece;
};
template <class P>
__device__ __forceinline__ Slot slot_of(int s) {
  constexpr int kPieces = RingGeometry<P>::kPieces;
  return Slot{s / (kBoxRows * kPieces), (s / kPieces) % kBoxRows, s % kPieces};
}

// Thread tid's fill slots kM0 .. kM1 - 1 (slot tid + m kThreads): the kCount depths d0.. of (sample n, row
// block rb) from x into registers as stored (rows past the input: zeros), then converted, rounded and
// interleaved into their ring slots. The slots' offsets are recomputed per step: hoisted out of the step loop
// they held ~80 registers.
template <class P, int kCount, int kM0, int kM1>
__device__ __forceinline__ void load_slots(Quad<P> (*v)[kCount][2], const Elem<P>* __restrict__ x, int n, int rb, int d0, int tid) {
  using G = RingGeometry<P>;
  asm volatile("" : "+r"(tid));
  constexpr long long kDepth = static_cast<long long>(P::kInH) * P::kInW, kChan = P::kInD * kDepth;
  const Elem<P>* xs = x + static_cast<long long>(n) * P::kCin * kChan + d0 * kDepth + rb * kRowsPerStep * P::kInW;
#pragma unroll
  for (int m = kM0; m < kM1; ++m) {
    const int s = tid + m * kThreads;
    const Slot sl = slot_of<P>(s);
    const bool ok = (G::kSlots % kThreads == 0 || s < G::kSlots) && rb * kRowsPerStep + sl.bh < P::kInH;
    const Elem<P>* src = xs + (8 * (sl.q / 4) + sl.q % 4) * kChan + sl.bh * P::kInW + 4 * sl.piece;
#pragma unroll
    for (int i = 0; i < kCount; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e)  // channels q and q + 4 of the octet
        v[m - kM0][i][e] = load_quad(src + i * kDepth + 4 * e * kChan, ok);
  }
}

template <class P, int kCount, int kM0, int kM1>
__device__ __forceinline__ void store_slots(float* box, const Quad<P> (*v)[kCount][2], int d0, int tid) {
  using G = RingGeometry<P>;
  asm volatile("" : "+r"(tid));
#pragma unroll
  for (int m = kM0; m < kM1; ++m) {
    const int s = tid + m * kThreads;
    if (G::kSlots % kThreads != 0 && s >= G::kSlots) break;
    const Slot sl = slot_of<P>(s);
    float* row = box + sl.q * G::kPair + (sl.bh * kBoxW + 4 * sl.piece) * 2;
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      float4* dst = reinterpret_cast<float4*>(row + ((d0 + i) % kRing) * kBoxRows * kBoxW * 2);
      const float4 a = quad_values<Elem<P>>(v[m - kM0][i][0]), b = quad_values<Elem<P>>(v[m - kM0][i][1]);
      constexpr bool kEven = P::kTf32HalfEven;
      dst[0] = make_float4(to_tf32_operand<kEven>(a.x), to_tf32_operand<kEven>(b.x), to_tf32_operand<kEven>(a.y), to_tf32_operand<kEven>(b.y));
      dst[1] = make_float4(to_tf32_operand<kEven>(a.z), to_tf32_operand<kEven>(b.z), to_tf32_operand<kEven>(a.w), to_tf32_operand<kEven>(b.w));
    }
  }
}

// Depths d0 .. d0 + kCount - 1 of slots kM0 .. kM1 - 1 (default: all of the thread's), loaded and stored.
template <class P, int kCount, int kM0 = 0, int kM1 = RingGeometry<P>::kSlotsPerThread>
__device__ __forceinline__ void fill(float* box, const Elem<P>* __restrict__ x, int n, int rb, int d0, int tid) {
  Quad<P> v[kM1 - kM0][kCount][2];
  load_slots<P, kCount, kM0, kM1>(v, x, n, rb, d0, tid);
  store_slots<P, kCount, kM0, kM1>(box, v, d0, tid);
}

template <class P, class E>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    pool_ring_kernel(const Elem<P>* __restrict__ x, const float* __restrict__ packed, const typename E::Params ep, int batch) {
  using G = RingGeometry<P>;
  extern __shared__ __align__(16) float smem[];
  float* box = smem;
  float* wts = smem + G::kBoxFloats;
  float* scr = wts + G::kPackedFloats;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int hp = warp >> 1, wh = warp & 1;  // row pair, column half
  const long long steps = static_cast<long long>(batch) * G::kSteps;
  const long long begin = blockIdx.x * steps / gridDim.x, end = (blockIdx.x + 1) * steps / gridDim.x;

  for (int e = tid; e < G::kPackedFloats / 4; e += kThreads) cp_async16(wts + 4 * e, packed + 4 * e, true);
  cp_async_commit();
  constexpr int kZeroPieces = (kBoxW - P::kInW) / 2;  // float4s of the columns past the input, per row
  for (int e = tid; e < G::kOctets * 4 * kRing * kBoxRows * kZeroPieces; e += kThreads) {
    const int r = e / kZeroPieces, q = r / (kRing * kBoxRows), row = r % (kRing * kBoxRows);
    *reinterpret_cast<float4*>(box + q * G::kPair + (row * kBoxW + P::kInW) * 2 + 4 * (e % kZeroPieces)) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (begin < end) {
    const int n = static_cast<int>(begin / G::kSteps), j = static_cast<int>(begin % G::kSteps);
    fill<P, kRing>(box, x, n, j / P::kPooledD, 2 * (j % P::kPooledD), tid);
  }
  cp_async_wait<0>();
  __syncthreads();

  const int woff = 32 * wh + 4 * column_block(g);  // the thread's window columns
  int parity = 0;
#pragma unroll 1
  for (long long step = begin; step < end; ++step) {
    const int n = static_cast<int>(step / G::kSteps), j = static_cast<int>(step % G::kSteps);
    const int rb = j / P::kPooledD, pd = j % P::kPooledD;
    const int rot = 2 * (pd % 2);  // the ring slot of depth 2 pd
    // the next step of this sample and row block: its two new depths of the first kPre slots, loaded now
    const bool next_in_ring = step + 1 < end && pd + 1 < P::kPooledD;
    Quad<P> pre[G::kPre][2][2];
    if (next_in_ring) load_slots<P, 2, 0, G::kPre>(pre, x, n, rb, 2 * pd + 4, tid);

    float acc[2][2][4][4];  // [plane j][row i][n-tile jn][fragment]
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int d = 0; d < 4; ++d) acc[a][b][c][d] = 0.f;
#pragma unroll 1
    for (int ok = 0; ok < G::kOctets * kKernel; ++ok) {  // (octet, kd)
      const int oct = ok / kKernel, kd = ok % kKernel;
      float a[kKernel * kKernel][4];  // this kd's taps
#pragma unroll
      for (int i = 0; i < kKernel * kKernel; ++i) {
        const float4 w = *reinterpret_cast<const float4*>(wts + ((ok * kKernel * kKernel + i) * 32 + lane) * 4);
        a[i][0] = w.x, a[i][1] = w.y, a[i][2] = w.z, a[i][3] = w.w;
      }
      const float* wb = box + (4 * oct + t) * G::kPair + (2 * hp * kBoxW + woff) * 2;
      // box row r of depths 2 pd + kd (plane 0) and + 1 (plane 1), loaded a row ahead of its MMAs
      float v[2][12], vn[2][12];
      auto load_row = [&](float (&win)[2][12], int r) {
#pragma unroll
        for (int pl = 0; pl < 2; ++pl) {
          const float4* p = reinterpret_cast<const float4*>(wb + (((rot + kd + pl) % kRing) * kBoxRows + r) * kBoxW * 2);
          const float4 q0 = p[0], q1 = p[1], q2 = p[2];
          win[pl][0] = q0.x, win[pl][1] = q0.y, win[pl][2] = q0.z, win[pl][3] = q0.w, win[pl][4] = q1.x, win[pl][5] = q1.y;
          win[pl][6] = q1.z, win[pl][7] = q1.w, win[pl][8] = q2.x, win[pl][9] = q2.y, win[pl][10] = q2.z, win[pl][11] = q2.w;
        }
      };
      load_row(v, 0);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r < 3) load_row(vn, r + 1);
        // up to 16 accumulators between an MMA and the next on the same accumulator
#pragma unroll
        for (int kw = 0; kw < kKernel; ++kw)
#pragma unroll
          for (int pl = 0; pl < 2; ++pl)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int kh = r - i;
              if (kh < 0 || kh >= kKernel) continue;
#pragma unroll
              for (int jn = 0; jn < 4; ++jn)
                mma_tf32(acc[pl][i][jn], a[kh * kKernel + kw], v[pl][2 * (jn + kw)], v[pl][2 * (jn + kw) + 1]);
            }
        if (r < 3) {
#pragma unroll
          for (int pl = 0; pl < 2; ++pl)
#pragma unroll
            for (int k = 0; k < 12; ++k) v[pl][k] = vn[pl][k];
        }
      }
    }

    // The pool windows in the thread: planes, rows, n-tiles (2 jp, 2 jp + 1); channels g, g + 8; columns of
    // accumulator half h: block b(2 t + h). Coordinates are clamped into the pooled windows for E (loads stay
    // in bounds, also of a cropped output); windows outside the pooled output are left out.
    const int ph = rb * (kRowsPerStep / 2) + hp;
    float s = E::identity();
    float sc[2] = {E::identity(), E::identity()};  // per channel (kPerChannel): channels g, g + 8
    (void)s, (void)sc;  // (one of the two is unused)
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      const int c = g + 8 * ch, cc = min(c, P::kCout - 1);
      const float bias = conv_bias_value<E>(ep, cc);
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          const int pw = 16 * wh + 2 * column_block(2 * t + half) + jp;
          float m = -INFINITY;
#pragma unroll
          for (int pl = 0; pl < 2; ++pl)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                if constexpr (E::kPreIdentity) {  // conv_output once, on the max (conv_gemm.cuh)
                  m = kgen::max_nan(m, acc[pl][i][2 * jp + e][2 * ch + half]);
                } else {
                  const int oh = min(2 * ph + i, 2 * P::kPooledH - 1), ow = min(2 * pw + e, 2 * P::kPooledW - 1);
                  const float v = conv_output<P, E>(acc[pl][i][2 * jp + e][2 * ch + half], bias);
                  m = kgen::max_nan(m, E::pre(ep, n, cc, 2 * pd + pl, oh, ow, v));
                }
              }
          if constexpr (E::kPreIdentity) m = conv_output<P, E>(m, bias);
          const bool in = c < P::kCout && ph < P::kPooledH && pw < P::kPooledW;
          const float w = E::post(ep, n, cc, pd, min(ph, P::kPooledH - 1), min(pw, P::kPooledW - 1), m);
          if constexpr (kPerChannel<P>) {
            sc[ch] = E::combine(sc[ch], in ? w : E::identity());
          } else {
            s = E::combine(s, in ? w : E::identity());
          }
        }
    }
    if constexpr (kPerChannel<P>) {
      // a channel's values: the 4 lanes t of its lane group g, then the 4 warps, in order
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) sc[ch] = E::combine(sc[ch], __shfl_xor_sync(0xffffffffu, sc[ch], o));
        if (t == 0) scr[(parity * 4 + warp) * 16 + g + 8 * ch] = sc[ch];
      }
      __syncthreads();  // every warp is done with the box and has written its sums
      if (tid < P::kCout) {
        float tot = E::identity();
#pragma unroll
        for (int i = 0; i < 4; ++i) tot = E::combine(tot, scr[(parity * 4 + i) * 16 + tid]);
        E::write(ep, n, j, tid, tot);
      }
    } else {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s = E::combine(s, __shfl_xor_sync(0xffffffffu, s, o));
      if (lane == 0) scr[parity * 4 + warp] = s;
      __syncthreads();  // every warp is done with the box and has written its sum
      if (tid == 0) {
        float tot = E::identity();
#pragma unroll
        for (int i = 0; i < 4; ++i) tot = E::combine(tot, scr[parity * 4 + i]);
        E::write(ep, n, j, tot);
      }
    }
    if (step + 1 < end) {
      if (next_in_ring) {  // the two new depths into the slots of the two retired
        store_slots<P, 2, 0, G::kPre>(box, pre, 2 * pd + 4, tid);
        if constexpr (G::kPre < G::kSlotsPerThread) fill<P, 2, G::kPre>(box, x, n, rb, 2 * pd + 4, tid);
      } else {  // a new sample or row block: the whole box
        const int nj = (j + 1) % G::kSteps, nn = n + (j + 1) / G::kSteps;
        fill<P, kRing>(box, x, nn, nj / P::kPooledD, 2 * (nj % P::kPooledD), tid);
      }
      __syncthreads();
    }
    parity ^= 1;
  }
}

// Packs the weight [Cout, Cin, 3, 3, 3] into A fragments, TF32-rounded: [octet][tap][lane][4], lane 4 g + t
// holding (out g, in t), (out g + 8, in t), (out g, in t + 4), (out g + 8, in t + 4); channels past kCout zero.
template <class P>
__global__ void pool_ring_pack_kernel(const float* __restrict__ w, float* __restrict__ packed) {
  using G = RingGeometry<P>;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < G::kPackedFloats; e += gridDim.x * blockDim.x) {
    const int i = e % 4, lane = (e / 4) % 32, tap = (e / 128) % kTaps, oct = e / (128 * kTaps);
    const int co = lane / 4 + 8 * (i % 2), ci = 8 * oct + lane % 4 + 4 * (i / 2);
    packed[e] = co < P::kCout ? to_tf32_operand<P::kTf32HalfEven>(w[(co * P::kCin + ci) * kTaps + tap]) : 0.f;
  }
}

template <class P, class E>
cudaError_t run_pool_ring(const Elem<P>* x, const float* w, float* packed, bool pack, const typename E::Params& ep, int batch,
                          cudaStream_t stream) {
  using G = RingGeometry<P>;
  if (pack) {
    pool_ring_pack_kernel<P><<<(G::kPackedFloats + 255) / 256, 256, 0, stream>>>(w, packed);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // kCtasPerSm resident where the shared memory allows (8 input channels), else fewer
  KernelSetup setup;
  const cudaError_t err = kernel_setup<pool_ring_kernel<P, E>>(kThreads, G::kSmemBytes, &setup);
  if (err != cudaSuccess) return err;
  const long long steps = static_cast<long long>(batch) * G::kSteps, slots = setup.resident();
  const int grid = static_cast<int>(steps < slots ? steps : slots);  // persistent CTAs, a contiguous share of the steps each
  if (grid > 0) pool_ring_kernel<P, E><<<grid, kThreads, G::kSmemBytes, stream>>>(x, packed, ep, batch);
  return cudaGetLastError();
}

}  // namespace pool_ring
}  // namespace conv_gemm
}  // namespace kgen
