// conv_gemm.cuh: an implicit-GEMM convolution on tensor cores (TF32 mma.sync
// m16n8k8, fp32 accumulators), with the next stage fused in as its epilogue.
// Ordinary C++ templates: a generated stage supplies a problem struct `P`
// (every size a compile-time constant, see ConvProblem below for the members)
// and an epilogue struct `E`; nothing here knows a particular pipeline.
//
// GEMM view: M = output positions of one sample (a box tile of TD x TH x TW),
// N = output channels, K = input channels x kernel taps. A CTA owns one output
// box and all (or kBN) output channels. Per input-channel chunk it loads the
// input box the tile reads (the halo included) into shared memory once, with
// zero fill outside the tensor, and every tap reads it from there: a 3x3x3
// kernel reuses each loaded value up to 27 times. K is ordered tap-major,
// channel-minor inside a chunk; a table maps each k to its shared-memory
// offset (the im2col offsets, all compile-time), padded entries to a plane of
// zeros, so padding never multiplies a NaN or inf by a zero weight.
//
// The CTAs are persistent: each loads the packed weights once when they fit
// (else streams them per chunk), then walks its tiles; cp.async stages run
// kStages deep across chunks and tiles. After a tile's last chunk the
// accumulators go to a shared-memory tile [kBN][kMPad] and E::apply runs on
// it (bias, elementwise ops, pools, reductions, statistics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kgen {
namespace conv_gemm {

enum class Mma { kTf32, kTf32x3 };

// ------------------------------------------------------------------ PTX

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 4-byte copy global -> shared; `valid` false writes a zero instead.
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}

// 16-byte copy global -> shared (both 16-byte aligned); `valid` false writes zeros.
__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// fp32 -> tf32, round to nearest (ties away), as a 32-bit pattern.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// d += a * b for one m16n8k8 tile (a: 4 regs, b: 2 regs, d: 4 fp32).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ------------------------------------------------------------------ geometry

constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }

// Pads a row length so that `lanes` rows `stride` apart start in distinct
// bank groups: the smallest p >= n with p % 32 == want.
constexpr int pad_to_residue(int n, int want) { return n + ((want - n % 32) % 32 + 32) % 32; }

// Everything derived from the problem struct P. P's members (all static constexpr):
//   kCin, kCout                       channels
//   kInD, kInH, kInW                  input spatial size (1 for missing dims)
//   kOutD, kOutH, kOutW               output positions computed (from 0)
//   kKD, kKH, kKW / kSD.. / kPD.. / kDD..  kernel, stride, padding, dilation
//   kChannelsLast                     input memory format
//   kTD, kTH, kTW                     output box of one tile
//   kCI                               input channels per chunk (pipeline step)
//   kBN                               output channels per CTA (a multiple of 8)
//   kWarpsM, kWarpsN                  warp grid of a CTA
//   kStages                           cp.async pipeline depth (>= 2)
//   kResidentWeights                  all packed weights stay in shared memory
//   kPlaneResidue                     input plane stride % 32 (bank spread of channels)
//   kTapMajor                         K order inside a chunk: tap-major (else channel-major)
//   kMma                              Mma::kTf32 or Mma::kTf32x3
template <class P>
struct Geometry {
  static constexpr int kTaps = P::kKD * P::kKH * P::kKW;
  static constexpr int kChunks = ceil_div(P::kCin, P::kCI);
  static constexpr int kKChunk = P::kCI * kTaps;  // K per chunk
  static constexpr int kKSteps = ceil_div(kKChunk, 8);
  static constexpr int kKPad = kKSteps * 8;
  static constexpr bool kHasPadK = kKPad != kKChunk;
  static constexpr int kCBlocks = ceil_div(P::kCout, P::kBN);
  static constexpr int kBNPad = pad_to_residue(P::kBN, 8);  // weight rows: 4 k x 8 n lanes hit 32 banks

