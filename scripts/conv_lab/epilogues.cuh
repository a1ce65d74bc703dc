// Hand-written epilogues for the conv_gemm lab (scripts/conv_lab): the
// shapes the generated ones take. Each is a struct with Params, kStaged,
// kScratchFloats and either apply<P>(params, tile[kBN][kMPad], scratch, coord)
// (staged) or apply_fragments<P>(params, acc, fragment map, scratch, coord).
#pragma once

#include "conv_gemm/conv_gemm.cuh"
#include "kgen_math.h"

namespace lab {
using namespace kgen::conv_gemm;

// The convolution output (+ bias), NC[D]HW, from a staged tile or (StoreRegs) from the
// accumulators: the product's epilogue (conv_gemm.cuh StoreEpilogue).
using Store = StoreEpilogue<true>;
using StoreRegs = StoreEpilogue<false>;

// sum over channels and positions of sigmoid(conv + bias): one partial per tile.
struct SigmoidSum {
  struct Params {
    const float* bias;
    float* partial;  // [batch][tiles]
  };
  static constexpr bool kStaged = false;
  static constexpr int kScratchFloats = 32;
  template <class P, class Acc>
  __device__ static void apply_fragments(const Params& p, const Acc& acc, const FragMap<P>& fm, float* scratch, const TileCoord& c) {
    using G = Geometry<P>;
    const int tid = team_thread<P>();  // this thread in its team
    float s = 0.f;
#pragma unroll
    for (int mt = 0; mt < G::kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = fm.m(mt, i), n = fm.n(nt, i);
          const float v = kgen::sigmoid(acc[mt][nt][i] + p.bias[min(n, P::kCout - 1)]);
          s += n < P::kCout && row_valid<P>(c, m) ? v : 0.f;
        }
    s = block_sum<P>(s, scratch);
    if (tid == 0) p.partial[static_cast<long long>(c.n) * G::kTilesPerSample + c.index] = s;
  }
};

// max pool 2x2x2 of (conv + bias), / 2, summed over channels and pooled positions: one partial per tile.
struct MaxPool2Sum {
  struct Params {
    const float* bias;
    float* partial;
  };
  static constexpr bool kStaged = true;
  static constexpr int kScratchFloats = 32;
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float* scratch, const TileCoord& c) {
    using G = Geometry<P>;
    const int tid = team_thread<P>();  // this thread in its team
    constexpr int kPD = P::kTD / 2, kPH = P::kTH / 2, kPW = P::kTW / 2;
    constexpr int kPooled = kPD * kPH * kPW;
    float s = 0.f;
    for (int i = tid; i < P::kCout * kPooled; i += G::kTeamThreads) {
      const int n = i / kPooled, q = i % kPooled;
      const int pw = q % kPW, ph = (q / kPW) % kPH, pd = q / (kPW * kPH);
      if (c.od / 2 + pd >= P::kOutD / 2 || c.oh / 2 + ph >= P::kOutH / 2 || c.ow / 2 + pw >= P::kOutW / 2) continue;
      float v = -INFINITY;
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b)
          for (int d = 0; d < 2; ++d) {
            const int m = ((2 * pd + a) * P::kTH + 2 * ph + b) * P::kTW + 2 * pw + d;
            v = kgen::max_nan(v, tile[n * G::kMPad + m] + p.bias[n]);
          }
      s += v / 2.f;
    }
    s = block_sum<P>(s, scratch);
    if (tid == 0) p.partial[static_cast<long long>(c.n) * G::kTilesPerSample + c.index] = s;
  }
};

