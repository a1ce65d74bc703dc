// conv_gemm.cuh: an implicit-GEMM convolution on tensor cores (TF32 mma.sync
// m16n8k8, fp32 accumulators) with the next stage fused in as its epilogue.
// Ordinary C++ templates: a generated stage supplies a problem struct `P`
// (every size a compile-time constant; members listed at Geometry) and an
// epilogue struct `E`; nothing here knows a particular pipeline.
//
// GEMM view: M = output positions of one sample (a box tile TD x TH x TW),
// N = output channels, K = input channels x kernel taps, tap-major inside a
// chunk of kCI input channels. Per chunk, a CTA loads the input box its tile
// reads (halo included) into shared memory once, zero-filled outside the
// tensor, rounds it to TF32 once (tf32x3: splits it into hi and lo), and
// every tap reads it from there: a 3x3x3 kernel reuses each value 27 times.
// kCI is 4 or a multiple of 8, so the four k-lanes of an MMA fragment are four
// channels of one tap: every shared-memory offset is a compile-time constant
// plus a per-thread register (no index arithmetic in the main loop).
//
// Four main loops, three on tensor cores. `generic`: each k step loads its A fragments from shared
// memory. `window` (stride 1 in H and W, kCI 4 or 8): a warp's m-tiles are
// kMT consecutive rows in H of 16 positions in W, a thread's two fragment
// rows are the neighbours 2g and 2g + 1, so all the taps of one kd read a
// small window of the box that the thread loads into registers once
// ((kMT + KH - 1) x (KW + 1) values per channel lane instead of
// 2 kMT KH KW): shared-memory traffic drops 3x for a 3x3 kernel.
// `wgmma` (sm_90a; kCI a multiple of 8, tiles of 8 positions in W and a
// multiple of 8 rows in H, all output channels in one CTA): the warpgroup MMA
// reads both operands from shared memory through descriptors, no fragment
// is assembled in registers. The box of the next chunk is loaded into
// registers while this chunk's MMAs run (BoxRegs, no cp.async stages), then
// rounded to TF32 and stored as channel quads, 16 bytes per position
// ([quad][d][h][w phase][w / SW][4]: a W stride splits W into its phases), so
// the A operand of one tap, 64 output positions (8 rows in H of 8 in W) x 8
// channels, is a core-matrix layout at a compile-time offset: 8 positions of
// a row are 16 bytes apart, the rows SH box rows apart, the two quads of a k
// step a quad plane apart. The weights stay in shared memory for the whole
// kernel, in the layout the B descriptor reads. Several teams of warpgroups
// (kTeams) may share a CTA and its resident weights, each on its own tiles with
// its own A buffer and named barrier, so that one team's loads, MMAs and
// epilogue overlap another's.
// `direct` (Mma::kFp32): plain fp32 FMAs, no rounding (precision ieee, and
// split-TF32 problems whose K is too small for tensor cores to pay: a 3-channel
// 3x3x3 convolution pads K 81 -> 108 and runs three MMAs per product). A thread
// owns kPPT positions 32 apart in the tile (lanes along W: conflict-free loads
// from the box) x all kWarpN channels of its warp; per tap it reads its kPPT
// inputs from the box and the tap's kWarpN weights (the same for the whole
// warp: broadcast 16-byte loads from shared memory, where the weights stay
// for the whole kernel) and does kPPT x kWarpN FMAs.
//
// Weights are packed by pack_weights_kernel (the caller keeps them while the
// weight is unchanged); for mma.sync into MMA-fragment order and read straight
// from global memory (L1-resident after the first tile), one 8- or 16-byte
// load per n-tile and k-step. CTAs are persistent and walk their tiles; the
// mma.sync loops' cp.async stages run kStages deep across chunks and tiles. After a tile's last chunk the epilogue runs: on the accumulator
// registers (E::kStaged false: elementwise ops, reductions, statistics) or on
// a shared-memory copy of the tile (E::kStaged: pools, plain stores).
//
// 16-bit input and output (P::Elem kgen::bfloat16 or kgen::float16; float where P has none): every
// bfloat16 and float16 value (subnormals included) is exact in TF32, so one TF32 product of two 16-bit
// operands is exact, with fp32 accumulation as accurate as a 16-bit tensor-core MMA. Only the loads and
// stores change: the mma.sync loops' cp.async stages hold the 16-bit values as stored (8-byte pieces of
// 4), and the pass that rounds a landed stage to TF32 converts it into one fp32 buffer the main loop
// reads (Geometry: kRawStage, kLoOffset); the wgmma loop converts in BoxRegs. The weights are packed
// from an fp32 copy (the binding's). The accumulators are rounded to Elem before the epilogue where the
// plan says so (P::kRoundOutput: eager's 16-bit convolution output), and stores round to Elem.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "wgmma.cuh"
#include "../kgen_launch.cuh"
#include "../kgen_math.h"

namespace kgen {
namespace conv_gemm {

enum class Mma { kTf32, kTf32x3, kFp32 };                // kFp32: the direct loop's plain FMAs
enum class Loop { kGeneric, kWindow, kWgmma, kDirect };  // the main loops (see above)

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

// 8-byte copy global -> shared (both 8-byte aligned); `valid` false writes zeros.
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 8 : 0));
}

// The element type of a problem's input and output: P::Elem where it has one (a 16-bit plan's), else float.
template <class P, class = void>
struct ElemOf {
  using type = float;
};
template <class P>
struct ElemOf<P, std::void_t<typename P::Elem>> {
  using type = typename P::Elem;
};
template <class P>
using Elem = typename ElemOf<P>::type;
template <class P>
inline constexpr bool kHalfInput = sizeof(Elem<P>) == 2;
// Whether the accumulators are rounded to Elem before the epilogue (P::kRoundOutput, a 16-bit plan's
// rounding point: kgen/plan.py rounding_points).
template <class P, class = void>
struct RoundsOutput : std::false_type {};
template <class P>
struct RoundsOutput<P, std::void_t<decltype(P::kRoundOutput)>> : std::bool_constant<P::kRoundOutput> {};
template <class P>
inline constexpr bool kRoundsOutput = RoundsOutput<P>::value;
// Whether a fused epilogue E adds the convolution's bias (E::kConvBias: a 16-bit plan's convolution keeps its
// bias; E::Params::conv_bias) to the accumulators before its first op: to the output rounded to Elem (as cuDNN's
// 16-bit output, then ATen's bias add in the dtype), rounded again where the output is a rounding point.
template <class E, class = void>
struct AddsConvBias : std::false_type {};
template <class E>
struct AddsConvBias<E, std::void_t<decltype(E::kConvBias)>> : std::bool_constant<E::kConvBias> {};
template <class E>
inline constexpr bool kAddsConvBias = AddsConvBias<E>::value;
// The convolution's bias of channel `ch` where E adds it (else 0, unread).
template <class E>
__device__ __forceinline__ float conv_bias_value(const typename E::Params& ep, int ch) {
  if constexpr (kAddsConvBias<E>) {
    return ep.conv_bias[ch];
  } else {
    (void)ep, (void)ch;
    return 0.f;
  }
}
// Accumulator `v` as eager's convolution output holds it: rounded to Elem (kRoundsOutput), plus the bias `b`
// (kAddsConvBias; conv_bias_value), rounded again. Nothing where neither applies (float32 plans).
// kWgmmaAccumulators: rounded in 32-bit integer arithmetic (bfloat16_rounded, float16_rounded_integer; bit for bit
// the conversions): cvt.rn.bf16.f32 and float16_rounded's float form on wgmma accumulators spilled a folded
// convolution's fused epilogue, where in the other loops they are the cheaper (a window loop's 16-bit Store spilled
// with the integer form).
// Rounding and adding a channel's bias are monotone non-decreasing, so they commute with a max (NaN propagates
// either way): where the epilogue has no level-0 ops (E::kPreIdentity), a pool window's max is taken over the raw
// accumulators and conv_output runs once on it (phase_pool, pool_ring).
template <class P, class E, bool kWgmmaAccumulators = false>
__device__ __forceinline__ float conv_output(float v, float b) {
  auto round = [](float x) {
    if constexpr (kWgmmaAccumulators && std::is_same_v<Elem<P>, bfloat16>) {
      return bfloat16_rounded(x);
    } else if constexpr (kWgmmaAccumulators && std::is_same_v<Elem<P>, float16>) {
      return float16_rounded_integer(x);
    } else {
      return round_to_in_32_bit_registers<Elem<P>>(x);
    }
  };
  if constexpr (kRoundsOutput<P>) v = round(v);
  if constexpr (kAddsConvBias<E>) {
    v += b;
    if constexpr (kRoundsOutput<P>) v = round(v);
  } else {
    (void)b;
  }
  return v;
}

// One input value as float, through the read-only cache.
__device__ __forceinline__ float load_value(const float* p) { return __ldg(p); }
template <class T>
__device__ __forceinline__ float load_value(const T* p) {
  return to_float(T{__ldg(reinterpret_cast<const unsigned short*>(p))});
}

// 4 input values along W loaded together into registers, as stored (a float4, or 4 16-bit values in a uint2:
// 8 bytes), and as floats (quad_values: a 16-bit value is exact in float). Zeros where not `ok`.
template <class T>
struct QuadOf {
  using type = uint2;
};
template <>
struct QuadOf<float> {
  using type = float4;
};
template <class P>
using Quad = typename QuadOf<Elem<P>>::type;
__device__ __forceinline__ float4 load_quad(const float* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
}
template <class T>
__device__ __forceinline__ uint2 load_quad(const T* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
}
template <class T>
__device__ __forceinline__ float4 quad_values(const float4& v) {
  return v;
}
template <class T>
__device__ __forceinline__ float4 quad_values(const uint2& u) {
  return make_float4(to_float(T{static_cast<uint16_t>(u.x)}), to_float(T{static_cast<uint16_t>(u.x >> 16)}),
                     to_float(T{static_cast<uint16_t>(u.y)}), to_float(T{static_cast<uint16_t>(u.y >> 16)}));
}

// A piece of 4 input values along W, global -> shared, as stored (16 bytes of float, 8 of a 16-bit type).
__device__ __forceinline__ void copy_piece(float* dst, const float* src, bool valid) { cp_async16(dst, src, valid); }
template <class T>
__device__ __forceinline__ void copy_piece(T* dst, const T* src, bool valid) { cp_async8(dst, src, valid); }
// One input value, global -> shared, as stored: cp.async for a float; a 16-bit value (cp.async copies
// at least 4 bytes) by a plain load and store.
__device__ __forceinline__ void copy_value(float* dst, const float* src, bool valid) { cp_async4(dst, src, valid); }
template <class T>
__device__ __forceinline__ void copy_value(T* dst, const T* src, bool valid) {
  dst->bits = valid ? src->bits : 0;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// fp32 -> tf32, rounded to nearest (ties away from zero); NaN and inf stay.
__device__ __forceinline__ float to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// An operand of TF32 products, rounded as eager's cuDNN call rounds it (a problem's kTf32HalfEven):
// ties to even in cuDNN's transposed-convolution kernels, ties away from zero in its NC[D]HW forward
// ones (lab tf32_lab/cudnn_rounding.py in docs/performance.md). Another rounding than eager's differs from eager by about
// TF32's half ulp on ties, which a following normalization scales up past KernelBench's 1e-4.
template <bool kHalfEven>
__device__ __forceinline__ float to_tf32_operand(float x) {
  if constexpr (kHalfEven) {
    uint32_t r;
    asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
  } else {
    return to_tf32(x);
  }
}

// A flag between CTAs of one launch (in global memory): set it; wait until it is set.
__device__ __forceinline__ void signal_flag(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" : : "l"(flag), "r"(1) : "memory");
}

__device__ __forceinline__ void wait_flag(const int* flag) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen == 0);
}

// d += a * b for one m16n8k8 tile (a: 4 regs, b: 2 regs, d: 4 fp32).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const float (&a)[4], float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])), "r"(__float_as_uint(a[3])),
        "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// Warpgroup MMA: ordering and completion (sm_90a; wgmma.cuh's KGEN_HAS_WGMMA).