  // The input box a tile reads.
  static constexpr int kBD = (P::kTD - 1) * P::kSD + (P::kKD - 1) * P::kDD + 1;
  static constexpr int kBH = (P::kTH - 1) * P::kSH + (P::kKH - 1) * P::kDH + 1;
  static constexpr int kBW = (P::kTW - 1) * P::kSW + (P::kKW - 1) * P::kDW + 1;
  // Rows are loaded in 16-byte pieces when every piece lies wholly inside or
  // wholly outside the input (NC[D]HW, W, the tile step and the padding all
  // multiples of 4).
  static constexpr bool kVecRows = !P::kChannelsLast && P::kInW % 4 == 0 && (P::kTW * P::kSW) % 4 == 0 &&
                                   P::kPW % 4 == 0 && P::kPlaneResidue % 4 == 0;
  static constexpr int kBWPad = kVecRows ? round_up(kBW, 4) : kBW;
  static constexpr int kPlaneRaw = kBD * kBH * kBWPad;
  static constexpr int kPlane = kVecRows ? round_up(pad_to_residue(kPlaneRaw, P::kPlaneResidue), 4)
                                         : pad_to_residue(kPlaneRaw, P::kPlaneResidue);
  static constexpr int kPlanes = P::kCI + (kHasPadK ? 1 : 0);  // the last one is zeros, for padded k
  static constexpr int kInStage = round_up(kPlanes * kPlane, 4);

  // Tiles.
  static constexpr int kM = P::kTD * P::kTH * P::kTW;
  static constexpr int kMPad = pad_to_residue(kM, 4);  // staged accumulators: 8 rows x 4 col pairs hit 32 banks
  static constexpr int kTilesD = ceil_div(P::kOutD, P::kTD);
  static constexpr int kTilesH = ceil_div(P::kOutH, P::kTH);
  static constexpr int kTilesW = ceil_div(P::kOutW, P::kTW);
  static constexpr int kTilesPerSample = kTilesD * kTilesH * kTilesW;
  static constexpr int kThreads = 32 * P::kWarpsM * P::kWarpsN;
  static constexpr int kWarpM = kM / P::kWarpsM;  // rows per warp
  static constexpr int kWarpN = P::kBN / P::kWarpsN;  // columns per warp
  static constexpr int kMT = kWarpM / 16;
  static constexpr int kNT = kWarpN / 8;
  static_assert(kM % (16 * P::kWarpsM) == 0, "tile rows must split into 16-row MMA tiles per warp");
  static_assert(P::kBN % (8 * P::kWarpsN) == 0, "kBN must split into 8-column MMA tiles per warp");
  static_assert(P::kStages >= 2, "at least double buffering");

  static constexpr int kWeightChunk = kKPad * kBNPad;  // floats of one chunk's packed weights in shared memory
  static constexpr int kWeightSplits = P::kMma == Mma::kTf32x3 ? 2 : 1;  // hi (and lo) parts
  static constexpr int kWeightFloats =
      kWeightSplits * (P::kResidentWeights ? kChunks * kWeightChunk : P::kStages * kWeightChunk);

  // Shared memory, in floats: weights | input stages | k offsets | accumulator tile | epilogue scratch.
  static constexpr int kWeightOffset = 0;
  static constexpr int kInOffset = round_up(kWeightFloats, 4);
  static constexpr int kKOffOffset = kInOffset + P::kStages * kInStage;
  static constexpr int kTileOffset = round_up(kKOffOffset + kKPad, 4);
  static constexpr int kScratchOffset = kTileOffset + P::kBN * kMPad;

  // Packed weights in global memory: [cblock][chunk][split][kKPad][kBN].
  static constexpr int kPackedChunk = kKPad * P::kBN;
  static constexpr long long kPackedFloats = static_cast<long long>(kCBlocks) * kChunks * kWeightSplits * kPackedChunk;
};

// k inside a chunk -> (channel in the chunk, tap); the packing and the offset table agree on it.
template <class P>
__host__ __device__ constexpr int k_channel(int k) {
  return P::kTapMajor ? k % P::kCI : k / (P::kKD * P::kKH * P::kKW);
}
template <class P>
__host__ __device__ constexpr int k_tap(int k) {
  return P::kTapMajor ? k / P::kCI : k % (P::kKD * P::kKH * P::kKW);
}

// Where a tile lies: sample, output-channel block, and its first output position.
struct TileCoord {
  int n, cblock, index;  // index: tile number inside the sample
  int od, oh, ow;
};

template <class P>
__device__ __forceinline__ TileCoord tile_coord(long long t) {
  using G = Geometry<P>;
  TileCoord c;
  c.index = static_cast<int>(t % G::kTilesPerSample);
  const long long rest = t / G::kTilesPerSample;
  c.cblock = static_cast<int>(rest % G::kCBlocks);
  c.n = static_cast<int>(rest / G::kCBlocks);
  const int tw = c.index % G::kTilesW;
  const int th = (c.index / G::kTilesW) % G::kTilesH;
  const int td = c.index / (G::kTilesW * G::kTilesH);
  c.od = td * P::kTD;
  c.oh = th * P::kTH;
  c.ow = tw * P::kTW;
  return c;
}

