// phase_pool.cuh: a strided transposed 3-D convolution, then a max pool whose window is a whole number
// of stride periods, then a reduction over the channels: one kernel on sm_90a wgmma (TF32, or bf16/f16
// for 16-bit input; fp32 accumulators). The convolution output is never written. Ordinary C++ templates: the generated stage
// supplies a problem struct `P` (members below) and an epilogue struct `E` (the pool_reduce stage's
// math); the per-tap tables come as a kernel argument (PhasePoolTables).
//
// The transposed convolution is S = SD x SH x SW sub-pixel phases r, each a stride-1 correlation over
// the input: output o = s q + r reads input q + e for the taps k with (r + p - k) % s == 0,
// e = (r + p - k) / s. A pool window of s t positions per dim is t positions q of every phase, so a
// CTA that owns whole windows needs nothing from other CTAs.
//
// The GEMM is turned around, M = the 64 output channels, N = output positions: per k step one wgmma
// m64nNk8 (TF32; m64nNk16 in 16 bits) reads 2 KB of weights (A) and the N positions of the input box (B); with
// M = positions and N = 64 channels the box would be read as A at 4 KB per 65 KFLOP, the shared-memory bound
// of that form.
//
// A tile: sample n, one pooled position (pd, ph) in D and H, every pooled position in W. Its input box,
// [Cin / U units][kBD][kBH][kBW][U channels] (a unit: 16 bytes, U = 4 floats or 8 16-bit values), serves all
// phases and is loaded once per tile; a box row holds kBW positions (a multiple of 8), so the kTQH rows of one
// plane are one B descriptor (8-position groups 128 bytes apart, the two units of a k step a unit plane
// apart); columns past the
// pooled ones are computed and ignored. Two warpgroups share the box, each taking a fixed set of
// phases (balanced by taps at plan time) and streaming its weights, one tap (Cin x 64) at a time,
// through a kRing-deep cp.async ring. A phase's accumulators (kTQD planes x 64 x N) are pooled into
// running maxima as soon as its last tap is done, while the other warpgroup keeps the tensor cores
// busy. Max is exact, so the order of phases and positions leaves the result unchanged; the channel
// reduction runs in channel order (deterministic).
//
// The last round: tiles / CTAs rarely divides (maxpool_sum: 1600 tiles = 12 x 132 + 16, the last round
// 16 CTAs busy for a whole tile's time). Where the workspace allows, the last round's tiles are split
// into S parts (S = phases of the larger warpgroup; part u: each warpgroup's u-th phase), one CTA each;
// a part leaves its warpgroups' maxima in the workspace (E::workspace) and the last part of a tile to
// arrive (a counter per tile) combines them and finishes the tile.
//
// 16-bit input (P::Elem, conv_gemm.cuh): the box holds the input as stored and the MMAs are bf16/f16 ones
// (twice TF32's rate; products of 16-bit values are exact, accumulated in fp32 as TF32's were); the weights
// come packed in the dtype from the binding's fp32 copy (exact). Before the epilogue's first
// op each accumulator becomes the convolution's output as eager's tensor holds it (conv_output: rounded to
// Elem where P::kRoundOutput says, plus the bias where E::kConvBias says, rounded again).
//
// Members of P (all static constexpr):
//   kCin, kCout                     channels (kCin a multiple of 8; kCout 64: one m64 block)
//   kInD, kInH, kInW                input size
//   kSD, kSH, kSW                   stride (phases per dim)
//   kTQD, kTQH, kTQW                positions q per pool window and phase, per dim (window / stride)
//   kPooledD, kPooledH, kPooledW    pooled output size
//   kEMinD, kEMinH, kEMinW          the smallest input offset e of any tap (the box starts there)
//   kBD, kBH, kBW                   input box of a tile (positions)
//   Elem, kRoundOutput              (16-bit plans) the input's type; whether the output is rounded to it
#pragma once

#include "conv_gemm.cuh"

