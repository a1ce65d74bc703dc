// Lab (stop 35, NOT YET RUN ON A GPU): the window loop turned around, for KernelBench #87's convolution
// (conv2d 8 -> 64, k3, 128 x 8 x 256 x 256, NCHW, stored with its bias), split TF32 or TF32.
//
// Why (notes/next_kernelbench.md "after stop 35"): conv_gemm's window loop takes M = positions, so a
// thread's A fragment is a position pair of its register window and ptxas copies the odd-kw taps into
// fresh register quads: ~2.5 moves per HMMA in #87's kernel (SASS), 8 warps per SM at 186 registers.
// Here, as in pool_ring.cuh, M = output channels and N = positions: a tap's weights are the A fragment
// (held in registers for all 9 taps: one m16 tile of channels per warp), and a B fragment is the input
// channel pair (t, t + 4) at one position, stored in shared memory as such pairs with their TF32 lo
// parts beside them ([pair t][box row][box column][hi_t, hi_t+4, lo_t, lo_t+4]): one LDS.128 gives a
// position's hi and lo fragments as aligned register pairs, no moves.
//
// CTA: 4 warps (warp w: output channels 16 w .. 16 w + 15), a tile of kRows output rows x 32 columns;
// the box (kRows + 2 rows x 34 columns x 8 channels) is filled (split into hi and lo) by all threads,
// then each warp runs kRows x 4 n-tiles x 9 taps x (3 | 1) HMMAs and stores its accumulators (float2 per
// channel and column pair). Persistent CTAs over (sample, row block, column block). v1: no prefetch of the
// next box (the fill is ~9 values per thread); measure first.
//
// Expected (written before running): #87's convolution alone runs 2.12 ms in conv_gemm's window loop on
// the H200 (2.16 in stop 35's lab run); floors ~0.45-0.7 ms for the 2.1 GB output, ~0.8 ms for the split
// HMMAs at ~60% of the dense TF32 rate. Without the moves and with ~12 warps per SM: ~1.3-1.5 ms.
//
// ptxas (local, CUDA 13), A in registers: tf32x3 206 registers at 2 CTAs per SM (the 9 taps' hi and lo A
// fragments are 72 of them; at 3 CTAs per SM it spilled 24 bytes), tf32 135 at 3; taps outermost (a runtime
// loop over the taps): tf32x3 96, tf32 84 (5 CTAs per SM by registers: 20 warps); no spills anywhere.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I../../../templates -Xptxas -v pair_window.cu -o pair_window
//   ./pair_window            # tf32x3, then tf32: max error against float64 (samples 0 and N - 1), ms
#include <cuda_runtime.h>

#include "conv_gemm/conv_gemm.cuh"  // nvcc -I templates (run.sh)

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kN = 128, kCin = 8, kH = 256, kW = 256, kCout = 64, kK = 3;
constexpr int kOH = kH - kK + 1, kOW = kW - kK + 1;
constexpr int kTaps = kK * kK;
constexpr int kThreads = 128;  // 4 warps: one m16 tile of output channels each
constexpr int kRows = 2;       // output rows of a tile
constexpr int kCols = 32;      // output columns of a tile: 4 n-tiles of 8
constexpr int kBoxRows = kRows + kK - 1;
constexpr int kBoxCols = kCols + kK - 1;  // 34
constexpr int kRowSlots = 36;             // 16-byte slots of a box row (34 used)
// Pair planes kPlaneSlots x 16 bytes apart, 32 bytes mod 128: the 8 threads of an LDS.128 phase (t = 0..3,
// two g) hit 8 different 16-byte bank groups.
constexpr int kPlaneSlots = kBoxRows * kRowSlots + 2;
constexpr int kBoxFloats = 4 * kPlaneSlots * 4;
constexpr int kRowBlocks = (kOH + kRows - 1) / kRows;
constexpr int kColBlocks = (kOW + kCols - 1) / kCols;
constexpr int kTilesPerSample = kRowBlocks * kColBlocks;

using kgen::conv_gemm::mma_tf32;  // the product's own helpers (templates/conv_gemm/conv_gemm.cuh)
using kgen::conv_gemm::to_tf32;