// Row m of a tile -> (d, h, w) inside the box, W fastest.
template <class P>
__host__ __device__ constexpr int row_d(int m) { return m / (P::kTH * P::kTW); }
template <class P>
__host__ __device__ constexpr int row_h(int m) { return (m / P::kTW) % P::kTH; }
template <class P>
__host__ __device__ constexpr int row_w(int m) { return m % P::kTW; }

// Whether row m of the tile at `c` is an output position (partial tiles at the edges).
template <class P>
__device__ __forceinline__ bool row_valid(const TileCoord& c, int m) {
  return c.od + row_d<P>(m) < P::kOutD && c.oh + row_h<P>(m) < P::kOutH && c.ow + row_w<P>(m) < P::kOutW;
}

// ------------------------------------------------------------------ loads

// Input box of chunk `chunk` for the tile at `c` into shared memory `dst` (one stage).
template <class P>
__device__ __forceinline__ void load_input(float* dst, const float* __restrict__ x, const TileCoord& c, int chunk) {
  using G = Geometry<P>;
  const int id0 = c.od * P::kSD - P::kPD, ih0 = c.oh * P::kSH - P::kPH, iw0 = c.ow * P::kSW - P::kPW;
  const int ci0 = chunk * P::kCI;
  if constexpr (G::kVecRows) {
    constexpr int kPieces = G::kBWPad / 4;
    constexpr int kTotal = P::kCI * G::kBD * G::kBH * kPieces;
    const float* xs = x + static_cast<long long>(c.n) * P::kCin * P::kInD * P::kInH * P::kInW;
    for (int e = threadIdx.x; e < kTotal; e += G::kThreads) {
      const int piece = e % kPieces;
      const int row = e / kPieces;  // (ci, bd, bh)
      const int bh = row % G::kBH, bd = (row / G::kBH) % G::kBD, ci = row / (G::kBH * G::kBD);
      const int id = id0 + bd * 1, ih = ih0 + bh, iw = iw0 + piece * 4;
      const bool ok = ci0 + ci < P::kCin && id >= 0 && id < P::kInD && ih >= 0 && ih < P::kInH && iw >= 0 && iw < P::kInW;
      const float* src = ok ? xs + ((static_cast<long long>(ci0 + ci) * P::kInD + id) * P::kInH + ih) * P::kInW + iw : x;
      cp_async16(dst + ci * G::kPlane + (bd * G::kBH + bh) * G::kBWPad + piece * 4, src, ok);
    }
  } else {
    constexpr int kTotal = P::kCI * G::kBD * G::kBH * G::kBW;
    for (int e = threadIdx.x; e < kTotal; e += G::kThreads) {
      int ci, bd, bh, bw;
      if constexpr (P::kChannelsLast) {  // consecutive threads: consecutive channels
        ci = e % P::kCI;
        const int pos = e / P::kCI;
        bw = pos % G::kBW;
        bh = (pos / G::kBW) % G::kBH;
        bd = pos / (G::kBW * G::kBH);
      } else {  // consecutive threads: consecutive positions along W
        bw = e % G::kBW;
        bh = (e / G::kBW) % G::kBH;
        bd = (e / (G::kBW * G::kBH)) % G::kBD;
        ci = e / (G::kBW * G::kBH * G::kBD);
      }
      const int id = id0 + bd, ih = ih0 + bh, iw = iw0 + bw;
      const bool ok = ci0 + ci < P::kCin && id >= 0 && id < P::kInD && ih >= 0 && ih < P::kInH && iw >= 0 && iw < P::kInW;
      long long off;
      if constexpr (P::kChannelsLast) {
        off = (((static_cast<long long>(c.n) * P::kInD + id) * P::kInH + ih) * P::kInW + iw) * P::kCin + ci0 + ci;
      } else {
        off = (((static_cast<long long>(c.n) * P::kCin + ci0 + ci) * P::kInD + id) * P::kInH + ih) * P::kInW + iw;
      }
      cp_async4(dst + ci * G::kPlane + (bd * G::kBH + bh) * G::kBWPad + bw, ok ? x + off : x, ok);
    }
  }
}