namespace kgen {
namespace conv_gemm {
namespace phase_pool {

constexpr int kMaxPhases = 27;       // strides up to 3 per dim
constexpr int kMaxPiecesPerWg = 128;  // taps a warpgroup streams per tile
constexpr int kRing = 4;             // weight taps in flight per warpgroup
constexpr int kMaxWorkers = 256;     // CTAs a split last round may use (the workspace holds their maxima)
constexpr int kThreads = 256;        // a CTA: two warpgroups

// What changes per tap and per phase; a kernel argument (constant bank), copied to shared memory.
struct PhasePoolTables {
  int pieces[2];                        // taps per tile of each warpgroup
  int phases[2];                        // phases of each warpgroup
  int phase[2][kMaxPhases];             // each warpgroup's phases, in order: phase index
  int taps[kMaxPhases];                 // taps of phase i
  int residue[kMaxPhases][3];           // its residues (rd, rh, rw)
  short offset[2][kMaxPiecesPerWg];     // each piece's B offset in the box (positions)
  short weight_tap[2][kMaxPiecesPerWg];  // its weight tap (kd KH + kh) KW + kw
};

template <class P>
struct PoolGeometry {
  // The MMAs' operands: float32 input as TF32 (k-steps of 8 channels), 16-bit input as stored on bf16/f16
  // wgmma (k-steps of 16). Box and weights are K-major 16-byte units: kUnitChannels channels of a position
  // (of an output channel, for the weights), 4 TF32 or 8 16-bit values; a k-step reads two units.
  // 16-bit input with Cin an odd multiple of 8: the last k-step's second unit is zeros (box and weights).
  static constexpr bool kHalfMma = kHalfInput<P>;
  static constexpr int kUnitChannels = kHalfMma ? 8 : 4;
  static_assert(P::kCin % 8 == 0 && P::kCout == 64, "phase_pool: Cin a multiple of 8, 64 output channels");
  static constexpr int kInUnits = P::kCin / kUnitChannels;                             // units of the input's channels
  static constexpr int kUnits = (P::kCin + 2 * kUnitChannels - 1) / (2 * kUnitChannels) * 2;  // whole k-steps
  static constexpr int kBoxPos = P::kBD * P::kBH * P::kBW;
  static constexpr int kBoxFloats = kUnits * kBoxPos * 4;
  static constexpr int kBoxPad = 4 * (P::kBW - P::kTQW * P::kPooledW + 1);  // garbage columns read past the box
  static constexpr int kN = P::kTQH * P::kBW;                            // positions of one wgmma (a d-plane)
  static constexpr int kJ = kN / 8;
  static constexpr int kWGroups = P::kBW / 8;
  static constexpr int kKSteps = kUnits / 2;
  static constexpr int kPieceFloats = kKSteps * 2 * P::kCout * 4;  // one tap: [k step][unit][64][16 bytes]
  static constexpr int kScrStride = P::kBW + 8;
  static constexpr int kScrFloats = P::kCout * kScrStride;
  static constexpr int kOuts = P::kCout * P::kPooledW;  // (channel, pooled w) maxima of a tile
  static constexpr int kItems = (kOuts + 127) / 128;    // per thread of a warpgroup
  static constexpr int kOffRing = kBoxFloats + kBoxPad;
  static constexpr int kOffScr = kOffRing + 2 * kRing * kPieceFloats;
  static constexpr int kOffFinal = kOffScr + 2 * kScrFloats;
  static constexpr int kOffTables = kOffFinal + kOuts;
  static constexpr int kSmemBytes = kOffTables * 4 + static_cast<int>(sizeof(PhasePoolTables));
  // The workspace: the split last round's partial maxima (per part, per warpgroup), then a counter per tile.
  static constexpr long long kWorkspaceFloats = 2LL * kMaxWorkers * kOuts + kMaxWorkers;
  static_assert(P::kBW % 8 == 0 && kN <= 128 && P::kTQD * kN / 2 <= 160, "one wgmma per d-plane, accumulators in registers");
  static_assert(kBoxPos * 16 < (1 << 18) && kSmemBytes <= 227 * 1024, "shared memory");
};

// The parts a split last round's tile runs in: the phases of the larger warpgroup (part u: each
// warpgroup's u-th phase).
__host__ __device__ inline int split_parts(const PhasePoolTables& t) { return t.phases[0] > t.phases[1] ? t.phases[0] : t.phases[1]; }

// Whether the last round (`tail` tiles) runs split into `parts` CTAs per tile: it needs the workspace,
// one CTA per part, and room for their maxima. The host and the kernel decide alike.
__host__ __device__ inline bool split_last_round(const float* workspace, int tail, int parts, int grid) {
  return workspace != nullptr && tail > 0 && tail * parts <= grid && grid <= kMaxWorkers;
}

template <class P, class E>
__global__ void __launch_bounds__(kThreads, 1)
    phase_pool_kernel(const Elem<P>* __restrict__ x, const float* __restrict__ packed, const typename E::Params ep,
                      const PhasePoolTables tables, int batch) {
  using G = PoolGeometry<P>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  float* box = smem;
  PhasePoolTables& tab = *reinterpret_cast<PhasePoolTables*>(smem + G::kOffTables);
  const int tid = threadIdx.x, wg = tid >> 7, lt = tid & 127;
  const int warp = lt >> 5, lane = lt & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < static_cast<int>(sizeof(PhasePoolTables) / 4); i += kThreads)
    reinterpret_cast<int*>(&tab)[i] = reinterpret_cast<const int*>(&tables)[i];
  for (int i = tid; i < G::kBoxPad; i += kThreads) box[G::kBoxFloats + i] = 0.f;