#if KGEN_HAS_WGMMA
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory writes of this thread (ordinary stores) become visible to the
// async proxy that wgmma reads through (after the next barrier).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#else
__device__ __forceinline__ void wgmma_fence() {}
__device__ __forceinline__ void wgmma_commit() {}
template <int N>
__device__ __forceinline__ void wgmma_wait() {}
__device__ __forceinline__ void fence_async_shared() {}
#endif
// A named barrier (0 is __syncthreads'): waits for `count` threads (a multiple of 32) at barrier `id`.
__device__ __forceinline__ void named_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }

// Keeps the compiler from moving accumulator accesses across the asynchronous MMAs.
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// A shared-memory matrix descriptor without swizzle: start address, the byte
// offset between core matrices (8 rows x 16 bytes) adjacent in K (`lbo`) and
// in M or N (`sbo`).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

// ------------------------------------------------------------------ geometry

constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }

// The smallest p >= n with p % 32 == want (spreads rows `p` apart over banks).
constexpr int pad_to_residue(int n, int want) { return n + ((want - n % 32) % 32 + 32) % 32; }
// The most groups g of `slots` threads (g dividing `channels`) that `threads` hold; 0 if none.
__host__ __device__ constexpr int plane_groups(int channels, int slots, int threads) {
  int best = 0;
  for (int g = 1; g <= channels; ++g)
    if (channels % g == 0 && g * slots <= threads) best = g;
  return best;
}

// Everything derived from the problem struct P, whose members (all static constexpr) are:
//   kCin, kCout                             channels
//   kInD, kInH, kInW                        input spatial size (1 for missing dims)
//   kOutD, kOutH, kOutW                     output positions computed (from 0)
//   kKD.., kSD.., kPD.., kDD..              kernel, stride, padding (may be negative), dilation per dim
//   kOutStrideD.., kOutResidueD..           output position o of GEMM position m: o = stride * m + residue
//                                           (1 and 0, except for a sub-pixel phase of a transposed convolution)
//   kFullD, kFullH, kFullW                  the output tensor's spatial size (for addressing)
//   kOutSample                              elements between the output's samples (kCout * kFullD * kFullH * kFullW,
//                                           more where it is a channel slice of a cat's output)
//   kWeightTransposed                       the weight is (Cin, Cout, K..) (a transposed convolution's), else (Cout, Cin, K..)
//   kWKD, kWKH, kWKW                        the weight's kernel size
//   kWStartD.., kWStepD.., kWFlip           tap j of this convolution is weight tap start + step * j
//                                           (kWFlip: start + step * (taps - 1 - j))
//   kChannelsLast                           input memory format (else NC[D]HW)
//   kTD, kTH, kTW                           output box of one tile
//   kCI                                     input channels per chunk: 4 or a multiple of 8 (direct loop: any)
//   kBN                                     output channels per CTA, a multiple of 8
//   kWarpsM, kWarpsN                        warp grid of a CTA (of each team)
//   kTeams                                  wgmma loop: teams of kWarpsM x kWarpsN warps sharing the weights (else 1)
//   kStages                                 cp.async pipeline depth (>= 2)
//   kPlaneResidue                           input channel plane stride % 32 (bank spread)
//   kMma                                    Mma::kTf32, kTf32x3 or (direct loop) kFp32
//   kLoop                                   Loop::kGeneric, kWindow, kWgmma or kDirect
template <class P>
struct Geometry {
  static constexpr bool kDirect = P::kLoop == Loop::kDirect;
  static_assert(kDirect || P::kCI == 4 || P::kCI % 8 == 0, "the four k-lanes of a fragment are four channels of one tap");
  static_assert(kDirect == (P::kMma == Mma::kFp32), "the direct loop and only it computes in plain fp32");
  // K of a chunk runs over tap slots, kd-major; with kCI == 4 a k step holds
  // two taps, so each kd's slots are padded to an even count (a padded slot
  // has zero weights and its A values are compile-time zeros).
  static constexpr int kTapsHW = P::kKH * P::kKW;
  static constexpr int kTaps = P::kKD * kTapsHW;
  static constexpr int kSlotsPerKd = P::kCI == 4 ? round_up(kTapsHW, 2) : kTapsHW;
  static constexpr int kSlots = P::kKD * kSlotsPerKd;
  static constexpr int kChunks = ceil_div(P::kCin, P::kCI);
  static constexpr int kKChunk = P::kCI * kSlots;  // K of one chunk, a multiple of 8
  static constexpr int kKSteps = kKChunk / 8;
  static constexpr int kStepsPerKd = kKSteps / P::kKD;
  static constexpr int kCBlocks = ceil_div(P::kCout, P::kBN);
  static constexpr int kNTiles = P::kBN / 8;  // n-tiles of a CTA
  static constexpr int kSplits = P::kMma == Mma::kTf32x3 ? 2 : 1;
  // tf32x3 over a long K adds each k step's products to the accumulators on the CUDA cores
  // (mma_step): in place, the tensor cores' truncating adds grow the error with K (H100/H200,
  // lab conv_lab/k_error.py in docs/performance.md: 2.9-3.1x eager's at K = 72, 3.5-5.2x at 288, 19-22x at 9216;
  // with the adds 0.3-0.5x everywhere), but the adds cost 9-35% of the loop at K = 72-216.
  static constexpr int kPromoteMinK = 256;
  static constexpr bool kPromoteSteps = kSplits == 2 && P::kCin * kTaps >= kPromoteMinK;
  static constexpr bool kWindow = P::kLoop == Loop::kWindow;
  static constexpr bool kWg = P::kLoop == Loop::kWgmma;

  // The input box a tile reads.
  static constexpr int kBD = (P::kTD - 1) * P::kSD + (P::kKD - 1) * P::kDD + 1;
  static constexpr int kBH = (P::kTH - 1) * P::kSH + (P::kKH - 1) * P::kDH + 1;
  static constexpr int kBW = (P::kTW - 1) * P::kSW + (P::kKW - 1) * P::kDW + 1;
  // Input is read in 16-byte pieces along W when every piece lies wholly inside
  // or wholly outside the input: NC[D]HW; W, the tile step and the padding
  // multiples of 4. Rows land so in shared memory when channel planes are
  // 16-byte aligned too.
  static constexpr bool kVecW = !P::kChannelsLast && P::kInW % 4 == 0 && (P::kTW * P::kSW) % 4 == 0 && P::kPW % 4 == 0;
  static constexpr bool kVecRows = kVecW && P::kPlaneResidue % 4 == 0;
  // The window loop reads pairs up to one column past the box.
  static constexpr int kBWPad = kVecRows ? round_up(kBW + (kWindow ? 1 : 0), 4) : round_up(kBW + (kWindow ? 1 : 0), 2);
  static constexpr int kPlane = pad_to_residue(kBD * kBH * kBWPad, P::kPlaneResidue);
  static constexpr int kInStage = round_up(P::kCI * kPlane, 4);
  // mma.sync loops: floats of one cp.async stage (16-bit input: the values as stored, half as many
  // floats; the rounding pass converts a landed stage into the fp32 buffer at kLoOffset)
  static constexpr int kRawStage = kHalfInput<P> ? kInStage / 2 : kInStage;
  // wgmma loop: the A buffer, the box as [quad][bd][bh][w phase][w / SW][4 channels].
  static constexpr int kQuads = P::kCI / 4;
  static constexpr int kColsPerPhase = ceil_div(kBW, P::kSW);
  static constexpr int kRowFloats = 4 * P::kSW * kColsPerPhase;  // one box row (d, h)
  static constexpr int kQuadPlane = kBD * kBH * kRowFloats;
  static constexpr int kABuf = kQuads * kQuadPlane;

  // Tiles and warps.
  static constexpr int kM = P::kTD * P::kTH * P::kTW;
  static constexpr int kMPad = pad_to_residue(kM, 4);  // staged tile rows: 8 rows x 4 column pairs hit 32 banks
  static constexpr int kTilesD = ceil_div(P::kOutD, P::kTD);
  static constexpr int kTilesH = ceil_div(P::kOutH, P::kTH);
  static constexpr int kTilesW = ceil_div(P::kOutW, P::kTW);
  static constexpr int kTilesPerSample = kTilesD * kTilesH * kTilesW;
  // wgmma loop: kTeams teams of kWarpsM x kWarpsN warps share the CTA's resident weights.
  // Each team walks its own tiles with its own A buffer, staged tile and scratch, and
  // synchronizes on its own named barrier (team_sync), so that one team's loads, MMAs and
  // epilogue overlap another's, as CTAs would, without a copy of the weights each.
  static constexpr int kTeams = P::kTeams;
  static constexpr int kTeamThreads = 32 * P::kWarpsM * P::kWarpsN;
  static constexpr int kThreads = kTeams * kTeamThreads;
  static constexpr int kWarpM = kM / P::kWarpsM;      // rows per warp (mma.sync loops)
  static constexpr int kWarpN = P::kBN / P::kWarpsN;  // columns per warp
  // wgmma loop: warpgroups form a kGroups x kWarpsN grid; warpgroup (wg, n)
  // takes the 64-row m-blocks wg, wg + kGroups, ... and the n-th kWarpN columns.
  static constexpr int kGroups = P::kWarpsM / 4;
  static constexpr int kMBlocks = kM / 64;
  // direct loop: a thread's positions (32 apart) and channels, held as acc[kPPT / 2][kWarpN / 2][4]
  static constexpr int kPPT = kWarpM / 32;
  static constexpr int kMT = kWg ? kMBlocks / (kGroups > 0 ? kGroups : 1) : kDirect ? kPPT / 2 : kWarpM / 16;  // m-tiles (wgmma: m-blocks) per warp
  static constexpr int kMTStride = kWg ? 64 * kGroups : 16;  // tile rows between a warp's m-tiles
  static constexpr int kNT = kDirect ? kWarpN / 2 : kWarpN / 8;
  static_assert(kWg || kM % (16 * P::kWarpsM) == 0, "tile rows must split into 16-row MMA tiles per warp");
  static_assert(!kDirect || (kWarpM % 64 == 0 && kWarpN % 4 == 0 && ceil_div(P::kCout, P::kBN) == 1),
                "direct loop: an even number of positions per thread, whole 16-byte weight loads, one channel block");
  static_assert(!kWg || (P::kCI % 8 == 0 && P::kTW == 8 && P::kTH % 8 == 0 && P::kWarpsM % 4 == 0 &&
                         kMBlocks % kGroups == 0 && ceil_div(P::kCout, P::kBN) == 1 && P::kBN <= 128),
                "wgmma loop: kCI a multiple of 8, tiles of 8 in W and 8k in H, warpgroups split the m-blocks, one channel block");
  static_assert(!kWg || kWarpN % 8 == 0, "wgmma loop: a warpgroup's columns are whole 8-column tiles");
  static_assert(kTeams == 1 || (kWg && kTeams <= 15), "teams: the wgmma loop, at most 15 (named barriers 1 .. 15)");
  static_assert(P::kBN % (8 * P::kWarpsN) == 0, "kBN must split into 8-column MMA tiles per warp");
  static_assert(kWg || P::kStages >= 2, "at least double buffering (the wgmma loop stages through registers)");

  // Window main loop: warp row -> (d, block of kMT rows in H, 16-wide segment in W).
  static constexpr int kHBlocks = P::kTH / kMT;
  static constexpr int kWSegs = P::kTW / 16;
  static constexpr int kWinRows = kMT + (P::kKH - 1) * P::kDH;
  static constexpr int kWinCols = round_up((P::kKW - 1) * P::kDW + 2, 2);
  static constexpr int kLanesC = P::kCI == 8 ? 2 : 1;  // channel lanes a thread holds
  static_assert(!kWindow || (P::kSH == 1 && P::kSW == 1 && (P::kCI == 4 || P::kCI == 8) && P::kTW % 16 == 0 &&
                                P::kPlaneResidue % 2 == 0 &&
                                P::kTH % kMT == 0 && P::kTD * kHBlocks * kWSegs == P::kWarpsM),
                "window main loop: stride 1 in H and W, kCI 4 or 8, warps tile (TD, TH / kMT, TW / 16)");