// packed: [warp][tap][lane][8] = the lane's A fragment of the tap (hi: 4, lo: 4), made on the host.
// kTapOuter: the taps outermost, a tap's A fragments loaded (__ldg, L1) when it starts, so that only one
// tap's are live (~70 registers instead of ~200 for tf32x3: 4 CTAs per SM); else all 9 taps' A fragments
// stay in registers for the CTA's life and the loop runs kh, rows, n-tiles, kw.
template <bool kSplit, bool kTapOuter>
__global__ void __launch_bounds__(kThreads, kTapOuter ? 4 : kSplit ? 2 : 3) pair_window_kernel(const float* __restrict__ x, const float* __restrict__ packed,
                                                                  const float* __restrict__ bias, float* __restrict__ out,
                                                                  int batch) {
  __shared__ __align__(16) float box[kBoxFloats];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // the tap's A fragments (hi, lo) of this thread
  auto load_a = [&](int tap, float (&hi)[4], float (&lo)[4]) {
    const float4* src = reinterpret_cast<const float4*>(packed + ((warp * kTaps + tap) * 32 + lane) * 8);
    const float4 h = __ldg(src);
    hi[0] = h.x, hi[1] = h.y, hi[2] = h.z, hi[3] = h.w;
    if constexpr (kSplit) {
      const float4 l = __ldg(src + 1);
      lo[0] = l.x, lo[1] = l.y, lo[2] = l.z, lo[3] = l.w;
    }
  };
  float a_hi[kTapOuter ? 1 : kTaps][4], a_lo[kTapOuter ? 1 : kTaps][4];
  if constexpr (!kTapOuter) {
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap) load_a(tap, a_hi[tap], a_lo[tap]);
  }
  const int co0 = 16 * warp + g;  // the thread's channels co0 and co0 + 8
  const float b0 = bias[co0], b1 = bias[co0 + 8];

  const long long tiles = static_cast<long long>(batch) * kTilesPerSample;
#pragma unroll 1
  for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int n = static_cast<int>(tile / kTilesPerSample), rest = static_cast<int>(tile % kTilesPerSample);
    const int r0 = (rest / kColBlocks) * kRows, c0 = (rest % kColBlocks) * kCols;

    // The box: channels 0..7, rows r0.., columns c0.. (past the input: zeros), split into hi and lo.
    __syncthreads();  // every warp is done with the previous box
    constexpr int kBoxValues = kCin * kBoxRows * kBoxCols;
    for (int e = tid; e < kBoxValues; e += kThreads) {
      const int col = e % kBoxCols, row = (e / kBoxCols) % kBoxRows, ch = e / (kBoxCols * kBoxRows);
      const int ih = r0 + row, iw = c0 + col;
      const float v = ih < kH && iw < kW ? __ldg(x + ((static_cast<long long>(n) * kCin + ch) * kH + ih) * kW + iw) : 0.f;
      const float hi = to_tf32(v);
      float* slot = box + ((ch & 3) * kPlaneSlots + row * kRowSlots + col) * 4;
      slot[ch >> 2] = hi;
      if constexpr (kSplit) slot[2 + (ch >> 2)] = to_tf32(v - hi);
    }
    __syncthreads();

    float acc[kRows][4][4];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int jn = 0; jn < 4; ++jn)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][jn][i] = 0.f;

    const float* plane = box + t * kPlaneSlots * 4;
    // one tap at one position block: B = channels (t, t + 4) at box position (r + kh, 8 jn + g + kw)
    auto mma_at = [&](int kh, int kw, int r, int jn, const float (&hi)[4], const float (&lo)[4]) {
      const float4 b = *reinterpret_cast<const float4*>(plane + ((r + kh) * kRowSlots + 8 * jn + g + kw) * 4);
      if constexpr (kSplit) {
        mma_tf32(acc[r][jn], lo, b.x, b.y);
        mma_tf32(acc[r][jn], hi, b.z, b.w);
      }
      mma_tf32(acc[r][jn], hi, b.x, b.y);
    };
    if constexpr (kTapOuter) {
#pragma unroll 1
      for (int tap = 0; tap < kTaps; ++tap) {  // a loop: unrolled, ptxas hoisted every tap's loads
        load_a(tap, a_hi[0], a_lo[0]);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int jn = 0; jn < 4; ++jn) mma_at(tap / kK, tap % kK, r, jn, a_hi[0], a_lo[0]);
      }
    } else {
#pragma unroll
      for (int kh = 0; kh < kK; ++kh)
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int jn = 0; jn < 4; ++jn)
#pragma unroll
            for (int kw = 0; kw < kK; ++kw) mma_at(kh, kw, r, jn, a_hi[kh * kK + kw], a_lo[kh * kK + kw]);
    }

    // D: channel co0 (+ 8) x columns 8 jn + 2t, + 1 of row r0 + r.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int oh = r0 + r;
      if (oh >= kOH) continue;
#pragma unroll
      for (int jn = 0; jn < 4; ++jn) {
        const int ow = c0 + 8 * jn + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float bb = half ? b1 : b0;
          float* dst = out + ((static_cast<long long>(n) * kCout + co0 + 8 * half) * kOH + oh) * kOW + ow;
          const float v0 = acc[r][jn][2 * half] + bb, v1 = acc[r][jn][2 * half + 1] + bb;
          if (ow + 1 < kOW) {
            *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);  // ow even, kOW even: 8-byte aligned
          } else if (ow < kOW) {
            dst[0] = v0;
          }
        }
      }
    }
  }
}