  const float* my_packed = packed + (wg == 0 ? 0 : tables.pieces[0]) * G::kPieceFloats;
  float* ring = smem + G::kOffRing + wg * kRing * G::kPieceFloats;
  float* scr = smem + G::kOffScr + wg * G::kScrFloats;
  float* fin = smem + G::kOffFinal;
  const int tiles = batch * P::kPooledD * P::kPooledH;
  const int grid = gridDim.x;
  // Work items: whole tiles, then (a split last round) the parts of the last round's tiles.
  const int parts = split_parts(tables);
  const int full = tiles / grid * grid, tail = tiles - full;
  float* const ws = E::workspace(ep);
  const bool split = split_last_round(ws, tail, parts, grid);
  const int items = split ? full + tail * parts : tiles;
  auto item_pb = [&](int it, int w) { return it < full || !split ? 0 : min((it - full) % parts, tab.phases[w]); };
  auto item_pe = [&](int it, int w) {
    return it < full || !split ? tab.phases[w] : min((it - full) % parts + 1, tab.phases[w]);
  };

  // The weight stream in the order the items consume it: the loader's cursor (item, phase, tap) and
  // its piece (a warpgroup's pieces are its phases' taps in order); piece_of[slot] for the MMAs.
  __shared__ int s_piece_of[2][kRing];
  int* piece_of = s_piece_of[wg];
  int l_item = blockIdx.x, l_pi = 0, l_tap = 0, l_piece = 0;
  long long loads = 0;
  auto l_first = [&] {  // the first piece of item l_item, or of a later item of this CTA's
    for (; l_item < items; l_item += grid) {
      const int pb = item_pb(l_item, wg);
      if (pb < item_pe(l_item, wg)) {
        l_pi = pb, l_tap = 0, l_piece = 0;
        for (int i = 0; i < pb; ++i) l_piece += tab.taps[tab.phase[wg][i]];
        return;
      }
    }
  };
  auto load_next = [&] {
    if (l_item < items) {
      const float* src = my_packed + l_piece * G::kPieceFloats;
      const int slot = static_cast<int>(loads % kRing);
      float* dst = ring + slot * G::kPieceFloats;
#pragma unroll
      for (int e = lt; e < G::kPieceFloats / 4; e += 128) cp_async16(dst + 4 * e, src + 4 * e, true);
      if (lt == 0) piece_of[slot] = l_piece;  // read after the barrier that publishes the piece
      ++l_piece;
      if (++l_tap == tab.taps[tab.phase[wg][l_pi]]) {
        l_tap = 0;
        if (++l_pi == item_pe(l_item, wg)) {
          l_item += grid;
          l_first();
        }
      }
    }
    ++loads;
    cp_async_commit();  // an empty group past the end keeps the counting uniform
  };
  __syncthreads();  // the tables
  l_first();
#pragma unroll
  for (int k = 0; k < kRing - 1; ++k) load_next();

  const uint64_t b_desc0 = smem_desc(smem_addr(box), G::kBoxPos * 16, 128);
  const uint64_t a_desc0 = smem_desc(smem_addr(ring), P::kCout * 16, 128);