  // Packed weights. mma.sync loops: [cblock][chunk][k step][n-tile][lane][split][2] floats.
  // wgmma: [split][chunk][k step][n-tile][k quad][8 columns][4 k], the B operand's core matrices.
  static constexpr int kFragFloats = 2 * kSplits;  // per lane, n-tile and k step
  static constexpr long long kPackedStep = static_cast<long long>(kNTiles) * 32 * kFragFloats;
  static constexpr int kWgStepFloats = P::kBN * 8;  // B of one k step
  static constexpr int kWgSplitFloats = kChunks * kKSteps * kWgStepFloats;
  // direct: [chunk][channel of the chunk][tap][kBN], fp32.
  static constexpr long long kPackedFloats =
      kWg       ? static_cast<long long>(kSplits) * kWgSplitFloats
      : kDirect ? static_cast<long long>(kChunks) * P::kCI * kTaps * P::kBN
                : static_cast<long long>(kCBlocks) * kChunks * kKSteps * kPackedStep;

  // Shared memory in floats: weights (wgmma, direct) | input stages | the A buffer (wgmma; tf32x3: hi
  // then lo) or the lo parts of a stage (mma.sync, tf32x3) | staged tile | epilogue scratch.
  static constexpr int kWeightFloats = kWg || kDirect ? static_cast<int>(kPackedFloats) : 0;
  static constexpr int kStageOffset = kWeightFloats;
  static constexpr int kLoOffset = kStageOffset + (kWg ? 0 : P::kStages * kRawStage);  // also the A buffer's (no stages)
  static constexpr int kABufFloats = kSplits * kABuf;  // a team's A buffer (wgmma loop; tf32x3: hi then lo)
  // (mma.sync loops: tf32x3's lo parts of a stage, or a 16-bit input's stage converted to fp32)
  static constexpr int kTileOffset = kLoOffset + (kWg ? kTeams * kABufFloats : kSplits == 2 || kHalfInput<P> ? kInStage : 0);
  static_assert(!kHalfInput<P> || (kSplits == 1 && !kDirect), "16-bit input: single TF32 products (exact for 16-bit operands)");
};

// k of a chunk -> its tap (kd, kh, kw) and channel; `real` false for padded slots.
struct KIndex {
  int kd, kh, kw, c;
  bool real;
};
template <class P>
__host__ __device__ constexpr KIndex k_index(int k) {
  using G = Geometry<P>;
  const int slot = k / P::kCI, c = k % P::kCI;
  const int kd = slot / G::kSlotsPerKd, r = slot % G::kSlotsPerKd;
  return KIndex{kd, r / P::kKW, r % P::kKW, c, r < G::kTapsHW};
}

// The shared-memory offset of k inside a stage, without the thread's channel lane.
template <class P>
__host__ __device__ constexpr int k_offset(int k) {
  using G = Geometry<P>;
  const KIndex q = k_index<P>(k);
  return q.c * G::kPlane + (q.kd * P::kDD * G::kBH + q.kh * P::kDH) * G::kBWPad + q.kw * P::kDW;
}

// The tiles of a batch: per sample, kCBlocks output-channel blocks of kTilesPerSample position tiles.
template <class P>
__host__ __device__ constexpr long long batch_tiles(int batch) {
  return static_cast<long long>(batch) * Geometry<P>::kCBlocks * Geometry<P>::kTilesPerSample;
}

// Where a tile lies: sample, output-channel block, its number inside the sample, its first output position.
struct TileCoord {
  int n, cblock, index;
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

// Whether row m of the tile at `c` is an output position (tiles at the edges are partial).
template <class P>
__device__ __forceinline__ bool row_valid(const TileCoord& c, int m) {
  return c.od + row_d<P>(m) < P::kOutD && c.oh + row_h<P>(m) < P::kOutH && c.ow + row_w<P>(m) < P::kOutW;
}

// Position in the output tensor of row m of the tile at `c`.
template <class P>
__device__ __forceinline__ int out_d(const TileCoord& c, int m) { return P::kOutStrideD * (c.od + row_d<P>(m)) + P::kOutResidueD; }
template <class P>
__device__ __forceinline__ int out_h(const TileCoord& c, int m) { return P::kOutStrideH * (c.oh + row_h<P>(m)) + P::kOutResidueH; }
template <class P>
__device__ __forceinline__ int out_w(const TileCoord& c, int m) { return P::kOutStrideW * (c.ow + row_w<P>(m)) + P::kOutResidueW; }

// Offset of (sample, channel, row m) in an NC[D]HW output tensor whose samples lie P::kOutSample apart.
template <class P>
__device__ __forceinline__ long long out_offset(const TileCoord& c, int channel, int m) {
  return static_cast<long long>(c.n) * P::kOutSample +
         (static_cast<long long>(channel) * P::kFullD + out_d<P>(c, m)) * P::kFullH * P::kFullW +
         static_cast<long long>(out_h<P>(c, m)) * P::kFullW + out_w<P>(c, m);
}

// Tile row m (linear over (d, h, w), w fastest) and output channel (inside
// the CTA's block) of each accumulator: acc[mt][nt][i] holds row m(mt, i),
// column n(nt, i). Generic loop: the warp's rows are m0 + mt * 16 + fragment
// row. Window loop: m-tile mt is row h0 + mt at depth d0, positions w0 + 2g
// (fragment row g) and w0 + 2g + 1 (row g + 8). wgmma loop: m-tile mt is the
// warpgroup's mt-th m-block (kMTStride rows apart), the warp's 16 rows of it
// at m0, laid out as in the generic loop. Direct loop: position p = 2 mt + i / 2
// of the thread is row m0 + 32 p, channel 2 nt + i % 2 of the warp's.
template <class P>
struct FragMap {
  int m0, n0, g, t;
  int d0, h0, w0;  // window loop only
  __device__ __forceinline__ int m(int mt, int i) const {
    if constexpr (P::kLoop == Loop::kWindow) {
      return ((d0 * P::kTH) + h0 + mt) * P::kTW + w0 + 2 * g + i / 2;
    } else if constexpr (P::kLoop == Loop::kDirect) {
      return m0 + 32 * (2 * mt + i / 2);
    } else {
      return m0 + mt * Geometry<P>::kMTStride + g + (i / 2) * 8;
    }
  }
  __device__ __forceinline__ int n(int nt, int i) const {
    if constexpr (P::kLoop == Loop::kDirect) {
      // one warp column: a compile-time 0, so the epilogues' checks against kCout fold (kept to the
      // direct loop: on the window loop the same change cost div_max's fused kernel 26 registers)
      return (P::kWarpsN == 1 ? 0 : n0) + 2 * nt + (i % 2);
    } else {
      return n0 + nt * 8 + 2 * t + (i % 2);
    }
  }
};

// ------------------------------------------------------------------ reductions

// This thread's place in its team (the CTA's threads when there is one team): the main loop
// and the epilogues index by it.
template <class P>
__device__ __forceinline__ int team_thread() {
  return static_cast<int>(Geometry<P>::kTeams == 1 ? threadIdx.x : threadIdx.x % Geometry<P>::kTeamThreads);
}

// A barrier over this thread's team: __syncthreads, or with several teams the team's named
// barrier (1 + team). The main loop and the epilogues use it instead of __syncthreads.
template <class P>
__device__ __forceinline__ void team_sync() {
  if constexpr (Geometry<P>::kTeams == 1) {
    __syncthreads();
  } else {
    named_sync(1 + static_cast<int>(threadIdx.x) / Geometry<P>::kTeamThreads, Geometry<P>::kTeamThreads);
  }
}

// Sum over the team, in a fixed order whatever the timing; the result is valid in the team's
// thread 0. `scratch` holds one float per warp; the caller's next team_sync guards its reuse.
template <class P>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int tid = team_thread<P>();
  if (tid % 32 == 0) scratch[tid / 32] = v;
  team_sync<P>();
  float total = 0.f;
  if (tid == 0) {
    for (int w = 0; w < Geometry<P>::kTeamThreads / 32; ++w) total += scratch[w];
  }
  return total;
}

// Whether a staged epilogue's tile and scratch live in the input stage of the tile's last chunk
// (mma.sync and direct loops, where they fit): once every warp is done with that stage, nothing
// reads it again, and the next load into it comes after the epilogue's closing barrier. Spares
// the tile's own shared memory (more CTAs per SM) for one barrier per tile.
template <class P, class E>
__host__ __device__ constexpr bool tile_in_stage() {
  using G = Geometry<P>;
  return !G::kWg && E::kStaged && P::kBN * G::kMPad + E::kScratchFloats <= G::kInStage;
}

// Shared memory of a team after the A buffers: its staged tile (E::kStaged) and its epilogue scratch
// (none where they live in an input stage).
template <class P, class E>
__host__ __device__ constexpr int team_floats() {
  return tile_in_stage<P, E>() ? 0 : (E::kStaged ? P::kBN * Geometry<P>::kMPad : 0) + E::kScratchFloats;
}

// The tile at `c`'s extent in output positions along D, H and W (tiles at the edges are partial).
struct TileExtent {
  int d, h, w;
};
template <class P>
__device__ __forceinline__ TileExtent tile_extent(const TileCoord& c) {
  auto part = [](int o, int t, int size) { return size - o < t ? size - o : t; };
  return {part(c.od, P::kTD, P::kOutD), part(c.oh, P::kTH, P::kOutH), part(c.ow, P::kTW, P::kOutW)};
}

// Output positions inside the tile at `c`.
template <class P>
__device__ __forceinline__ int valid_rows(const TileCoord& c) {
  const TileExtent e = tile_extent<P>(c);
  return e.d * e.h * e.w;
}

// Per-channel sums over the tile of f(mt, nt, i) (a fixed order; generic,
// window and direct loops): leaves scratch[warp_m * kBN + n] for each warp
// row, then a barrier; the caller adds the rows up.
template <class P, class F>
__device__ __forceinline__ void channel_sums(const FragMap<P>& fm, float* scratch, F f) {
  using G = Geometry<P>;
  const int warp_m = fm.m0 / G::kWarpM;
  // the lanes that hold one channel's rows: all 32 (direct loop: a thread holds every channel of the
  // warp) or the 8 with the same t (MMA fragments)
  constexpr bool kDirect = P::kLoop == Loop::kDirect;
#pragma unroll
  for (int nt = 0; nt < G::kNT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float s = 0.f;
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt) s += f(mt, nt, j) + f(mt, nt, 2 + j);
#pragma unroll
      for (int o = kDirect ? 1 : 4; o < 32; o *= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (kDirect ? threadIdx.x % 32 == 0 : fm.g == 0) scratch[warp_m * P::kBN + fm.n(nt, j)] = s;
    }
  }
  team_sync<P>();
}