// One chunk's packed weights [split][kKPad][kBN] into shared rows of kBNPad.
template <class P>
__device__ __forceinline__ void load_weights(float* dst, const float* __restrict__ packed, int cblock, int chunk) {
  using G = Geometry<P>;
  constexpr int kRowPieces = P::kBN / 4;
  constexpr int kTotal = G::kWeightSplits * G::kKPad * kRowPieces;
  const float* src = packed + (static_cast<long long>(cblock) * G::kChunks + chunk) * G::kWeightSplits * G::kPackedChunk;
  for (int e = threadIdx.x; e < kTotal; e += G::kThreads) {
    const int piece = e % kRowPieces, row = e / kRowPieces;  // row: split * kKPad + k
    const int split = row / G::kKPad, k = row % G::kKPad;
    cp_async16(dst + split * (G::kWeightChunk) + k * G::kBNPad + piece * 4, src + row * P::kBN + piece * 4, true);
  }
}

// ------------------------------------------------------------------ the kernel

// Per-thread MMA fragments of a k step: a (hi, hi with non-finite zeroed, lo) and b (hi, lo).
template <class P>
struct Fragments {
  using G = Geometry<P>;
  uint32_t a[G::kMT][4];
  uint32_t a_lo[P::kMma == Mma::kTf32x3 ? G::kMT : 1][4];
  uint32_t a_fin[P::kMma == Mma::kTf32x3 ? G::kMT : 1][4];
};