  float acc[P::kTQD][G::kJ][4];
  long long j = 0;
#pragma unroll 1
  for (int it = blockIdx.x; it < items; it += grid) {
    const bool whole = it < full || !split;
    const int tile = whole ? it : full + (it - full) / parts;
    const int n = tile / (P::kPooledD * P::kPooledH), pd = (tile / P::kPooledH) % P::kPooledD, ph = tile % P::kPooledH;
    __syncthreads();  // both warpgroups' MMAs of the last tile are done with the box
    {
      // The box: a thread loads a unit's channels of a position (coalesced loads along W) and stores them as
      // one 16-byte unit: 4 floats rounded to TF32, or 8 16-bit values as stored.
      constexpr int kItemsBox = G::kUnits * G::kBoxPos, kBatch = 4;
      constexpr long long kC = static_cast<long long>(P::kInD) * P::kInH * P::kInW;
      const Elem<P>* xn = x + static_cast<long long>(n) * P::kCin * kC;
      // item's first channel in x (a zero where the position is outside the input: ok false)
      auto source = [&](int item, bool& ok) {
        const int bw = item % P::kBW, r = item / P::kBW, bh = r % P::kBH, bd = (r / P::kBH) % P::kBD;
        const int unit = r / (P::kBH * P::kBD);
        const int d = P::kTQD * pd + P::kEMinD + bd, h = P::kTQH * ph + P::kEMinH + bh, w = P::kEMinW + bw;
        ok = item < kItemsBox && unit < G::kInUnits && d >= 0 && d < P::kInD && h >= 0 && h < P::kInH && w >= 0 && w < P::kInW;
        return xn + G::kUnitChannels * (ok ? unit : 0) * kC + ((ok ? d : 0) * P::kInH + (ok ? h : 0)) * P::kInW + (ok ? w : 0);
      };
#pragma unroll 1
      for (int base = 0; base < kItemsBox; base += kThreads * kBatch) {
        if constexpr (G::kHalfMma) {
          uint4 v[kBatch];
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            bool ok;
            const unsigned short* p = reinterpret_cast<const unsigned short*>(source(base + tid + kThreads * k, ok));
            uint32_t pair[4];
#pragma unroll
            for (int c = 0; c < 4; ++c)
              pair[c] = ok ? static_cast<uint32_t>(__ldg(p + 2 * c * kC)) | static_cast<uint32_t>(__ldg(p + (2 * c + 1) * kC)) << 16 : 0u;
            v[k] = make_uint4(pair[0], pair[1], pair[2], pair[3]);
          }
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int item = base + tid + kThreads * k;
            if (item < kItemsBox) reinterpret_cast<uint4*>(box)[item] = v[k];
          }
        } else {
          float4 v[kBatch];
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            bool ok;
            const Elem<P>* p = source(base + tid + kThreads * k, ok);
            v[k] = ok ? make_float4(load_value(p), load_value(p + kC), load_value(p + 2 * kC), load_value(p + 3 * kC))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            const int item = base + tid + kThreads * k;
            if (item < kItemsBox)
              reinterpret_cast<float4*>(box)[item] = make_float4(to_tf32_operand<P::kTf32HalfEven>(v[k].x), to_tf32_operand<P::kTf32HalfEven>(v[k].y),
                                                                 to_tf32_operand<P::kTf32HalfEven>(v[k].z), to_tf32_operand<P::kTf32HalfEven>(v[k].w));
          }
        }
      }
    }
    fence_async_shared();  // the MMAs read the box through the async proxy
    __syncthreads();