// The convolution output (+ bias), NC[D]HW: the plain epilogue. kStagedTile: from the staged
// tile (consecutive threads store consecutive positions), else from the accumulators.
// T: the output's element type (a 16-bit one: the store rounds; the bias adds to the rounded convolution
// value, as eager's 16-bit convolution then its bias add round twice).
template <bool kStagedTile, bool kMoments = false, class T = float>
struct StoreEpilogue {
  struct PlainParams {
    const T* bias;
    T* out;
  };
  // ... and the tiles' moments per channel of what is stored, for a batch_stats stage after it (null: none
  // wanted, as when the stage runs on its own): [sample][channel][P::kMomentsTiles], this problem's tiles
  // from P::kMomentsTile0 (TileMoments: count, mean, M2 about the tile's mean).
  struct MomentsParams {
    const float* bias;
    float* out;
    kgen::TileMoments* moments;
  };
  using Params = std::conditional_t<kMoments, MomentsParams, PlainParams>;
  static constexpr bool kStaged = kStagedTile;
  static constexpr int kScratchFloats = 0;
  template <class P, class Acc>
  __device__ static void apply_fragments(const Params& p, const Acc& acc, const FragMap<P>& fm, float*, const TileCoord& c) {
    static_assert(!kMoments, "moments are gathered from the staged tile");
    static_assert(std::is_same_v<T, Elem<P>>, "the output's type is the problem's");
    using G = Geometry<P>;
#pragma unroll
    for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int co = c.cblock * P::kBN + fm.n(nt, i);
        const float b = co < P::kCout && p.bias ? p.bias[co] : 0.f;
#pragma unroll
        for (int mt = 0; mt < G::kMT; ++mt) {
          const int m = fm.m(mt, i);
          if (co < P::kCout && row_valid<P>(c, m)) p.out[out_offset<P>(c, co, m)] = acc[mt][nt][i] + b;
        }
      }
  }
  template <class P>
  __device__ static void apply(const Params& p, const float* tile, float*, const TileCoord& c) {
    static_assert(std::is_same_v<T, Elem<P>> && (!kMoments || std::is_same_v<T, float>), "the output's type is the problem's");
    if constexpr (kMoments) {
      if (p.out) store<P>(p, tile, c);  // null: only the moments are wanted (ConvGemmStage.output_dropped)
      if (p.moments) tile_moments<P>(p, tile, c);
    } else {
      store<P>(p, tile, c);
    }
  }
  template <class P>
  __device__ static void store(const Params& p, const float* tile, const TileCoord& c) {
    using G = Geometry<P>;
    const int tid = team_thread<P>();  // this thread in its team
    if constexpr (P::kOutStrideD * P::kOutStrideH * P::kOutStrideW > 1) {
      // A sub-pixel phase's outputs interleave with the other phases': channel by channel (the walk
      // below was 1-8% slower on KernelBench #58 and #72)
      for (int i = tid; i < P::kBN * G::kM; i += G::kTeamThreads) {
        const int n = i / G::kM, m = i % G::kM, co = c.cblock * P::kBN + n;
        if (co < P::kCout && row_valid<P>(c, m)) p.out[out_offset<P>(c, co, m)] = tile[n * G::kMPad + m] + (p.bias ? p.bias[co] : 0.f);
      }
      return;
    }
    // A thread keeps its positions (bounds and offset once) and walks the channels: per output a
    // load, an add and a store (per output index math was most of the kernel's instructions where
    // the convolution is cheap: KernelBench #87's conv_gemm kernel, SASS).
    constexpr long long kChannelStride = static_cast<long long>(P::kFullD) * P::kFullH * P::kFullW;
    const int c0 = c.cblock * P::kBN;
    for (int m = tid; m < G::kM; m += G::kTeamThreads) {
      if (!row_valid<P>(c, m)) continue;
      T* out = p.out + out_offset<P>(c, c0, m);
      for (int n = 0; n < P::kBN; ++n) {
        if (c0 + n < P::kCout) out[n * kChannelStride] = tile[n * G::kMPad + m] + (p.bias ? p.bias[c0 + n] : 0.f);
      }
    }
  }
  // The tile's (count, mean, M2) per channel of the values stored (tile + bias): a warp per channel, its
  // lanes over the positions, one pass of sums of d = value - shift and d * d reduced by the warp's shuffle
  // tree (a fixed order), the shift being the tile's first value (row 0 is always an output position), so a
  // channel far from zero keeps its spread; the bias only moves the mean. A whole tile (no position past
  // the output) takes 16-byte loads and no bounds: this loop was half of KernelBench #72's statistics pass
  // (13 instructions per value with the bounds, ncu). It only reads the staged tile, as the store does: no
  // barrier. NaN or inf makes the tile's mean or M2 NaN or inf, and the merged statistics NaN, as PyTorch's.
  static constexpr int kMomentsUnroll = 4;
  template <class P>
  __device__ static void tile_moments(const Params& p, const float* tile, const TileCoord& c) {
    constexpr int kWarps = Geometry<P>::kTeamThreads / 32;
    const int warp = team_thread<P>() / 32;
    const TileExtent e = tile_extent<P>(c);
    const bool whole = e.d == P::kTD && e.h == P::kTH && e.w == P::kTW;
    // (the two forms are what ptxas fits in the window loop's 128 registers without spilling)
    if constexpr (P::kBN <= kWarps) {
#pragma unroll 1
      for (int n = warp; n < P::kBN; n += kWarps) channel_moments<P>(p, tile, c, n, e, whole);
    } else {
#pragma unroll 1
      for (int k = 0; k < (P::kBN + kWarps - 1) / kWarps; ++k) {
        const int n = warp + k * kWarps;
        if (P::kBN % kWarps != 0 && n >= P::kBN) break;  // the same for the whole warp
        channel_moments<P>(p, tile, c, n, e, whole);
      }
    }
  }
  // Channel n of the tile (a warp), of extent `e` (`whole`: the full tile).
  template <class P>
  __device__ __forceinline__ static void channel_moments(const Params& p, const float* tile, const TileCoord& c, int n, const TileExtent& e,
                                                         bool whole) {
    using G = Geometry<P>;
    const int co = c.cblock * P::kBN + n, lane = threadIdx.x % 32;
    if (P::kCout % P::kBN != 0 && co >= P::kCout) return;  // the same for the whole warp
    const float* row = tile + n * G::kMPad;
    const float shift = row[0];
    float s1 = 0.f, s2 = 0.f;
    auto add = [&](float v) {
      const float d = v - shift;
      s1 += d;
      s2 = fmaf(d, d, s2);
    };
    constexpr int kM = G::kM, kStep = 32 * kMomentsUnroll;
    if (kM % kStep == 0 && whole) {
#pragma unroll 2
      for (int m = 4 * lane; m < kM; m += kStep) {  // lane's 4 consecutive positions (kMPad % 4 == 0: aligned)
        const float4 v = *reinterpret_cast<const float4*>(row + m);
        add(v.x);
        add(v.y);
        add(v.z);
        add(v.w);
      }
    } else {
#pragma unroll 1
      for (int m0 = 0; m0 < kM; m0 += kStep) {  // the lanes over the tile's positions, kMomentsUnroll loads in flight
#pragma unroll
        for (int u = 0; u < kMomentsUnroll; ++u) {
          const int m = m0 + 32 * u + lane;
          if ((kM % kStep == 0 || m < kM) && row_valid<P>(c, m)) add(row[m]);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
      s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    if (lane == 0) {
      const float count = static_cast<float>(e.d * e.h * e.w), offset = s1 / count;  // the mean's distance from the shift
      const float b = p.bias ? p.bias[co] : 0.f;
      p.moments[(static_cast<long long>(c.n) * P::kCout + co) * P::kMomentsTiles + (P::kMomentsTile0 + c.index)] =
          kgen::TileMoments{count, (shift + b) + offset, fmaxf(s2 - s1 * offset, 0.f)};
    }
  }
};

// ------------------------------------------------------------------ loads

// Offset of input element (sample n, channel ci, position id, ih, iw) in x (NC[D]HW or channels_last).
template <class P>
__device__ __forceinline__ long long input_offset(int n, int ci, int id, int ih, int iw) {
  if constexpr (P::kChannelsLast) {
    return (((static_cast<long long>(n) * P::kInD + id) * P::kInH + ih) * P::kInW + iw) * P::kCin + ci;
  } else {
    return (((static_cast<long long>(n) * P::kCin + ci) * P::kInD + id) * P::kInH + ih) * P::kInW + iw;
  }
}

// One 16-byte (row bh, piece) slot of the box, of kChannels channels from input channel c0 (stage
// planes from `dst`): every (channel, depth) plane at compile-time offsets, in shared memory and in x,
// no index arithmetic per copy (NC[D]HW, kVecRows).
template <class P, int kChannels, class T>
__device__ __forceinline__ void load_slot(T* dst, const T* __restrict__ x, const TileCoord& c, int c0, int slot) {
  using G = Geometry<P>;
  constexpr int kPieces = G::kBWPad / 4;
  const int id0 = c.od * P::kSD - P::kPD, ih0 = c.oh * P::kSH - P::kPH, iw0 = c.ow * P::kSW - P::kPW;
  const int bh = slot / kPieces, piece = slot % kPieces;
  const int ih = ih0 + bh, iw = iw0 + piece * 4;
  const bool hw_ok = ih >= 0 && ih < P::kInH && iw >= 0 && iw < P::kInW;
  constexpr long long kChannelStride = static_cast<long long>(P::kInD) * P::kInH * P::kInW;
  constexpr int kDepthStride = P::kInH * P::kInW;
  const long long first = (static_cast<long long>(c.n) * P::kCin + c0) * kChannelStride +
                          static_cast<long long>(id0) * kDepthStride + ih * P::kInW + iw;
  T* d_slot = dst + bh * G::kBWPad + piece * 4;
#pragma unroll
  for (int ch = 0; ch < kChannels; ++ch) {
    const bool c_ok = hw_ok && c0 + ch < P::kCin;
#pragma unroll
    for (int bd = 0; bd < G::kBD; ++bd) {
      const bool ok = c_ok && id0 + bd >= 0 && id0 + bd < P::kInD;
      copy_piece(d_slot + ch * G::kPlane + bd * G::kBH * G::kBWPad, ok ? x + (first + ch * kChannelStride + bd * kDepthStride) : x, ok);
    }
  }
}

// Input box of chunk `chunk` for the tile at `c` into one shared-memory stage (the values as stored: T is Elem<P>).
template <class P, class T>
__device__ __forceinline__ void load_input(T* dst, const T* __restrict__ x, const TileCoord& c, int chunk) {
  using G = Geometry<P>;
  const int id0 = c.od * P::kSD - P::kPD, ih0 = c.oh * P::kSH - P::kPH, iw0 = c.ow * P::kSW - P::kPW;
  const int ci0 = chunk * P::kCI;
  constexpr int kPieces = G::kBWPad / 4;  // 16-byte pieces of a box row (kVecRows)
  constexpr int kSlots = G::kBH * kPieces;  // pieces of one (channel, depth) plane of the box
  constexpr int kPlaneGroups = G::kVecRows ? plane_groups(P::kCI, kSlots, G::kThreads) : 0;
  constexpr int kGroupChannels = kPlaneGroups ? P::kCI / kPlaneGroups : 0;
  if constexpr (kPlaneGroups > 0 && kGroupChannels * G::kBD <= 64) {
    // A thread keeps one slot of every plane: groups of kSlots threads split the chunk's channels.
    const int slot = threadIdx.x % kSlots, group = threadIdx.x / kSlots;
    if (group >= kPlaneGroups) return;
    load_slot<P, kGroupChannels>(dst + group * kGroupChannels * G::kPlane, x, c, ci0 + group * kGroupChannels, slot);
  } else if constexpr (G::kVecRows && kSlots > G::kThreads && P::kCI * G::kBD <= 64) {
    // More slots than threads: a thread takes slots tid, tid + kThreads, ... of every plane (the row
    // walk below cost instnorm_clamp_max's onepass kernel 10% of its stall samples, docs/performance.md, 5d1d49e-c7a9aa0).
#pragma unroll 1
    for (int slot = threadIdx.x; slot < kSlots; slot += G::kThreads) load_slot<P, P::kCI>(dst, x, c, ci0, slot);
  } else if constexpr (G::kVecRows) {
    // A thread keeps one 16-byte piece of a row and walks the rows (ci, bd, bh)
    // kRowsPerPass apart: its column test and offsets are found once per tile.
    static_assert(kPieces <= G::kThreads, "a box row's pieces fit in the block");
    constexpr int kRowsPerPass = G::kThreads / kPieces;
    constexpr int kRows = P::kCI * G::kBD * G::kBH;
    const int piece = threadIdx.x % kPieces, sub = threadIdx.x / kPieces;
    if (sub >= kRowsPerPass) return;
    const int iw = iw0 + piece * 4;
    const bool w_ok = iw >= 0 && iw < P::kInW;
    const T* x_sample = x + static_cast<long long>(c.n) * P::kCin * P::kInD * P::kInH * P::kInW;
    T* d_col = dst + piece * 4;
#pragma unroll 2
    for (int row = sub; row < kRows; row += kRowsPerPass) {
      const int bh = row % G::kBH, bd = (row / G::kBH) % G::kBD, ci = row / (G::kBH * G::kBD);
      const int id = id0 + bd, ih = ih0 + bh;
      const bool ok = w_ok && ci0 + ci < P::kCin && id >= 0 && id < P::kInD && ih >= 0 && ih < P::kInH;
      const long long off = static_cast<long long>(((ci0 + ci) * P::kInD + id) * P::kInH + ih) * P::kInW + iw;
      copy_piece(d_col + ci * G::kPlane + (bd * G::kBH + bh) * G::kBWPad, ok ? x_sample + off : x, ok);
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
      const long long off = input_offset<P>(c.n, ci0 + ci, id, ih, iw);
      copy_value(dst + ci * G::kPlane + (bd * G::kBH + bh) * G::kBWPad + bw, ok ? x + off : x, ok);
    }
  }
}

// The lo part of split-TF32 input value x whose hi part is `hi`: x - hi (zero for NaN and inf, so that
// only hi carries them); zero for a problem with kEagerProducts, whose input is rounded as eager's TF32
// call rounds it (hi) and multiplied by full-precision weights (hi + lo: ConvGemmStage.eager_products).
template <class P>
__device__ __forceinline__ float input_lo(float x, float hi) {
  if constexpr (P::kEagerProducts) {
    return 0.f;
  } else {
    return isfinite(x) ? to_tf32(x - hi) : 0.f;
  }
}

// Rounds a landed stage to TF32 in place; tf32x3 also writes lo (input_lo). A 16-bit input's stage
// (the values as stored, kRawStage floats) is converted into `lo` instead: exact in TF32, nothing to round.
template <class P>
__device__ __forceinline__ void round_stage(float* stage, float* lo) {
  using G = Geometry<P>;
  if constexpr (kHalfInput<P>) {
    using T = Elem<P>;
    struct alignas(8) Quad {
      T v[4];
    };
    const Quad* r4 = reinterpret_cast<const Quad*>(stage);
    float4* l4 = reinterpret_cast<float4*>(lo);
    for (int e = threadIdx.x; e < G::kInStage / 4; e += G::kThreads) {
      const Quad q = r4[e];
      l4[e] = make_float4(q.v[0], q.v[1], q.v[2], q.v[3]);
    }
    return;
  }
  float4* s4 = reinterpret_cast<float4*>(stage);
  float4* l4 = reinterpret_cast<float4*>(lo);
  for (int e = threadIdx.x; e < G::kInStage / 4; e += G::kThreads) {
    const float4 v = s4[e];
    constexpr bool kEven = P::kTf32HalfEven;
    const float4 h = make_float4(to_tf32_operand<kEven>(v.x), to_tf32_operand<kEven>(v.y), to_tf32_operand<kEven>(v.z), to_tf32_operand<kEven>(v.w));
    s4[e] = h;
    if constexpr (G::kSplits == 2) {
      l4[e] = make_float4(input_lo<P>(v.x, h.x), input_lo<P>(v.y, h.y), input_lo<P>(v.z, h.z), input_lo<P>(v.w, h.w));
    }
  }
}

// wgmma loop: the box of one chunk passes through registers on its way to the
// A buffer: loaded (16-byte loads along W where rows allow) while the previous
// chunk's MMAs run, then rounded to TF32 and stored as channel quads (tf32x3:
// the lo parts into a second buffer). An item is 4 positions along W of the 4
// channels of a quad: a 4 x 4 transpose in registers, 4 16-byte stores (with
// a W stride of 4, each of the 4 positions goes to its own phase, so
// consecutive threads' stores are consecutive).
// kLoaders threads share the box; `tid` is this thread's place among them.
template <class P, int kLoaders>
struct BoxRegs {
  using G = Geometry<P>;
  static constexpr int kGroupsW = ceil_div(G::kBW, 4), kRows = G::kBD * G::kBH;
  static constexpr int kItems = G::kQuads * kRows * kGroupsW;
  static constexpr int kPer = ceil_div(kItems, kLoaders);  // items per thread
  float v[kPer][4][4];  // [item][channel][position]

  __device__ __forceinline__ void load(const Elem<P>* __restrict__ x, const TileCoord& c, int chunk, int tid) {
#pragma unroll
    for (int p = 0; p < kPer; ++p) load_item(p, x, c, chunk, tid);
  }

  __device__ __forceinline__ void store(float* a, int tid) const {
#pragma unroll
    for (int p = 0; p < kPer; ++p) store_item(p, a, tid);
  }

  // Item p of this thread: its loads (zeros outside the input) into v[p].
  __device__ __forceinline__ void load_item(int p, const Elem<P>* __restrict__ x, const TileCoord& c, int chunk, int tid) {
    const int id0 = c.od * P::kSD - P::kPD, ih0 = c.oh * P::kSH - P::kPH, iw0 = c.ow * P::kSW - P::kPW;
    const int ci0 = chunk * P::kCI;
    const int e = tid + p * kLoaders;
    const int gw = e % kGroupsW, row = (e / kGroupsW) % kRows, quad = e / (kGroupsW * kRows);
    const int id = id0 + row / G::kBH, ih = ih0 + row % G::kBH, iw = iw0 + gw * 4;
    const bool row_ok = e < kItems && id >= 0 && id < P::kInD && ih >= 0 && ih < P::kInH;
#pragma unroll
    for (int ch = 0; ch < 4; ++ch) {
      const int ci = ci0 + quad * 4 + ch;
      const bool ok = row_ok && ci < P::kCin;
      if constexpr (G::kVecW) {  // 4 values: 16 bytes of float, 8 of a 16-bit type
        const long long off = input_offset<P>(c.n, ci, id, ih, iw);
        const float4 q = quad_values<Elem<P>>(load_quad(x + off, ok && iw >= 0 && iw < P::kInW));
        v[p][ch][0] = q.x, v[p][ch][1] = q.y, v[p][ch][2] = q.z, v[p][ch][3] = q.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int w = iw + j;
          v[p][ch][j] = ok && w >= 0 && w < P::kInW ? load_value(x + input_offset<P>(c.n, ci, id, ih, w)) : 0.f;
        }
      }
    }
  }

  // Item p of this thread, rounded (tf32x3: hi and lo), into the A buffer at `a`.
  __device__ __forceinline__ void store_item(int p, float* a, int tid) const {
    const int e = tid + p * kLoaders;
    if (e >= kItems) return;
    const int gw = e % kGroupsW, row = (e / kGroupsW) % kRows, quad = e / (kGroupsW * kRows);
    float* dst = a + quad * G::kQuadPlane + row * G::kRowFloats;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int w = gw * 4 + j;
      if (w >= G::kBW) break;
      const int col = (w % P::kSW) * G::kColsPerPhase + w / P::kSW;
      constexpr bool kEven = P::kTf32HalfEven;
      const float4 hi = make_float4(to_tf32_operand<kEven>(v[p][0][j]), to_tf32_operand<kEven>(v[p][1][j]), to_tf32_operand<kEven>(v[p][2][j]),
                                    to_tf32_operand<kEven>(v[p][3][j]));
      *reinterpret_cast<float4*>(dst + col * 4) = hi;
      if constexpr (G::kSplits == 2) {
        *reinterpret_cast<float4*>(dst + G::kABuf + col * 4) = make_float4(input_lo<P>(v[p][0][j], hi.x), input_lo<P>(v[p][1][j], hi.y),
                                                                           input_lo<P>(v[p][2][j], hi.z), input_lo<P>(v[p][3][j], hi.w));
      }
    }
  }
};