template <class P, class E>
__global__ void __launch_bounds__(Geometry<P>::kThreads) conv_kernel(const float* __restrict__ x,
                                                                   const float* __restrict__ packed,
                                                                   const typename E::Params ep, int batch) {
  using G = Geometry<P>;
  extern __shared__ __align__(16) float smem[];
  float* s_weights = smem + G::kWeightOffset;
  float* s_in = smem + G::kInOffset;
  int* s_koff = reinterpret_cast<int*>(smem + G::kKOffOffset);
  float* s_tile = smem + G::kTileOffset;
  float* s_scratch = smem + G::kScratchOffset;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // MMA fragment coordinates
  const int warp_m = warp % P::kWarpsM, warp_n = warp / P::kWarpsM;

  // k -> shared-memory offset inside a stage: tap-major, channel-minor; padded k -> the zero plane.
  for (int k = threadIdx.x; k < G::kKPad; k += G::kThreads) {
    int off = P::kCI * G::kPlane;  // zero plane
    if (k < G::kKChunk) {
      const int tap = k_tap<P>(k), ci = k_channel<P>(k);
      const int kw = tap % P::kKW, kh = (tap / P::kKW) % P::kKH, kd = tap / (P::kKW * P::kKH);
      off = ci * G::kPlane + (kd * P::kDD * G::kBH + kh * P::kDH) * G::kBWPad + kw * P::kDW;
    }
    s_koff[k] = off;
  }
  if constexpr (G::kHasPadK) {  // zero planes are never written by the loads
    for (int s = 0; s < P::kStages; ++s) {
      for (int i = threadIdx.x; i < G::kPlane; i += G::kThreads) s_in[s * G::kInStage + P::kCI * G::kPlane + i] = 0.f;
    }
  }
  // Row offsets of this thread's fragment rows (g and g + 8 of each 16-row tile).
  int moff[G::kMT][2];
#pragma unroll
  for (int mt = 0; mt < G::kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = warp_m * G::kWarpM + mt * 16 + g + 8 * h;
      moff[mt][h] = (row_d<P>(m) * P::kSD * G::kBH + row_h<P>(m) * P::kSH) * G::kBWPad + row_w<P>(m) * P::kSW;
    }
  }

  const long long total_tiles = static_cast<long long>(batch) * G::kCBlocks * G::kTilesPerSample;
  const long long my_tiles = blockIdx.x < total_tiles ? (total_tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const long long steps = my_tiles * G::kChunks;
  auto tile_of_step = [&](long long s) { return tile_coord<P>(blockIdx.x + (s / G::kChunks) * gridDim.x); };

  if constexpr (P::kResidentWeights) {
    // All chunks of one output-channel block; a CTA keeps one block (kCBlocks == 1 is required).
    static_assert(!P::kResidentWeights || G::kCBlocks == 1, "resident weights hold one output-channel block");
    for (int ch = 0; ch < G::kChunks; ++ch) load_weights<P>(s_weights + ch * G::kWeightSplits * G::kWeightChunk, packed, 0, ch);
  }
  auto issue = [&](long long s) {
    if (s < steps) {
      const TileCoord c = tile_of_step(s);
      const int stage = static_cast<int>(s % P::kStages), chunk = static_cast<int>(s % G::kChunks);
      load_input<P>(s_in + stage * G::kInStage, x, c, chunk);
      if constexpr (!P::kResidentWeights) {
        load_weights<P>(s_weights + stage * G::kWeightSplits * G::kWeightChunk, packed, c.cblock, chunk);
      }
    }
    cp_async_commit();  // an empty group keeps the count uniform
  };
#pragma unroll 1
  for (int s = 0; s < P::kStages - 1; ++s) issue(s);

  float acc[G::kMT][G::kNT][4];
#pragma unroll
  for (int mt = 0; mt < G::kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

#pragma unroll 1
  for (long long s = 0; s < steps; ++s) {
    cp_async_wait<P::kStages - 2>();
    __syncthreads();  // stage s is in; everyone is done with stage s - 1, which the next issue overwrites
    issue(s + P::kStages - 1);
    const int stage = static_cast<int>(s % P::kStages), chunk = static_cast<int>(s % G::kChunks);
    const float* in = s_in + stage * G::kInStage;
    const float* w = s_weights + (P::kResidentWeights ? chunk : stage) * G::kWeightSplits * G::kWeightChunk;
#pragma unroll 2
    for (int ks = 0; ks < G::kKSteps; ++ks) {
      const int k0 = ks * 8;
      const int off_lo = s_koff[k0 + t], off_hi = s_koff[k0 + t + 4];
      Fragments<P> f;
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt) {
        const float v[4] = {in[moff[mt][0] + off_lo], in[moff[mt][1] + off_lo], in[moff[mt][0] + off_hi],
                            in[moff[mt][1] + off_hi]};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          f.a[mt][i] = to_tf32(v[i]);
          if constexpr (P::kMma == Mma::kTf32x3) {
            // v = hi + lo; inf and NaN keep lo = 0, and the hi x b_lo product
            // uses hi with non-finite values zeroed (inf * 0 would be NaN).
            const float hi = __uint_as_float(f.a[mt][i]);
            const bool finite = isfinite(v[i]);
            f.a_lo[mt][i] = to_tf32(finite ? v[i] - hi : 0.f);
            f.a_fin[mt][i] = finite ? f.a[mt][i] : 0u;
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < G::kNT; ++nt) {
        const int n = warp_n * G::kWarpN + nt * 8 + g;
        const uint32_t b[2] = {__float_as_uint(w[(k0 + t) * G::kBNPad + n]), __float_as_uint(w[(k0 + t + 4) * G::kBNPad + n])};
        if constexpr (P::kMma == Mma::kTf32x3) {
          const float* wl = w + G::kWeightChunk;
          const uint32_t b_lo[2] = {__float_as_uint(wl[(k0 + t) * G::kBNPad + n]),
                                    __float_as_uint(wl[(k0 + t + 4) * G::kBNPad + n])};
#pragma unroll
          for (int mt = 0; mt < G::kMT; ++mt) {
            mma_tf32(acc[mt][nt], f.a_lo[mt], b);
            mma_tf32(acc[mt][nt], f.a_fin[mt], b_lo);
            mma_tf32(acc[mt][nt], f.a[mt], b);
          }
        } else {
#pragma unroll
          for (int mt = 0; mt < G::kMT; ++mt) mma_tf32(acc[mt][nt], f.a[mt], b);
        }
      }
    }
    if (chunk == G::kChunks - 1) {
      // Accumulators -> s_tile[n][m], then the epilogue on the whole tile.
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < G::kNT; ++nt) {
          const int m = warp_m * G::kWarpM + mt * 16 + g, n = warp_n * G::kWarpN + nt * 8 + 2 * t;
          s_tile[n * G::kMPad + m] = acc[mt][nt][0];
          s_tile[(n + 1) * G::kMPad + m] = acc[mt][nt][1];
          s_tile[n * G::kMPad + m + 8] = acc[mt][nt][2];
          s_tile[(n + 1) * G::kMPad + m + 8] = acc[mt][nt][3];
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
        }
      }
      __syncthreads();
      E::template apply<P>(ep, s_tile, s_scratch, tile_of_step(s));
      __syncthreads();  // the next tile's accumulators overwrite s_tile
    }
  }
  cp_async_wait<0>();
}