// MaxPool2Sum from the window loop's accumulators: a thread holds 2 x 2 (H, W) of its pool
// windows (m-tiles mt, mt + 1; positions 2g, 2g + 1); the depth pair is the warp with d0 = 1,
// whose window maxima go through shared memory to its d0 = 0 partner. Needs TD = 2, kMT even.
struct MaxPool2SumRegs {
  using Params = MaxPool2Sum::Params;
  static constexpr bool kStaged = false;
  static constexpr int kScratchFloats = 32 + 4 * 32 * 8;  // block_sum's, then up to 4 warps x 32 lanes x 8 maxima
  template <class P, class Acc>
  __device__ static void apply_fragments(const Params& p, const Acc& acc, const FragMap<P>& fm, float* scratch, const TileCoord& c) {
    using G = Geometry<P>;
    static_assert(P::kLoop == Loop::kWindow && P::kTD == 2 && G::kMT % 2 == 0, "window loop, 2 depths per tile");
    constexpr int kHP = G::kMT / 2, kCh = G::kNT * 2, kVals = kHP * kCh;
    static_assert(kVals <= 8, "scratch room");
    const int lane = threadIdx.x % 32;
    const int pair = (fm.h0 / G::kMT) * G::kWSegs + fm.w0 / 16;  // this warp's place among one depth's warps
    float* mine = scratch + 32 + (pair * 32 + lane) * 8;
    float v[kVals];
#pragma unroll
    for (int hp = 0; hp < kHP; ++hp)
#pragma unroll
      for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float a = kgen::max_nan(acc[2 * hp][nt][j], acc[2 * hp][nt][2 + j]);
          const float b = kgen::max_nan(acc[2 * hp + 1][nt][j], acc[2 * hp + 1][nt][2 + j]);
          v[hp * kCh + nt * 2 + j] = kgen::max_nan(a, b);
        }
    if (fm.d0 == 1) {
#pragma unroll
      for (int k = 0; k < kVals; ++k) mine[k] = v[k];
    }
    team_sync<P>();
    float s = 0.f;
    if (fm.d0 == 0) {
      const int pd = c.od / 2, pw = (c.ow + fm.w0) / 2 + fm.g;
#pragma unroll
      for (int hp = 0; hp < kHP; ++hp) {
        const int ph = (c.oh + fm.h0) / 2 + hp;
        const bool ok = pd < P::kOutD / 2 && ph < P::kOutH / 2 && pw < P::kOutW / 2;
#pragma unroll
        for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int k = hp * kCh + nt * 2 + j, n = fm.n(nt, j);
            if (ok && n < P::kCout) s += (kgen::max_nan(v[k], mine[k]) + p.bias[n]) / 2.f;
          }
      }
    }
    s = block_sum<P>(s, scratch);
    if (team_thread<P>() == 0) p.partial[static_cast<long long>(c.n) * G::kTilesPerSample + c.index] = s;
  }
};

// Per (sample, channel) statistics of (conv + bias) * mult over the tile: count, mean, M2 (two passes over the registers).
struct NormStats {
  struct Params {
    const float* bias;
    const float* mult;
    float* partial;  // [batch][C][tiles][3]
  };
  static constexpr bool kStaged = false;
  static constexpr int kScratchFloats = 8 * 64 + 64;  // kWarpsM x kBN sums + kBN means (lab sizes)
  template <class P, class Acc>
  __device__ static void apply_fragments(const Params& p, const Acc& acc, const FragMap<P>& fm, float* scratch, const TileCoord& c) {
    using G = Geometry<P>;
    const int tid = team_thread<P>();  // this thread in its team
    float* means = scratch + P::kWarpsM * P::kBN;
    auto value = [&](int mt, int nt, int i) {
      const int n = fm.n(nt, i);
      return (acc[mt][nt][i] + p.bias[n]) * p.mult[n];
    };
    const float count = static_cast<float>(valid_rows<P>(c));
    channel_sums<P>(fm, scratch, [&](int mt, int nt, int i) { return row_valid<P>(c, fm.m(mt, i)) ? value(mt, nt, i) : 0.f; });
    if (tid < P::kCout) {
      float s = 0.f;
      for (int w = 0; w < P::kWarpsM; ++w) s += scratch[w * P::kBN + tid];
      means[tid] = s / count;
    }
    team_sync<P>();
    channel_sums<P>(fm, scratch, [&](int mt, int nt, int i) {
      const float d = value(mt, nt, i) - means[fm.n(nt, i)];
      return row_valid<P>(c, fm.m(mt, i)) ? d * d : 0.f;
    });
    if (tid < P::kCout) {
      float m2 = 0.f;
      for (int w = 0; w < P::kWarpsM; ++w) m2 += scratch[w * P::kBN + tid];
      float* out = p.partial + ((static_cast<long long>(c.n) * P::kCout + tid) * G::kTilesPerSample + c.index) * 3;
      out[0] = count;
      out[1] = means[tid];
      out[2] = m2;
    }
  }
};