// ------------------------------------------------------------------ the kernel

// One k step: acc += A x B for the warp's kMT x kNT tiles, B from the packed
// fragments at `wf` (tf32x3: a_lo x b_hi + a x b_lo + a x b_hi). kPromoteSteps: the
// three products go to a fresh accumulator that is then added to acc with rounded
// fp32 adds, so that the tensor cores' truncation is relative to one step's sum,
// not to the running total's (whose error would grow with K).
template <class P>
__device__ __forceinline__ void mma_step(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4],
                                         const float (&a)[Geometry<P>::kMT][4],
                                         const float (&a_lo)[Geometry<P>::kSplits == 2 ? Geometry<P>::kMT : 1][4],
                                         const float* wf) {
  using G = Geometry<P>;
#pragma unroll
  for (int nt = 0; nt < G::kNT; ++nt) {
    if constexpr (G::kSplits == 2) {
      const float4 b = __ldg(reinterpret_cast<const float4*>(wf + nt * 32 * G::kFragFloats));  // hi0, hi1, lo0, lo1
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt) {
        float step[4] = {0.f, 0.f, 0.f, 0.f};
        float(&dst)[4] = G::kPromoteSteps ? step : acc[mt][nt];  // promoted: the step's products, added in fp32
        mma_tf32(dst, a_lo[mt], b.x, b.y);
        mma_tf32(dst, a[mt], b.z, b.w);
        mma_tf32(dst, a[mt], b.x, b.y);
        if constexpr (G::kPromoteSteps) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][nt][i] += step[i];
        }
      }
    } else {
      const float2 b = __ldg(reinterpret_cast<const float2*>(wf + nt * 32 * G::kFragFloats));
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt) mma_tf32(acc[mt][nt], a[mt], b.x, b.y);
    }
  }
}

// Generic main loop over one chunk: every k step reads its A fragments from shared memory.
template <class P>
__device__ __forceinline__ void chunk_generic(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4], const float* in,
                                              const float* lo, const int (&row_off)[Geometry<P>::kMT][2], const float* w) {
  using G = Geometry<P>;
#pragma unroll
  for (int ks = 0; ks < G::kKSteps; ++ks) {
    // k-lanes t and t + 4 of this step; a padded slot's values are zeros.
    const KIndex q0 = k_index<P>(ks * 8), q1 = k_index<P>(ks * 8 + 4);
    const int off0 = k_offset<P>(ks * 8), off1 = k_offset<P>(ks * 8 + 4);
    float a[G::kMT][4], a_lo[G::kSplits == 2 ? G::kMT : 1][4];
#pragma unroll
    for (int mt = 0; mt < G::kMT; ++mt) {
      a[mt][0] = q0.real ? in[row_off[mt][0] + off0] : 0.f;
      a[mt][1] = q0.real ? in[row_off[mt][1] + off0] : 0.f;
      a[mt][2] = q1.real ? in[row_off[mt][0] + off1] : 0.f;
      a[mt][3] = q1.real ? in[row_off[mt][1] + off1] : 0.f;
      if constexpr (G::kSplits == 2) {
        a_lo[mt][0] = q0.real ? lo[row_off[mt][0] + off0] : 0.f;
        a_lo[mt][1] = q0.real ? lo[row_off[mt][1] + off0] : 0.f;
        a_lo[mt][2] = q1.real ? lo[row_off[mt][0] + off1] : 0.f;
        a_lo[mt][3] = q1.real ? lo[row_off[mt][1] + off1] : 0.f;
      }
    }
    mma_step<P>(acc, a, a_lo, w + ks * G::kPackedStep);
  }
}