// ------------------------------------------------------------------ weights

// Packs the convolution weight w (Cout, Cin, KD, KH, KW) — or, with `flip`, a
// stride-1 transposed-convolution weight (Cin, Cout, KD, KH, KW), flipped in
// space — into [cblock][chunk][split][kKPad][kBN], K tap-major inside a chunk,
// zeros for padded k and n, rounded to TF32 (and split hi/lo for tf32x3).
template <class P, bool kFlip>
__global__ void pack_weights_kernel(const float* __restrict__ w, float* __restrict__ packed) {
  using G = Geometry<P>;
  const long long total = static_cast<long long>(G::kCBlocks) * G::kChunks * G::kKPad * P::kBN;
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int n = static_cast<int>(e % P::kBN);
    const int k = static_cast<int>((e / P::kBN) % G::kKPad);
    const int chunk = static_cast<int>((e / (static_cast<long long>(P::kBN) * G::kKPad)) % G::kChunks);
    const int cblock = static_cast<int>(e / (static_cast<long long>(P::kBN) * G::kKPad * G::kChunks));
    const int co = cblock * P::kBN + n;
    float v = 0.f;
    if (k < G::kKChunk && co < P::kCout) {
      const int tap = k_tap<P>(k), ci = chunk * P::kCI + k_channel<P>(k);
      const int kw = tap % P::kKW, kh = (tap / P::kKW) % P::kKH, kd = tap / (P::kKW * P::kKH);
      if (ci < P::kCin) {
        if constexpr (kFlip) {
          v = w[((((static_cast<long long>(ci) * P::kCout + co) * P::kKD + (P::kKD - 1 - kd)) * P::kKH + (P::kKH - 1 - kh)) *
                     P::kKW + (P::kKW - 1 - kw))];
        } else {
          v = w[(((static_cast<long long>(co) * P::kCin + ci) * P::kKD + kd) * P::kKH + kh) * P::kKW + kw];
        }
      }
    }
    const float hi = __uint_as_float(to_tf32(v));
    float* dst = packed + ((static_cast<long long>(cblock) * G::kChunks + chunk) * G::kWeightSplits) * G::kPackedChunk +
                 static_cast<long long>(k) * P::kBN + n;
    dst[0] = hi;
    if constexpr (G::kWeightSplits == 2) dst[G::kPackedChunk] = __uint_as_float(to_tf32(isfinite(v) ? v - hi : 0.f));
  }
}

// ------------------------------------------------------------------ launch

template <class P, class E>
constexpr int smem_bytes() {
  return (Geometry<P>::kScratchOffset + E::kScratchFloats) * static_cast<int>(sizeof(float));
}

// Packs the weights into `packed` (Geometry<P>::kPackedFloats floats) and runs
// the convolution with epilogue E over `batch` samples.
template <class P, class E, bool kFlip = false>
cudaError_t launch(const float* x, const float* w, float* packed, const typename E::Params& ep, int batch,
                   cudaStream_t stream) {
  using G = Geometry<P>;
  pack_weights_kernel<P, kFlip><<<static_cast<unsigned>((G::kPackedFloats / G::kWeightSplits + 255) / 256), 256, 0, stream>>>(w, packed);
  constexpr int kSmem = smem_bytes<P, E>();
  static int blocks_per_sm = 0, sm_count = 0;  // per process: one device kind
  if (blocks_per_sm == 0) {
    cudaError_t err = cudaFuncSetAttribute(conv_kernel<P, E>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, conv_kernel<P, E>, G::kThreads, kSmem);
    if (err != cudaSuccess) return err;
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev);
    if (blocks_per_sm < 1) return cudaErrorInvalidConfiguration;
  }
  const long long tiles = static_cast<long long>(batch) * G::kCBlocks * G::kTilesPerSample;
  const long long grid = tiles < static_cast<long long>(blocks_per_sm) * sm_count ? tiles : static_cast<long long>(blocks_per_sm) * sm_count;
  if (grid > 0) conv_kernel<P, E><<<static_cast<unsigned>(grid), G::kThreads, kSmem, stream>>>(x, packed, ep, batch);
  return cudaGetLastError();
}

}  // namespace conv_gemm
}  // namespace kgen