float tf32_host(float v) {  // round to nearest, ties away (cvt.rna), finite inputs
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t err_ = (call);                                                        \
    if (err_ != cudaSuccess) {                                                        \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));        \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

template <bool kSplit, bool kTapOuter>
void run(const std::vector<float>& hx, const std::vector<float>& hw, const std::vector<float>& hb) {
  // A fragments: a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]; A[m][k] = w[16 warp + m][k][tap]
  std::vector<float> packed(4 * kTaps * 32 * 8);
  for (int warp = 0; warp < 4; ++warp)
    for (int tap = 0; tap < kTaps; ++tap)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, t = lane & 3;
        const int ms[4] = {g, g + 8, g, g + 8}, ks[4] = {t, t, t + 4, t + 4};
        for (int i = 0; i < 4; ++i) {
          const float v = hw[((16 * warp + ms[i]) * kCin + ks[i]) * kTaps + tap];
          const float hi = tf32_host(v);
          packed[((warp * kTaps + tap) * 32 + lane) * 8 + i] = hi;
          packed[((warp * kTaps + tap) * 32 + lane) * 8 + 4 + i] = tf32_host(v - hi);
        }
      }
  float *dx, *dp, *db, *dout;
  const size_t out_n = static_cast<size_t>(kN) * kCout * kOH * kOW;
  CHECK(cudaMalloc(&dx, hx.size() * 4));
  CHECK(cudaMalloc(&dp, packed.size() * 4));
  CHECK(cudaMalloc(&db, hb.size() * 4));
  CHECK(cudaMalloc(&dout, out_n * 4));
  CHECK(cudaMemcpy(dx, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dp, packed.data(), packed.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dout, 0xff, out_n * 4));  // NaN: an output never written shows

  int sms = 0, per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pair_window_kernel<kSplit, kTapOuter>, kThreads, 0));
  const int grid = sms * std::max(1, per_sm);
  auto launch = [&] { pair_window_kernel<kSplit, kTapOuter><<<grid, kThreads>>>(dx, dp, db, dout, kN); };
  launch();
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());

  // max |error| against float64 over samples 0 and N - 1, over the largest |output|
  std::vector<float> got(static_cast<size_t>(kCout) * kOH * kOW);
  double worst = 0, scale = 0;
  int bad = 0;
  for (int n : {0, kN - 1}) {
    CHECK(cudaMemcpy(got.data(), dout + static_cast<size_t>(n) * got.size(), got.size() * 4, cudaMemcpyDeviceToHost));
    for (int co = 0; co < kCout; ++co)
      for (int oh = 0; oh < kOH; ++oh)
        for (int ow = 0; ow < kOW; ++ow) {
          double s = hb[co];
          for (int ci = 0; ci < kCin; ++ci)
            for (int kh = 0; kh < kK; ++kh)
              for (int kw = 0; kw < kK; ++kw)
                s += static_cast<double>(hx[((static_cast<size_t>(n) * kCin + ci) * kH + oh + kh) * kW + ow + kw]) *
                     hw[((co * kCin + ci) * kK + kh) * kK + kw];
          const double v = got[(static_cast<size_t>(co) * kOH + oh) * kOW + ow];
          if (!std::isfinite(v)) ++bad;
          worst = std::max(worst, std::fabs(v - s));
          scale = std::max(scale, std::fabs(s));
        }
  }
  // timing: 20 calls after 5, median
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) launch();
  std::vector<float> ms;
  for (int i = 0; i < 20; ++i) {
    CHECK(cudaEventRecord(e0));
    launch();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float m = 0;
    CHECK(cudaEventElapsedTime(&m, e0, e1));
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%s, %s: grid %d (%d per SM), max |err| / max |ref| %.3g, non-finite %d, %.3f ms (median of 20)\n",
              kSplit ? "tf32x3" : "tf32", kTapOuter ? "taps outermost" : "A in registers", grid, per_sm, worst / scale, bad,
              ms[ms.size() / 2]);
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dp));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dout));
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> hx(static_cast<size_t>(kN) * kCin * kH * kW), hw(kCout * kCin * kTaps), hb(kCout);
  for (auto& v : hx) v = normal(rng);
  const float ws = 1.f / std::sqrt(static_cast<float>(kCin * kTaps));
  for (auto& v : hw) v = normal(rng) * ws;
  for (auto& v : hb) v = normal(rng) * 0.1f;
  run<true, false>(hx, hw, hb);
  run<true, true>(hx, hw, hb);
  run<false, false>(hx, hw, hb);
  run<false, true>(hx, hw, hb);
  return 0;
}