// Window main loop over one chunk: per kd, the thread's window of the box
// (channel lanes x kWinRows x kWinCols, from `base`) goes to registers, then
// every tap of that kd takes its fragments from there.
template <class P>
__device__ __forceinline__ void chunk_window(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4], const float* in,
                                             const float* lo, int base, const float* w) {
  using G = Geometry<P>;
  constexpr int kLo = G::kSplits == 2 ? 1 : 0;
#pragma unroll
  for (int kd = 0; kd < P::kKD; ++kd) {
    float win[1 + kLo][G::kLanesC][G::kWinRows][G::kWinCols];
#pragma unroll
    for (int part = 0; part <= kLo; ++part)
#pragma unroll
      for (int l = 0; l < G::kLanesC; ++l)
#pragma unroll
        for (int r = 0; r < G::kWinRows; ++r)
#pragma unroll
          for (int j = 0; j < G::kWinCols; j += 2) {
            const float* src = (part ? lo : in) + base + l * 4 * G::kPlane + (kd * P::kDD * G::kBH + r) * G::kBWPad + j;
            const float2 v = *reinterpret_cast<const float2*>(src);
            win[part][l][r][j] = v.x;
            win[part][l][r][j + 1] = v.y;
          }
#pragma unroll
    for (int step = 0; step < G::kStepsPerKd; ++step) {
      const int ks = kd * G::kStepsPerKd + step;
      const KIndex q0 = k_index<P>(ks * 8), q1 = k_index<P>(ks * 8 + 4);
      float a[G::kMT][4], a_lo[G::kSplits == 2 ? G::kMT : 1][4];
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt) {
#pragma unroll
        for (int part = 0; part <= kLo; ++part) {
          float* dst = part ? a_lo[mt] : a[mt];
          const int r0 = mt + q0.kh * P::kDH, c0 = q0.kw * P::kDW, r1 = mt + q1.kh * P::kDH, c1 = q1.kw * P::kDW;
          dst[0] = q0.real ? win[part][q0.c / 4][r0][c0] : 0.f;
          dst[1] = q0.real ? win[part][q0.c / 4][r0][c0 + 1] : 0.f;
          dst[2] = q1.real ? win[part][q1.c / 4][r1][c1] : 0.f;
          dst[3] = q1.real ? win[part][q1.c / 4][r1][c1 + 1] : 0.f;
        }
      }
      mma_step<P>(acc, a, a_lo, w + ks * G::kPackedStep);
    }
  }
}

// Direct main loop over one chunk: for each channel and tap, the thread's kPPT
// inputs (box offsets `pos`) times the tap's kWarpN weights (`w`: this chunk's,
// from the warp's first channel), accumulated in fp32 in that order.
template <class P>
__device__ __forceinline__ void chunk_direct(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4], const float* in,
                                             const int (&pos)[Geometry<P>::kPPT], const float* w) {
  using G = Geometry<P>;
  // channels and kd stay loops (the unrolled body is one kd's KH x KW taps: a small instruction footprint)
#pragma unroll 1
  for (int ci = 0; ci < P::kCI; ++ci) {
#pragma unroll 1
    for (int kd = 0; kd < P::kKD; ++kd) {
      const float* in_k = in + ci * G::kPlane + kd * P::kDD * G::kBH * G::kBWPad;
      const float* w_k = w + (ci * G::kTaps + kd * G::kTapsHW) * P::kBN;
#pragma unroll
      for (int kh = 0; kh < P::kKH; ++kh) {
#pragma unroll
        for (int kw = 0; kw < P::kKW; ++kw) {
          float wv[G::kWarpN];
#pragma unroll
          for (int q = 0; q < G::kWarpN / 4; ++q) {
            const float4 v = *reinterpret_cast<const float4*>(w_k + (kh * P::kKW + kw) * P::kBN + 4 * q);
            wv[4 * q] = v.x, wv[4 * q + 1] = v.y, wv[4 * q + 2] = v.z, wv[4 * q + 3] = v.w;
          }
          const int off = kh * P::kDH * G::kBWPad + kw * P::kDW;
#pragma unroll
          for (int j = 0; j < G::kPPT; ++j) {
            const float xv = in_k[pos[j] + off];
#pragma unroll
            for (int n = 0; n < G::kWarpN; ++n) {
              float& a = acc[j / 2][n / 2][2 * (j % 2) + n % 2];
              a = fmaf(xv, wv[n], a);
            }
          }
        }
      }
    }
  }
}

// pin() on every accumulator: the asynchronous MMAs read and write them.
template <class P>
__device__ __forceinline__ void pin_all(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4]) {
  using G = Geometry<P>;
#pragma unroll
  for (int mt = 0; mt < G::kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) pin(acc[mt][nt][i]);
}

// wgmma main loop over one chunk: per k step (one tap, 8 channels) and m-block,
// one warpgroup MMA with A at a compile-time offset from the m-block's base
// descriptor and B from the resident weights (tf32x3: a_lo x b_hi + a x b_lo +
// a x b_hi). Issues and commits the chunk's MMAs; chunk_wgmma_wait waits for them.
template <class P>
__device__ __forceinline__ void chunk_wgmma(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4],
                                            const uint64_t (&a_desc)[Geometry<P>::kMT], uint64_t lo_shift,
                                            uint64_t b_desc) {
  using G = Geometry<P>;
  pin_all<P>(acc);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < G::kKSteps; ++ks) {
    const KIndex q = k_index<P>(ks * 8);
    const int dw = q.kw * P::kDW;
    // floats from the m-block's base to this tap's first channel quad
    const int a_off = (q.c / 4) * G::kQuadPlane + (q.kd * P::kDD * G::kBH + q.kh * P::kDH) * G::kRowFloats +
                      ((dw % P::kSW) * G::kColsPerPhase + dw / P::kSW) * 4;
    const uint64_t a_step = static_cast<uint64_t>(a_off / 4);  // descriptor address unit: 16 bytes
    const uint64_t b = b_desc + static_cast<uint64_t>(ks * G::kWgStepFloats / 4);
#pragma unroll
    for (int mt = 0; mt < G::kMT; ++mt) {
      const uint64_t a = a_desc[mt] + a_step;
      if constexpr (G::kSplits == 2) {
        Wgmma<G::kWarpN>::mma(acc[mt], a + lo_shift, b);                                  // a_lo x b_hi
        Wgmma<G::kWarpN>::mma(acc[mt], a, b + static_cast<uint64_t>(G::kWgSplitFloats / 4));  // a x b_lo
      }
      Wgmma<G::kWarpN>::mma(acc[mt], a, b);
    }
  }
  wgmma_commit();
}

// Waits for the MMAs chunk_wgmma issued.
template <class P>
__device__ __forceinline__ void chunk_wgmma_wait(float (&acc)[Geometry<P>::kMT][Geometry<P>::kNT][4]) {
  wgmma_wait<0>();
  pin_all<P>(acc);
}

// The whole convolution for CTA `cta` of `ctas` (persistent: it takes tiles cta, cta + ctas, ...);
// kRound: one round of it, the tiles [round_lo, round_lo + workers) (phase_dispatch).
// staggered_kernel: this CTA's "first main loop done" flag, which conv_ctas<..., true> sets, and
// its worker numbers, in shared memory rather than arguments: kept in registers across the main
// loop, they made a group norm's one-pass kernel spill.
__shared__ int* s_first_loop_flag;
__shared__ int s_worker[2];  // staggered_kernel: this CTA's worker number and the workers (conv_ctas' cta, ctas)