    float run[G::kItems];
#pragma unroll
    for (int k = 0; k < G::kItems; ++k) run[k] = -INFINITY;

#pragma unroll 1
    for (int pi = item_pb(it, wg); pi < item_pe(it, wg); ++pi) {
      const int phase = tab.phase[wg][pi];
      const int taps = tab.taps[phase];
#pragma unroll
      for (int a = 0; a < P::kTQD; ++a)
#pragma unroll
        for (int b = 0; b < G::kJ; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
#pragma unroll 1
      for (int tap = 0; tap < taps; ++tap, ++j) {
        const int off = tab.offset[wg][piece_of[static_cast<int>(j % kRing)]];
        cp_async_wait<kRing - 2>();
        fence_async_shared();
        named_sync(1 + wg, 128);  // piece j is in the ring for the whole warpgroup
        const uint64_t a_base = a_desc0 + static_cast<uint64_t>(static_cast<int>(j % kRing) * G::kPieceFloats / 4);
        const uint64_t b_base = b_desc0 + static_cast<uint64_t>(off);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < G::kKSteps; ++ks)
#pragma unroll
          for (int pl = 0; pl < P::kTQD; ++pl) {
            // descriptors count 16-byte units: a k-step is two units of every row
            const uint64_t a = a_base + ks * 2 * P::kCout, b = b_base + ks * 2 * G::kBoxPos + pl * P::kBH * P::kBW;
            if constexpr (G::kHalfMma) {
              Wgmma16<G::kN, Elem<P>>::mma(acc[pl], a, b);
            } else {
              Wgmma<G::kN>::mma(acc[pl], a, b);
            }
          }
        wgmma_commit();
        wgmma_wait<1>();  // piece j - 1's MMAs are done: its ring slot takes the next load
        load_next();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int a = 0; a < P::kTQD; ++a)
#pragma unroll
        for (int b = 0; b < G::kJ; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) pin(acc[a][b][c]);
      // The epilogue's ops on every value, the max over the planes and rows per (channel, column),
      // then over each window's columns. acc[pl][j][2 c + e]: channel 16 warp + g + 8 c, position
      // 8 j + 2 t + e of the plane (row (8 j) / kBW, column 8 (j % kWGroups) + 2 t + e).
      const int rd = tab.residue[phase][0], rh = tab.residue[phase][1], rw = tab.residue[phase][2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int ch = 16 * warp + g + 8 * c;
        const float bias = conv_bias_value<E>(ep, ch);
#pragma unroll
        for (int jw = 0; jw < G::kWGroups; ++jw) {
          float m[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            m[e] = -INFINITY;
#pragma unroll
            for (int pl = 0; pl < P::kTQD; ++pl)
#pragma unroll
              for (int hh = 0; hh < P::kTQH; ++hh) {
                const float a = acc[pl][jw + G::kWGroups * hh][2 * c + e];
                if constexpr (E::kPreIdentity) {  // conv_output once, on the max (conv_gemm.cuh)
                  m[e] = kgen::max_nan(m[e], a);
                } else {
                  const int od = P::kSD * (P::kTQD * pd + pl) + rd, oh = P::kSH * (P::kTQH * ph + hh) + rh;
                  const int ow = P::kSW * (8 * jw + 2 * t + e) + rw;
                  m[e] = kgen::max_nan(m[e], E::pre(ep, n, ch, od, oh, ow, conv_output<P, E, true>(a, bias)));
                }
              }
            if constexpr (E::kPreIdentity) m[e] = conv_output<P, E, true>(m[e], bias);
          }
          *reinterpret_cast<float2*>(scr + ch * G::kScrStride + 8 * jw + 2 * t) = make_float2(m[0], m[1]);
        }
      }
      named_sync(1 + wg, 128);
#pragma unroll
      for (int k = 0; k < G::kItems; ++k) {
        const int i = lt + 128 * k;
        if (i < G::kOuts) {
          const float* s = scr + (i / P::kPooledW) * G::kScrStride + P::kTQW * (i % P::kPooledW);
          float v = s[0];
#pragma unroll
          for (int q = 1; q < P::kTQW; ++q) v = kgen::max_nan(v, s[q]);
          run[k] = kgen::max_nan(run[k], v);
        }
      }
    }

    // Both warpgroups' maxima, the ops after the pool and the reduction over the channels in order:
    // for a whole tile here; a part leaves each warpgroup's maxima in the workspace, and the last of
    // its tile's parts to arrive combines them all.
    bool finish = whole;
    if (whole) {
      if (wg == 1) {
#pragma unroll
        for (int k = 0; k < G::kItems; ++k)
          if (lt + 128 * k < G::kOuts) fin[lt + 128 * k] = run[k];
      }
      __syncthreads();
      if (wg == 0) {
#pragma unroll
        for (int k = 0; k < G::kItems; ++k) {
          const int i = lt + 128 * k;
          if (i < G::kOuts) run[k] = kgen::max_nan(run[k], fin[i]);
        }
      }
    } else {
      const int unit = it - full, t_split = unit / parts;
#pragma unroll
      for (int k = 0; k < G::kItems; ++k) {
        const int i = lt + 128 * k;
        if (i < G::kOuts) __stcg(ws + (2LL * unit + wg) * G::kOuts + i, run[k]);
      }
      __threadfence();  // the maxima before the count
      int* const counters = reinterpret_cast<int*>(ws + 2LL * kMaxWorkers * G::kOuts);
      finish = __syncthreads_or(tid == 0 && atomicAdd(counters + t_split, 1) == parts - 1);
      if (finish && wg == 0) {
        __threadfence();  // the other parts' maxima after their counts
#pragma unroll
        for (int k = 0; k < G::kItems; ++k) {
          const int i = lt + 128 * k;
          if (i < G::kOuts) {
            const float* first = ws + 2LL * t_split * parts * G::kOuts + i;
            float v = __ldcg(first);
            for (int u = 1; u < 2 * parts; ++u) v = kgen::max_nan(v, __ldcg(first + static_cast<long long>(u) * G::kOuts));
            run[k] = v;
          }
        }
      }
    }
    if (finish) {  // warpgroup 0 holds the tile's maxima (thread i rewrites only fin[i], which it alone read)
      if (wg == 0) {
#pragma unroll
        for (int k = 0; k < G::kItems; ++k) {
          const int i = lt + 128 * k;
          if (i < G::kOuts) fin[i] = E::post(ep, n, i / P::kPooledW, pd, ph, i % P::kPooledW, run[k]);
        }
      }
      __syncthreads();
      if (tid < P::kPooledW) E::reduce_channels(ep, n, (pd * P::kPooledH + ph) * P::kPooledW + tid, fin + tid, P::kPooledW);
    }
  }
  cp_async_wait<0>();
}

