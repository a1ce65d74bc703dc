// Hand-written epilogues for the conv_gemm lab (scripts/conv_lab): the
// shapes the generated ones will take. Each is a struct with Params,
// kScratchFloats and apply<P>(params, tile[kBN][kMPad], scratch, tile coord).
#pragma once

#include "conv_gemm/conv_gemm.cuh"
#include "kgen_math.h"

namespace lab {
using namespace kgen::conv_gemm;

// Sum over the block in a fixed order; the result is valid in thread 0.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  }
  return total;
}

template <class P>
__device__ __forceinline__ long long out_index(const TileCoord& c, int co, int m) {
  return (((static_cast<long long>(c.n) * P::kCout + co) * P::kOutD + c.od + row_d<P>(m)) * P::kOutH + c.oh + row_h<P>(m)) *
             P::kOutW + c.ow + row_w<P>(m);
}

// The convolution output (+ bias), NC[D]HW.
struct Store {
  struct Params {
    const float* bias;
    float* out;
  };
  static constexpr int kScratchFloats = 0;
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float*, const TileCoord& c) {
    using G = Geometry<P>;
    for (int i = threadIdx.x; i < P::kBN * G::kM; i += G::kThreads) {
      const int n = i / G::kM, m = i % G::kM, co = c.cblock * P::kBN + n;
      if (co < P::kCout && row_valid<P>(c, m)) p.out[out_index<P>(c, co, m)] = tile[n * G::kMPad + m] + (p.bias ? p.bias[co] : 0.f);
    }
  }
};

// sum over channels and positions of sigmoid(conv + bias): one partial per tile.
struct SigmoidSum {
  struct Params {
    const float* bias;
    float* partial;  // [batch][tiles]
  };
  static constexpr int kScratchFloats = 32;
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float* scratch, const TileCoord& c) {
    using G = Geometry<P>;
    float s = 0.f;
    for (int i = threadIdx.x; i < P::kCout * G::kM; i += G::kThreads) {
      const int n = i / G::kM, m = i % G::kM;
      if (row_valid<P>(c, m)) s += kgen::sigmoid(tile[n * G::kMPad + m] + p.bias[n]);
    }
    s = block_sum<G::kThreads>(s, scratch);
    if (threadIdx.x == 0) p.partial[static_cast<long long>(c.n) * G::kTilesPerSample + c.index] = s;
  }
};

// max pool 2x2x2 of (conv + bias), / 2, summed over channels and pooled positions: one partial per tile.
struct MaxPool2Sum {
  struct Params {
    const float* bias;
    float* partial;
  };
  static constexpr int kScratchFloats = 32;
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float* scratch, const TileCoord& c) {
    using G = Geometry<P>;
    constexpr int kPD = P::kTD / 2, kPH = P::kTH / 2, kPW = P::kTW / 2;
    constexpr int kPooled = kPD * kPH * kPW;
    float s = 0.f;
    for (int i = threadIdx.x; i < P::kCout * kPooled; i += G::kThreads) {
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
    s = block_sum<G::kThreads>(s, scratch);
    if (threadIdx.x == 0) p.partial[static_cast<long long>(c.n) * G::kTilesPerSample + c.index] = s;
  }
};

// Per (sample, channel) statistics of (conv + bias) * mult over the tile: count, mean, M2.
struct NormStats {
  struct Params {
    const float* bias;
    const float* mult;
    float* partial;  // [batch][C][tiles][3]
  };
  static constexpr int kScratchFloats = 0;
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float*, const TileCoord& c) {
    using G = Geometry<P>;
    constexpr int kLanes = G::kThreads / P::kCout;  // threads per channel: a power of two <= 32
    static_assert(kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "threads per channel");
    const int n = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
    float cnt = 0.f, sum = 0.f;
    for (int m = lane; m < G::kM; m += kLanes) {
      if (row_valid<P>(c, m)) {
        cnt += 1.f;
        sum += (tile[n * G::kMPad + m] + p.bias[n]) * p.mult[n];
      }
    }
    for (int o = kLanes / 2; o > 0; o /= 2) {
      cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    const float mean = cnt > 0.f ? sum / cnt : 0.f;
    float m2 = 0.f;
    for (int m = lane; m < G::kM; m += kLanes) {
      if (row_valid<P>(c, m)) {
        const float d = (tile[n * G::kMPad + m] + p.bias[n]) * p.mult[n] - mean;
        m2 += d * d;
      }
    }
    for (int o = kLanes / 2; o > 0; o /= 2) m2 += __shfl_xor_sync(0xffffffffu, m2, o);
    if (lane == 0) {
      float* out = p.partial + ((static_cast<long long>(c.n) * P::kCout + n) * G::kTilesPerSample + c.index) * 3;
      out[0] = cnt;
      out[1] = mean;
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
  static constexpr int kScratchFloats = 0;
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float*, const TileCoord& c) {
    using G = Geometry<P>;
    for (int m = threadIdx.x; m < G::kM; m += G::kThreads) {
      if (!row_valid<P>(c, m)) continue;
      float acc = -INFINITY;
      for (int n = 0; n < P::kCout; ++n) {
        const float* st = p.stats + (static_cast<long long>(c.n) * P::kCout + n) * 2;
        float v = ((tile[n * G::kMPad + m] + p.bias[n]) * p.mult[n] - st[0]) * st[1];
        v = kgen::clamp(v, p.lo, p.hi) * p.mult[n];
        acc = kgen::max_nan(acc, v);
      }
      p.out[((static_cast<long long>(c.n) * P::kOutD + c.od + row_d<P>(m)) * P::kOutH + c.oh + row_h<P>(m)) * P::kOutW + c.ow +
            row_w<P>(m)] = acc;
    }
  }
};

// partial [rows][cols] -> out[row] = sum of the row (in order) * scale + offset
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