template <class P, class E, bool kSignal = false, bool kRound = false>
__device__ __forceinline__ void conv_ctas(const Elem<P>* __restrict__ x, const float* __restrict__ packed,
                                          const typename E::Params& ep, int batch, int cta, int ctas,
                                          long long round_lo = 0) {
  using G = Geometry<P>;
  extern __shared__ __align__(16) float smem[];
  float* s_stages = smem + G::kStageOffset;
  float* s_lo = smem + G::kLoOffset;  // (wgmma loop: the team's A buffer, below)
  // Teams (wgmma loop): team `team` is worker team * ctas + cta of ctas * kTeams (a grid smaller
  // than the SMs' room spreads its tiles over CTAs first); each has its own A buffer, staged
  // tile and scratch.
  const int team = G::kTeams == 1 ? 0 : static_cast<int>(threadIdx.x) / G::kTeamThreads;
  const int worker = team * ctas + cta, workers = ctas * G::kTeams;
  s_lo += team * G::kABufFloats;
  float* s_tile = smem + G::kTileOffset + team * team_floats<P, E>();
  float* s_scratch = s_tile + (E::kStaged ? P::kBN * G::kMPad : 0);

  // unsigned: warp and lane as shifts (signed divisions cost ptxas registers, and spills)
  const unsigned team_tid = G::kTeams == 1 ? threadIdx.x : threadIdx.x % G::kTeamThreads;
  const int tid = static_cast<int>(team_tid);
  const int warp = static_cast<int>(team_tid / 32), lane = static_cast<int>(team_tid % 32);
  const int g = lane / 4, t = lane % 4;  // MMA fragment coordinates
  const int warp_m = warp % P::kWarpsM, warp_n = warp / P::kWarpsM;
  FragMap<P> fm{warp_m * G::kWarpM, warp_n * G::kWarpN, g, t, 0, 0, 0};
  if constexpr (G::kWg) fm.m0 = 64 * (warp_m / 4) + 16 * (warp_m % 4);  // warpgroup's first m-block, warp's rows in it
  if constexpr (G::kDirect) fm.m0 = warp_m * G::kWarpM + lane;
  if constexpr (G::kWindow) {
    fm.d0 = warp_m / (G::kHBlocks * G::kWSegs);
    fm.h0 = (warp_m / G::kWSegs) % G::kHBlocks * G::kMT;
    fm.w0 = warp_m % G::kWSegs * 16;
  }
  // Generic loop: shared-memory offset of this thread's fragment rows (g and
  // g + 8 of each 16-row tile) plus its channel lane t; k adds a
  // compile-time offset. Window loop: the offset of its window.
  int row_off[G::kMT][2];
#pragma unroll
  for (int mt = 0; mt < G::kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = fm.m(mt, 2 * h);
      row_off[mt][h] = (row_d<P>(m) * P::kSD * G::kBH + row_h<P>(m) * P::kSH) * G::kBWPad + row_w<P>(m) * P::kSW + t * G::kPlane;
    }
  }
  const int window_base = t * G::kPlane + (fm.d0 * P::kSD * G::kBH + fm.h0) * G::kBWPad + fm.w0 + 2 * g;
  // Direct loop: the box offsets of this thread's positions.
  int pos[G::kDirect ? G::kPPT : 1];
  if constexpr (G::kDirect) {
#pragma unroll
    for (int j = 0; j < G::kPPT; ++j) {
      const int m = fm.m(j / 2, 2 * (j % 2));
      pos[j] = (row_d<P>(m) * P::kSD * G::kBH + row_h<P>(m) * P::kSH) * G::kBWPad + row_w<P>(m) * P::kSW;
    }
  }
  // This thread's B fragments: lane `lane` of n-tiles warp_n * kNT + nt.
  const float* w_lane = packed + (static_cast<long long>(warp_n) * G::kNT * 32 + lane) * G::kFragFloats;

  const long long total_tiles = batch_tiles<P>(batch);
  long long my_tiles;
  if constexpr (kRound) {  // the tiles of [round_lo, round_lo + workers): one at most
    const long long first = round_lo + worker;
    const long long end = round_lo + workers < total_tiles ? round_lo + workers : total_tiles;
    my_tiles = first < end ? (end - 1 - first) / workers + 1 : 0;
  } else {
    my_tiles = worker < total_tiles ? (total_tiles - 1 - worker) / workers + 1 : 0;
  }
  const long long steps = my_tiles * G::kChunks;
  auto tile_of_step = [&](long long s) {
    if constexpr (kSignal) {  // staggered_kernel's worker numbers, read again (not held across the main loop)
      const volatile int* w = s_worker;
      return tile_coord<P>(w[0] + (s / G::kChunks) * w[1]);
    } else if constexpr (kRound) {
      return tile_coord<P>(round_lo + worker + (s / G::kChunks) * workers);
    } else {
      return tile_coord<P>(worker + (s / G::kChunks) * workers);
    }
  };

  float acc[G::kMT][G::kNT][4];
  auto zero_acc = [&] {
#pragma unroll
    for (int mt = 0; mt < G::kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
  };
  // After a tile's last chunk (its input stage `stage`): the epilogue, then fresh accumulators.
  auto finish_tile = [&](const TileCoord& c, float* stage) {
    if constexpr (kRoundsOutput<P> || kAddsConvBias<E>) {  // the convolution's output as eager's 16-bit tensor holds it
#pragma unroll
      for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float b = conv_bias_value<E>(ep, min(c.cblock * P::kBN + fm.n(nt, i), P::kCout - 1));
#pragma unroll
          for (int mt = 0; mt < G::kMT; ++mt) acc[mt][nt][i] = conv_output<P, E, P::kLoop == Loop::kWgmma>(acc[mt][nt][i], b);
        }
    }
    if constexpr (E::kStaged) {
      float* tile = s_tile;
      float* scratch = s_scratch;
      if constexpr (tile_in_stage<P, E>()) {
        team_sync<P>();  // every warp is done reading the stage
        tile = stage;
        scratch = stage + P::kBN * G::kMPad;
      }
      // Accumulators -> tile[n][m], then the epilogue on the whole tile.
#pragma unroll
      for (int mt = 0; mt < G::kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < G::kNT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) tile[fm.n(nt, i) * G::kMPad + fm.m(mt, i)] = acc[mt][nt][i];
      team_sync<P>();
      E::template apply<P>(ep, tile, scratch, c);
    } else {
      E::template apply_fragments<P>(ep, acc, fm, s_scratch, c);
    }
    team_sync<P>();  // the epilogue's shared memory is reused by the next tile
    zero_acc();
  };
  zero_acc();

  if constexpr (G::kWg || G::kDirect) {
    // The weights go to shared memory once (the main loop's first barrier publishes them).
    const float4* src = reinterpret_cast<const float4*>(packed);
    float4* dst = reinterpret_cast<float4*>(smem);
    for (int e = threadIdx.x; e < G::kWeightFloats / 4; e += G::kThreads) dst[e] = __ldg(src + e);
  }
  if constexpr (G::kWg) {
    fence_async_shared();  // wgmma reads them through the async proxy
    if constexpr (G::kTeams > 1) __syncthreads();  // every team's first barrier is its own
    // The warpgroup, from lane 0: the compiler then knows it is warp-uniform (descriptors in uniform registers).
    const int wg = __shfl_sync(0xffffffffu, warp_m / 4, 0);
    const int wg_n = __shfl_sync(0xffffffffu, warp_n, 0);
    // A: rows 16 bytes apart, 8-row groups SH box rows apart, the k step's two quads a quad plane apart.
    constexpr uint32_t kALbo = G::kQuadPlane * 4, kASbo = P::kSH * G::kRowFloats * 4;
    // B: [n-tile][k quad][8 columns][4 k]: quads 128 bytes apart, n-tiles 256.
    constexpr uint32_t kBLbo = 128, kBSbo = 256;
    constexpr uint64_t kLoShift = G::kABuf / 4;  // tf32x3: the lo buffer, in 16-byte units
    // Per m-block of the warpgroup (d, 8 rows in H of the tile): its rows inside the A buffer.
    uint64_t a_desc[G::kMT];
#pragma unroll
    for (int mt = 0; mt < G::kMT; ++mt) {
      const int b = wg + mt * G::kGroups;
      const int d = b / (P::kTH / 8), h = 8 * (b % (P::kTH / 8));
      a_desc[mt] = smem_desc(smem_addr(s_lo + (d * P::kSD * G::kBH + h * P::kSH) * G::kRowFloats), kALbo, kASbo);
    }
    BoxRegs<P, G::kTeamThreads> box;
    if (steps > 0) box.load(x, tile_of_step(0), 0, tid);
#pragma unroll 1
    for (long long s = 0; s < steps; ++s) {
      team_sync<P>();  // every warpgroup's MMAs of step s - 1 are done with the A buffer
      box.store(s_lo, tid);
      fence_async_shared();  // the MMAs read the A buffer through the async proxy
      team_sync<P>();
      const TileCoord c = tile_of_step(s);
      const int chunk = static_cast<int>(s % G::kChunks);
      // this warpgroup's columns: n-tiles wg_n * kNT ... (256 bytes each)
      const float* b_base = smem + chunk * G::kKSteps * G::kWgStepFloats + wg_n * G::kNT * 64;
      chunk_wgmma<P>(acc, a_desc, kLoShift, smem_desc(smem_addr(b_base), kBLbo, kBSbo));
      // The next box loads under the MMAs (and a register epilogue); a staged epilogue
      // runs first (its registers and the box's together would spill).
      auto load_next = [&] {
        if (s + 1 < steps) box.load(x, tile_of_step(s + 1), static_cast<int>((s + 1) % G::kChunks), tid);
      };
      if (!E::kStaged || chunk != G::kChunks - 1) load_next();
      chunk_wgmma_wait<P>(acc);
      if (chunk == G::kChunks - 1) {
        finish_tile(c, nullptr);
        if (E::kStaged) load_next();
      }
    }
  } else {
    auto issue = [&](long long s) {
      if (s < steps) {
        load_input<P>(reinterpret_cast<Elem<P>*>(s_stages + (s % P::kStages) * G::kRawStage), x, tile_of_step(s),
                      static_cast<int>(s % G::kChunks));
      }
      cp_async_commit();  // an empty group keeps the count uniform
    };
#pragma unroll 1
    for (int s = 0; s < P::kStages - 1; ++s) issue(s);
#pragma unroll 1
    for (long long s = 0; s < steps; ++s) {
      cp_async_wait<P::kStages - 2>();
      __syncthreads();  // stage s landed; everyone is done with stage s - 1 and s_lo
      issue(s + P::kStages - 1);
      float* in = s_stages + (s % P::kStages) * G::kRawStage;
      if constexpr (!G::kDirect) {
        round_stage<P>(in, s_lo);
        __syncthreads();
        if constexpr (kHalfInput<P>) in = s_lo;  // the stage converted to fp32
      }
      const TileCoord c = tile_of_step(s);
      const int chunk = static_cast<int>(s % G::kChunks);
      const float* w = w_lane + (static_cast<long long>(c.cblock) * G::kChunks + chunk) * G::kKSteps * G::kPackedStep;
      if constexpr (G::kDirect) {
        chunk_direct<P>(acc, in, pos, smem + chunk * P::kCI * G::kTaps * P::kBN + fm.n0);
      } else if constexpr (G::kWindow) {
        chunk_window<P>(acc, in, s_lo, window_base, w);
      } else {
        chunk_generic<P>(acc, in, s_lo, row_off, w);
      }
      if (chunk == G::kChunks - 1) {
        if constexpr (kSignal) {
          if (s == G::kChunks - 1 && threadIdx.x == 0) signal_flag(s_first_loop_flag);
        }
        finish_tile(c, in);
      }
    }
    cp_async_wait<0>();
  }
}

template <class P, class E>
__global__ void __launch_bounds__(Geometry<P>::kThreads) conv_kernel(const Elem<P>* __restrict__ x,
                                                                   const float* __restrict__ packed,
                                                                   const typename E::Params ep, int batch) {
  conv_ctas<P, E>(x, packed, ep, batch, blockIdx.x, gridDim.x);
}

// The sub-pixel phases of a transposed convolution in one launch, each with its
// own problem struct and packed weights. A phase alone writes every stride-th
// value of a row (half of each 32-byte sector for stride 2); with the phases far
// apart in time (blockIdx.y per phase: phases with fewer taps ran ahead) L2
// evicted half-written sectors, which HBM fills before writing (17b610c, ncu of
// KernelBench #58: 1.8 GB read and 2.1 GB written for a 1.0 GB output). So where
// the loop reads its weights from global memory (generic and window loops),
// every CTA takes every phase, in rounds: round r is tiles [r W, (r + 1) W) of
// each phase in turn (W: the phase's workers), and one CTA writes all phases of
// an output region within a few microseconds (#58: DRAM reads 1.76 -> 0.99 GB,
// writes 2.10 -> 1.99 GB, kernel 2.36 -> 2.06 ms, H100, 2026-11-27). The wgmma and direct loops keep
// their weights in shared memory, loaded once per conv_ctas: rounds would load
// them again for every tile (and eight inlined wgmma loops spill), so there
// blockIdx.y is the phase and the phases share the resident CTAs.
template <int N>
struct PackedPhases {
  const float* w[N];
};

template <class P>
inline constexpr bool kPhasesInRounds = !Geometry<P>::kWg && !Geometry<P>::kDirect;

template <class P>
__device__ __forceinline__ long long phase_rounds(int batch, int ctas) {
  const long long tiles = batch_tiles<P>(batch);
  const long long workers = static_cast<long long>(ctas) * Geometry<P>::kTeams;
  return (tiles + workers - 1) / workers;
}

template <class E, class... Ps, int... I>
__device__ __forceinline__ void phase_dispatch(const Elem<std::tuple_element_t<0, std::tuple<Ps...>>>* x,
                                               const PackedPhases<sizeof...(Ps)>& packed,
                                               const typename E::Params& ep, int batch,
                                               std::integer_sequence<int, I...>) {
  using P0 = std::tuple_element_t<0, std::tuple<Ps...>>;
  if constexpr (kPhasesInRounds<P0>) {
    const int ctas = static_cast<int>(gridDim.x);
    long long rounds = 0;
    ((rounds = phase_rounds<Ps>(batch, ctas) > rounds ? phase_rounds<Ps>(batch, ctas) : rounds), ...);
#pragma unroll 1
    for (long long r = 0; r < rounds; ++r) {
      // __syncthreads between phases: the next phase's stages reuse shared memory
      ((conv_ctas<Ps, E, false, true>(x, packed.w[I], ep, batch, blockIdx.x, ctas, r * ctas * Geometry<Ps>::kTeams),
        __syncthreads()), ...);
    }
  } else {
    ((blockIdx.y == I ? conv_ctas<Ps, E>(x, packed.w[I], ep, batch, blockIdx.x, gridDim.x) : void()), ...);
  }
}

template <class E, class P0, class... Ps>
__global__ void __launch_bounds__(Geometry<P0>::kThreads) phases_kernel(const Elem<P0>* __restrict__ x,
                                                                      const PackedPhases<1 + sizeof...(Ps)> packed,
                                                                      const typename E::Params ep, int batch) {
  static_assert(((Geometry<Ps>::kThreads == Geometry<P0>::kThreads) && ...), "phases share the block size");
  static_assert(((kPhasesInRounds<Ps> == kPhasesInRounds<P0>) && ...), "phases share the main loop");
  phase_dispatch<E, P0, Ps...>(x, packed, ep, batch, std::make_integer_sequence<int, 1 + sizeof...(Ps)>{});
}

// ------------------------------------------------------------------ weights

// Packs the weight. mma.sync loops: MMA-fragment order, for each (cblock, chunk,
// k step, n-tile, lane) the lane's b0 = W[k0 + t][n], b1 = W[k0 + t + 4][n]
// (n = 8 nt + g), TF32-rounded; tf32x3 appends the lo parts. wgmma loop: the
// B operand's core matrices as the kernel keeps them in shared memory (the lo
// parts a second copy after the hi parts). Padding (k, channels) is zero.
// The weight's layout and which of its taps this convolution uses (a flipped
// kernel, a sub-pixel phase's every stride-th tap) come from P. A real lo
// part that is exactly zero becomes the smallest normal number with the
// weight's sign, so that inf * w gives inf, not inf * 0 = NaN, in the hi x lo
// product.
template <class P>
__device__ __forceinline__ int weight_tap(int j, int taps, int start, int step) {
  return start + step * (P::kWFlip ? taps - 1 - j : j);
}

// The weight of input channel ci, output channel co at tap (jd, jh, jw) of this convolution; 0 outside.
template <class P>
__device__ __forceinline__ float weight_value(const float* __restrict__ w, int ci, int co, int jd, int jh, int jw) {
  if (co >= P::kCout || ci >= P::kCin) return 0.f;
  const int kd = weight_tap<P>(jd, P::kKD, P::kWStartD, P::kWStepD);
  const int kh = weight_tap<P>(jh, P::kKH, P::kWStartH, P::kWStepH);
  const int kw = weight_tap<P>(jw, P::kKW, P::kWStartW, P::kWStepW);
  const long long outer = P::kWeightTransposed ? static_cast<long long>(ci) * P::kCout + co
                                               : static_cast<long long>(co) * P::kCin + ci;
  return w[((outer * P::kWKD + kd) * P::kWKH + kh) * P::kWKW + kw];
}

// The weight at (k of chunk `chunk`, output channel co); `real` false for padding (then 0).
template <class P>
__device__ __forceinline__ float weight_at(const float* __restrict__ w, int chunk, int k, int co, bool& real) {
  const KIndex q = k_index<P>(k);
  const int ci = chunk * P::kCI + q.c;
  real = q.real && co < P::kCout && ci < P::kCin;
  return real ? weight_value<P>(w, ci, co, q.kd, q.kh, q.kw) : 0.f;
}