// ((conv + bias) * mult - mean) * rstd, clamp, * mult, max over channels.
struct NormApplyMax {
  struct Params {
    const float* bias;
    const float* mult;
    const float* stats;  // [batch][C][2]: mean, rstd
    float lo, hi;
    float* out;  // [batch][OD][OH][OW]
  };
  static constexpr bool kStaged = false;
  static constexpr int kScratchFloats = 0;
  template <class P, class Acc>
  __device__ static void apply_fragments(const Params& p, const Acc& acc, const FragMap<P>& fm, float*, const TileCoord& c) {
    using G = Geometry<P>;
    static_assert(P::kWarpsN == 1 && P::kBN == P::kCout, "one warp column holds every channel");
#pragma unroll
    for (int mt = 0; mt < G::kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float best = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < G::kNT; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int n = fm.n(nt, j);
            const float* st = p.stats + (static_cast<long long>(c.n) * P::kCout + n) * 2;
            float v = ((acc[mt][nt][2 * h + j] + p.bias[n]) * p.mult[n] - st[0]) * st[1];
            best = kgen::max_nan(best, kgen::clamp(v, p.lo, p.hi) * p.mult[n]);
          }
        }
        constexpr bool kDirect = P::kLoop == Loop::kDirect;  // a thread holds every channel of its positions
        if constexpr (!kDirect) {
          best = kgen::max_nan(best, __shfl_xor_sync(0xffffffffu, best, 1));
          best = kgen::max_nan(best, __shfl_xor_sync(0xffffffffu, best, 2));
        }
        const int m = fm.m(mt, 2 * h);
        if ((kDirect || fm.t == 0) && row_valid<P>(c, m)) {
          p.out[((static_cast<long long>(c.n) * P::kOutD + c.od + row_d<P>(m)) * P::kOutH + c.oh + row_h<P>(m)) * P::kOutW +
                c.ow + row_w<P>(m)] = best;
        }
      }
    }
  }
};

// partial [rows][cols] -> out[row] = sum of the row (in order) * scale + sum of offset_vec
__global__ void sum_rows(const float* partial, int cols, float scale, const float* offset_vec, int offset_n, float* out,
                         int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = 0.f;
  for (int i = 0; i < cols; ++i) s += partial[static_cast<long long>(r) * cols + i];
  float off = 0.f;
  for (int i = 0; i < offset_n; ++i) off += offset_vec[i];
  out[r] = s * scale + off;
}

// [rows][tiles][3] (count, mean, M2) -> [rows][2] (mean, rstd), merged in tile order (Chan et al.).
__global__ void merge_stats(const float* partial, int tiles, float eps, float* stats, int rows) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  double n = 0.0, mean = 0.0, m2 = 0.0;
  for (int i = 0; i < tiles; ++i) {
    const float* q = partial + (static_cast<long long>(r) * tiles + i) * 3;
    const double nb = q[0];
    if (nb == 0.0) continue;
    const double delta = q[1] - mean, tot = n + nb;
    mean += delta * nb / tot;
    m2 += q[2] + delta * delta * n * nb / tot;
    n = tot;
  }
  stats[2 * r] = static_cast<float>(mean);
  stats[2 * r + 1] = static_cast<float>(1.0 / sqrt(m2 / n + static_cast<double>(eps)));
}

}  // namespace lab