// Packs the weight (Cin, Cout, KD, KH, KW) into the pieces the kernel streams, TF32-rounded (16-bit plans: in the
// dtype, from the float32 copy of the 16-bit weight: exact):
// [warpgroup 0's taps, then 1's][k step][unit][64 output channels][U channels].
template <class P>
__global__ void phase_pool_pack_kernel(const float* __restrict__ w, float* __restrict__ packed, const PhasePoolTables tables,
                                       int kernel_taps) {
  using G = PoolGeometry<P>;
  // a piece's values: [k step][unit][output channel][kUnitChannels], as TF32 floats or 16-bit values
  constexpr int kU = G::kUnitChannels, kPieceValues = G::kKSteps * 2 * P::kCout * kU;
  const int pieces = tables.pieces[0] + tables.pieces[1];
  const long long total = static_cast<long long>(pieces) * kPieceValues;
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < total; e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int piece = static_cast<int>(e / kPieceValues), r = static_cast<int>(e % kPieceValues);
    const int i = r % kU, co = (r / kU) % P::kCout, ku = (r / (kU * P::kCout)) % 2, ks = r / (2 * kU * P::kCout);
    const int wg = piece < tables.pieces[0] ? 0 : 1, j = wg ? piece - tables.pieces[0] : piece;
    const int ci = 2 * kU * ks + kU * ku + i;
    const float v = ci < P::kCin ? w[(static_cast<long long>(ci) * P::kCout + co) * kernel_taps + tables.weight_tap[wg][j]] : 0.f;
    if constexpr (G::kHalfMma) {
      reinterpret_cast<Elem<P>*>(packed)[e] = from_float<Elem<P>>(v);  // exact: a copy of the 16-bit weight
    } else {
      packed[e] = to_tf32_operand<P::kTf32HalfEven>(v);
    }
  }
}

template <class P, class E>
cudaError_t run_phase_pool(const Elem<P>* x, const float* w, float* packed, bool pack, const typename E::Params& ep,
                           const PhasePoolTables& tables, int kernel_taps, int batch, cudaStream_t stream) {
  using G = PoolGeometry<P>;
  if (pack) {
    phase_pool_pack_kernel<P><<<256, 256, 0, stream>>>(w, packed, tables, kernel_taps);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  KernelSetup setup;
  cudaError_t err = kernel_setup<phase_pool_kernel<P, E>>(kThreads, G::kSmemBytes, &setup);
  if (err != cudaSuccess) return err;
  const int tiles = batch * P::kPooledD * P::kPooledH;
  const int grid = tiles < setup.sms ? tiles : setup.sms;  // persistent CTAs, one per SM
  float* const ws = E::workspace(ep);
  if (split_last_round(ws, tiles % grid, split_parts(tables), grid)) {  // the last round's counters start at zero
    err = cudaMemsetAsync(ws + 2LL * kMaxWorkers * G::kOuts, 0, sizeof(int) * (tiles % grid), stream);
    if (err != cudaSuccess) return err;
  }
  phase_pool_kernel<P, E><<<grid, kThreads, G::kSmemBytes, stream>>>(x, packed, ep, tables, batch);
  return cudaGetLastError();
}

}  // namespace phase_pool
}  // namespace conv_gemm
}  // namespace kgen