// TF32 hi and lo parts of a weight (tf32x3). hi is v truncated to TF32, so
// lo = v - hi has v's sign: an inf input meets hi and lo of one sign (inf * w),
// never inf - inf.
__device__ __forceinline__ void split_weight(float v, bool real, float& hi, float& lo) {
  hi = isfinite(v) ? __uint_as_float(__float_as_uint(v) & 0xffffe000u) : v;
  lo = isfinite(v) ? to_tf32(v - hi) : 0.f;
  if (real && lo == 0.f) lo = copysignf(1.17549435e-38f, v);
}

template <class P>
__global__ void pack_weights_kernel(const float* __restrict__ w, float* __restrict__ packed) {
  using G = Geometry<P>;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  if constexpr (G::kDirect) {
    // [chunk][channel of the chunk][tap][kBN], fp32 as given
    for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < G::kPackedFloats; e += stride) {
      const int co = static_cast<int>(e % P::kBN), tap = static_cast<int>((e / P::kBN) % G::kTaps);
      const int ci = static_cast<int>(e / (static_cast<long long>(P::kBN) * G::kTaps));  // chunk * kCI + channel
      packed[e] = weight_value<P>(w, ci, co, tap / G::kTapsHW, (tap / P::kKW) % P::kKH, tap % P::kKW);
    }
    return;
  }
  if constexpr (G::kWg) {
    // [split][chunk][k step][n-tile][k quad][8 columns][4 k]
    for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < G::kWgSplitFloats; e += stride) {
      const int kk = static_cast<int>(e % 4), col = static_cast<int>((e / 4) % 8), kq = static_cast<int>((e / 32) % 2);
      const int nt = static_cast<int>((e / 64) % G::kNTiles);
      const int ks = static_cast<int>((e / (64 * G::kNTiles)) % G::kKSteps);
      const int chunk = static_cast<int>(e / (64LL * G::kNTiles * G::kKSteps));
      bool real;
      const float v = weight_at<P>(w, chunk, ks * 8 + kq * 4 + kk, nt * 8 + col, real);
      if constexpr (G::kSplits == 2) {
        float hi, lo;
        split_weight(v, real, hi, lo);
        packed[e] = hi;
        packed[G::kWgSplitFloats + e] = lo;
      } else {
        packed[e] = to_tf32_operand<P::kTf32HalfEven>(v);
      }
    }
    return;
  }
  const long long total = G::kPackedFloats / G::kSplits;  // (b0, b1) pairs x 2
  for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e < total; e += stride) {
    const int j = static_cast<int>(e % 2);  // b0 or b1
    const int lane = static_cast<int>((e / 2) % 32);
    const int nt = static_cast<int>((e / 64) % G::kNTiles);
    const long long rest = e / (64LL * G::kNTiles);
    const int ks = static_cast<int>(rest % G::kKSteps);
    const int chunk = static_cast<int>((rest / G::kKSteps) % G::kChunks);
    const int cblock = static_cast<int>(rest / (static_cast<long long>(G::kKSteps) * G::kChunks));
    bool real;
    const float v = weight_at<P>(w, chunk, ks * 8 + lane % 4 + 4 * j, cblock * P::kBN + nt * 8 + lane / 4, real);
    float* dst = packed + (e / 2) * G::kFragFloats + j;
    if constexpr (G::kSplits == 2) {
      split_weight(v, real, dst[0], dst[2]);
    } else {
      dst[0] = to_tf32_operand<P::kTf32HalfEven>(v);
    }
  }
}

// ------------------------------------------------------------------ launch

template <class P, class E>
constexpr int smem_bytes() {
  return (Geometry<P>::kTileOffset + Geometry<P>::kTeams * team_floats<P, E>()) * static_cast<int>(sizeof(float));
}

// Launch setup (kernel_setup, per device): kgen_launch.cuh.


// Co-resident launches in staggered groups (run_coresident). A one-pass norm's CTAs run in
// rounds: every tile's main loop (FP32 FMAs, issue-bound), then its epilogue (the moments, the
// wait for the sample's other tiles, the merge: more latency than issue). Launched together, the
// CTAs sharing an SM ran both phases in lockstep (instnorm_clamp_max: 13.4 us of loop, then 8.5 us
// of epilogue, on both CTAs at once). Here the k-th CTA to start on an SM joins group k, and a
// group's CTAs begin once the previous group's CTA on the same SM has finished its first main
// loop, so that one's loop runs beside the other's epilogue. Every sample's tiles lie in one group:
// its CTAs wait only for each other. Measured (docs/performance.md, 5bd1e91): a loop alone 8.4 us, an
// epilogue beside a loop 12.7, and the groups drift back into step within a few rounds; the
// kernel 178 -> 171 us.
constexpr int kMaxSmIds = 256, kMaxGroups = 8;  // bounds on %smid and on CTAs per SM
// Ints of the zeroed sync area: per SM its CTAs so far, per group its CTAs so far, per (SM, group)
// "the first main loop is done".
constexpr int kStaggerInts = kMaxSmIds + kMaxGroups + kMaxSmIds * kMaxGroups;

// `groups` CTAs per SM (the grid fills every SM), `per_group` of each group's CTAs work (whole
// samples' tiles); worker g * per_group + u of groups * per_group takes the tiles conv_ctas gives it.
template <class P, class E>
__global__ void __launch_bounds__(Geometry<P>::kThreads) staggered_kernel(const Elem<P>* __restrict__ x,
                                                                        const float* __restrict__ packed,
                                                                        const typename E::Params ep, int batch,
                                                                        int* sync, int groups, int per_group) {
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (sm >= kMaxSmIds) __trap();
    const int g = atomicAdd(sync + sm, 1);
    const int u = atomicAdd(sync + kMaxSmIds + g, 1);
    int* flags = sync + kMaxSmIds + kMaxGroups + sm * kMaxGroups;
    s_first_loop_flag = flags + g;
    if (u >= per_group) signal_flag(flags + g);  // no tiles: the next group's CTA need not wait
    if (g > 0) wait_flag(flags + g - 1);
    s_worker[0] = u < per_group ? g * per_group + u : -1;
    s_worker[1] = groups * per_group;
  }
  __syncthreads();
  const int worker = s_worker[0];
  if (worker < 0) return;
  conv_ctas<P, E, true>(x, packed, ep, batch, worker, s_worker[1]);
  if (threadIdx.x == 0) signal_flag(s_first_loop_flag);  // also when the CTA had no tile
}

// Packs the weights into `packed` (Geometry<P>::kPackedFloats floats).
template <class P>
void pack_weights(const float* w, float* packed, cudaStream_t stream) {
  using G = Geometry<P>;
  const long long blocks = (G::kPackedFloats / G::kSplits + 255) / 256;
  pack_weights_kernel<P><<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(w, packed);
}

// Runs the convolution with epilogue E over `batch` samples on `stream`, with
// weights packed by pack_weights<P>.
template <class P, class E>
cudaError_t run(const Elem<P>* x, const float* packed, const typename E::Params& ep, int batch, cudaStream_t stream) {
  using G = Geometry<P>;
  KernelSetup setup;
  const cudaError_t err = kernel_setup<conv_kernel<P, E>>(G::kThreads, smem_bytes<P, E>(), &setup);
  if (err != cudaSuccess) return err;
  const long long tiles = batch_tiles<P>(batch);
  const long long grid = tiles < setup.resident() ? tiles : setup.resident();  // teams beyond the tiles have none
  if (grid > 0) conv_kernel<P, E><<<static_cast<unsigned>(grid), G::kThreads, smem_bytes<P, E>(), stream>>>(x, packed, ep, batch);
  return cudaGetLastError();
}

// Runs the convolution with epilogue E on co-resident CTAs (a cooperative launch), all of a
// sample's tiles at once: the workers are a whole number of samples' tiles, so worker w's k-th
// tile, w + k * workers, belongs to one of the samples in round k, and every CTA of round k is
// running. E may then wait for the other tiles of its sample (e.g. for statistics over the whole
// sample). Where several CTAs fit on an SM and an SM count of them holds a sample, they run in
// staggered groups (staggered_kernel); `sync`: kStaggerInts zeroed ints.
template <class P, class E>
cudaError_t run_coresident(const Elem<P>* x, const float* packed, const typename E::Params& ep, int batch, int* sync,
                           cudaStream_t stream) {
  using G = Geometry<P>;
  constexpr int kSampleTiles = G::kCBlocks * G::kTilesPerSample;
  // each kernel's own occupancy (their registers differ): staggered_kernel's CTAs per SM, conv_kernel's in all
  KernelSetup staggered, plain;
  cudaError_t err = kernel_setup<staggered_kernel<P, E>>(G::kThreads, smem_bytes<P, E>(), &staggered);
  if (err == cudaSuccess) err = kernel_setup<conv_kernel<P, E>>(G::kThreads, smem_bytes<P, E>(), &plain);
  if (err != cudaSuccess) return err;
  const int per_sm = staggered.per_sm, sms = staggered.sms, resident = plain.resident();
  if (resident < kSampleTiles) return cudaErrorCooperativeLaunchTooLarge;  // one sample's tiles do not fit at once
  const long long tiles = static_cast<long long>(batch) * kSampleTiles;
  if (tiles == 0) return cudaSuccess;
  cudaLaunchAttribute cooperative;
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(G::kThreads);
  config.dynamicSmemBytes = smem_bytes<P, E>();
  config.stream = stream;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  const int per_group = sms / kSampleTiles * kSampleTiles;
  if (per_sm > 1 && per_sm <= kMaxGroups && per_group > 0 && tiles > per_group) {
    config.gridDim = dim3(static_cast<unsigned>(per_sm * sms));  // every SM holds one CTA of each group
    return cudaLaunchKernelEx(&config, staggered_kernel<P, E>, x, packed, ep, batch, sync, per_sm, per_group);
  }
  const long long workers = static_cast<long long>(resident / kSampleTiles) * kSampleTiles;
  config.gridDim = dim3(static_cast<unsigned>(tiles < workers ? tiles : workers));
  return cudaLaunchKernelEx(&config, conv_kernel<P, E>, x, packed, ep, batch);
}

// Runs every phase of a transposed convolution in one launch (weights packed per phase).
template <class E, class... Ps>
cudaError_t run_phases(const Elem<std::tuple_element_t<0, std::tuple<Ps...>>>* x, const PackedPhases<sizeof...(Ps)>& packed, const typename E::Params& ep, int batch,
                       cudaStream_t stream) {
  constexpr int kSmem = [] {
    int m = 0;
    ((m = smem_bytes<Ps, E>() > m ? smem_bytes<Ps, E>() : m), ...);
    return m;
  }();
  constexpr int kThreads = Geometry<std::tuple_element_t<0, std::tuple<Ps...>>>::kThreads;
  KernelSetup setup;
  const cudaError_t err = kernel_setup<phases_kernel<E, Ps...>>(kThreads, kSmem, &setup);
  if (err != cudaSuccess) return err;
  using P0 = std::tuple_element_t<0, std::tuple<Ps...>>;
  constexpr int kPhases = static_cast<int>(sizeof...(Ps));
  // in rounds, every resident CTA takes every phase; else the phases share the resident CTAs (phase_dispatch)
  const dim3 grid = kPhasesInRounds<P0> ? dim3(setup.resident()) : dim3((setup.resident() + kPhases - 1) / kPhases, kPhases);
  if (batch > 0) {
    phases_kernel<E, Ps...><<<grid, kThreads, kSmem, stream>>>(x, packed, ep, batch);
  }
  return cudaGetLastError();
}

// pack_weights + run, for a single convolution.
template <class P, class E>
cudaError_t launch(const Elem<P>* x, const float* w, float* packed, const typename E::Params& ep, int batch,
                   cudaStream_t stream) {
  pack_weights<P>(w, packed, stream);
  return run<P, E>(x, packed, ep, batch, stream);
}

}  // namespace conv_gemm
}  // namespace kgen
