// gemm3xtf32.cuh: C[M, N] = A[M, K] @ B[N, K]^T (+ bias) on Hopper's warpgroup MMAs, one kernel for every
// operand type T (a compile-time parameter, `Operand<T>`): float (fp32 in and out, split TF32 below) or
// kgen::bfloat16 / kgen::float16 (16-bit operands as stored, fp32 accumulation, gemm16 at the end).
//
// float: TF32 MMAs with fp32-level accuracy ("split TF32"): a = a_hi + a_lo, a_hi = tf32(a) rounded to nearest,
// a_lo = tf32(a - a_hi), and a * b ~ a_lo * b_hi + a_hi * b_lo + a_hi * b_hi (the a_lo * b_lo term is
// ~2^-22 of the product). The linear_gemm family's kernel (kgen/families/linear_gemm.py); measured in
// lab gemm_lab (docs/performance.md: 1.8-2.5x cuBLAS's fp32 SGEMM on the H100 at 0.16-0.25x its error).
//
// - split_kernel: a row-major [rows, K] matrix into hi and lo planes [rows, Kp] (Kp: K rounded up to 4,
//   zero-padded). Once per weight version for B (the binding's WeightCache), once per call for A.
// - gemm_kernel: one CTA per 128 x 128 output tile (grouped along M for L2 reuse of B's tiles). A producer
//   warp's thread issues TMA loads (cp.async.bulk.tensor, 128-byte swizzle) of A_hi, A_lo, B_hi, B_lo
//   k-blocks of 32 into a 3-stage ring (mbarriers full / empty); two consumer warpgroups each run
//   wgmma m64n128k8 with both operands in shared memory.
// - Accumulation: Hopper's tensor cores do not round their fp32 accumulation to nearest (with one
//   accumulator over all of K the error grew linearly with K, 15-43x cuBLAS's; run 1 of lab gemm_lab, docs/performance.md), so
//   each k-block's three products go into a fresh chunk accumulator (scale-d 0 on its first MMA) that is
//   then added to the fp32 total with ordinary adds on the CUDA cores.
// - Epilogue: + bias, then the caller's functor gets each output element (row, col, value) and stores it.
// - Rows of A holding a value TF32 cannot (+-inf, NaN, past its largest) are computed again in fp32 on the
//   CUDA cores (fixup_kernel), so that infinities and NaN propagate as in PyTorch's fp32 product.
//
// 16-bit (bfloat16, float16): the same gemm_kernel with one plane per operand, read by TMA straight from x and
// W as stored (rows 16-byte aligned: K % 8 == 0, which the plan requires), wgmma m64n128k16 (bf16 or f16
// operands, fp32 accumulators). A 128-byte swizzled row holds 64 16-bit values where it holds 32 fp32 ones, and
// one k16 MMA consumes 32 bytes of K as one k8 TF32 MMA does: the descriptors, the stage's 4 k-steps and their
// 32-byte advances are the same bytes; a k-block is 64 values of K instead of 32. The stage halves (A and B,
// 32 KiB), so the ring is 6 deep in the same 192 KiB. The per-k-block promotion into an fp32 total is kept (a
// few fp32 adds per 4 MMAs). No split and no fixup: the operands are the stored values, which the MMA
// multiplies as IEEE products (inf * 0 = NaN, inf propagates) on the same tensor cores as eager's cuBLAS call.
#pragma once

#include <cuda.h>  // CUtensorMap (the encode function is the driver's, found at run time: no link to libcuda)
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../kgen_launch.cuh"
#include "../kgen_math.h"  // kgen::bfloat16, kgen::float16

// wgmma and TMA exist on sm_90a only; other architectures of a multi-architecture build compile a trap
// (the plan picks linear_gemm for Hopper targets only: Target.wgmma).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KGEN_LINEAR_GEMM_WGMMA 1
#else
#define KGEN_LINEAR_GEMM_WGMMA 0
#endif

namespace kgen {
namespace linear_gemm {

constexpr int kBM = 128;  // output rows per CTA (two consumer warpgroups of 64)
constexpr int kBN = 128;  // output columns per CTA (one m64n128 accumulator per warpgroup)
constexpr int kRowBytes = 128;  // K per stage in bytes: one 128-byte row, the 128-byte swizzle's width
constexpr int kGroupM = 8;  // tile raster: groups of 8 M-tiles sweep N (B's tiles stay in L2)
constexpr int kThreads = 288;  // two consumer warpgroups + one producer warp
constexpr int kTileBytes = kBM * kRowBytes;  // one plane's k-block (A and B alike: kBM == kBN)
static_assert(kBM == kBN, "one tile size for both operands' TMA boxes");

// What the kernel reads of an operand of type T: float as TF32 hi and lo planes (split TF32, three products per
// k-step), a 16-bit type as stored (one product per k-step). The stage holds A's planes, then B's.
template <class T>
struct Operand {
  static_assert(sizeof(T) == 2, "a 16-bit operand type (kgen::bfloat16, kgen::float16) or float");
  static constexpr int kPlanes = 1;
  static constexpr int kStages = 6;  // a stage is 32 KiB: 6 fill the same 192 KiB as the float ring (227 KiB at most)
  static constexpr CUtensorMapDataType kMapType =
      std::is_same<T, bfloat16>::value ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
};
template <>
struct Operand<float> {
  static constexpr int kPlanes = 2;  // hi, lo
  static constexpr int kStages = 3;  // a stage is 64 KiB
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
};
template <class T>
constexpr int kBK = kRowBytes / static_cast<int>(sizeof(T));  // K per stage in values: 32 fp32, 64 16-bit
template <class T>
constexpr int kStageBytes = 2 * Operand<T>::kPlanes * kTileBytes;  // float: A_hi, A_lo, B_hi, B_lo; 16-bit: A, B
template <class T>
constexpr int kSmemBytes = Operand<T>::kStages * kStageBytes<T> + 1024 + 2 * Operand<T>::kStages * 8;  // + alignment slack, barriers
static_assert(kSmemBytes<float> == 3 * 65536 + 1024 + 48 && kSmemBytes<bfloat16> == 6 * 32768 + 1024 + 96, "the ring's bytes");
static_assert(kSmemBytes<bfloat16> <= 227 * 1024, "Hopper's shared memory per block");

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ float tf32_rna(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// ---- mbarriers and TMA

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int k, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}

// ---- warpgroup MMA

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {  // keeps the compiler from moving accumulator reads across waits
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle: 8-row atoms of 128-byte rows
// stacked 1024 bytes apart (the stride byte offset); the leading byte offset is unused for this layout.
__device__ __forceinline__ uint64_t smem_desc(uint32_t saddr) {
  constexpr uint64_t kSwizzle128 = 1, kAtomStride = 1024;
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | ((kAtomStride >> 4) << 32) | (kSwizzle128 << 62);
}

// The 64 fp32 accumulators of an m64n128 MMA as inline-asm operands %0..%63 (a, b, scale_d follow as %64..%66).
#define KGEN_WGMMA_D "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KGEN_WGMMA_D_OUT(d) "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63])

// D[64 x 128] (+)= A[64 x 8] * B[8 x 128]; scale_d 0 starts D from zero. Accumulator layout (warp w of the
// warpgroup, lane 4 g + t): d[4 j + 2 h + i] is row 16 w + g + 8 h, column 8 j + 2 t + i.
__device__ __forceinline__ void wgmma_m64n128k8(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
#if KGEN_LINEAR_GEMM_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 " KGEN_WGMMA_D ", %64, %65, p, 1, 1;\n}\n"
      : KGEN_WGMMA_D_OUT(d)
      : "l"(a), "l"(b), "r"(scale_d));
#else
  (void)d, (void)a, (void)b, (void)scale_d;
  __trap();
#endif
}

// D[64 x 128] (+)= A[64 x 16] * B[16 x 128] with 16-bit operands T (bf16 or f16), fp32 accumulators in the same
// layout as above. Both operands K-major in shared memory (the immediates after the scales: no transpose of A or B).
template <class T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
#if KGEN_LINEAR_GEMM_WGMMA
  if constexpr (std::is_same<T, bfloat16>::value) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KGEN_WGMMA_D ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : KGEN_WGMMA_D_OUT(d)
        : "l"(a), "l"(b), "r"(scale_d));
  } else {
    static_assert(std::is_same<T, float16>::value, "bf16 or f16 operands");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " KGEN_WGMMA_D ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : KGEN_WGMMA_D_OUT(d)
        : "l"(a), "l"(b), "r"(scale_d));
  }
#else
  (void)d, (void)a, (void)b, (void)scale_d;
  __trap();
#endif
}

// ---- the split

// [rows, K] -> hi, lo [rows, Kp] (columns K .. Kp zero); kVector: K == Kp and `src` 16-byte aligned. A value
// whose hi is not finite (+-inf, NaN, or past TF32's largest value) gets lo 0 and, when `flags` is given, marks
// its row (flags[r] = 1; the caller zeroes them first) for fixup_kernel.
template <bool kVector>
__global__ void __launch_bounds__(256) split_kernel(const float* __restrict__ src, float* __restrict__ hi, float* __restrict__ lo,
                                                    int* __restrict__ flags, long long rows, int K, int Kp) {
  const int quads = Kp / 4;
  const long long total = rows * quads;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total; i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / quads;
    const int c = static_cast<int>(i - r * quads) * 4;
    float v[4];
    if constexpr (kVector) {
      const float4 t = __ldg(reinterpret_cast<const float4*>(src + r * K + c));
      v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = c + j < K ? src[r * K + c + j] : 0.f;
    }
    float h[4], l[4];
    bool finite = true;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      h[j] = tf32_rna(v[j]);
      finite = finite && isfinite(h[j]);
      l[j] = isfinite(h[j]) ? tf32_rna(v[j] - h[j]) : 0.f;
    }
    if (!finite && flags != nullptr) flags[r] = 1;
    *reinterpret_cast<float4*>(hi + r * Kp + c) = make_float4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<float4*>(lo + r * Kp + c) = make_float4(l[0], l[1], l[2], l[3]);
  }
}

inline cudaError_t split(const float* src, float* hi, float* lo, int* flags, long long rows, int K, int Kp, int sm_count,
                         cudaStream_t stream) {
  const long long quads = rows * (Kp / 4);
  if (quads == 0) return cudaSuccess;
  if (flags != nullptr) {
    const cudaError_t err = cudaMemsetAsync(flags, 0, rows * sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  const long long blocks = (quads + 255) / 256 < sm_count * 16LL ? (quads + 255) / 256 : sm_count * 16LL;
  if (K == Kp && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    split_kernel<true><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(src, hi, lo, flags, rows, K, Kp);
  } else {
    split_kernel<false><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(src, hi, lo, flags, rows, K, Kp);
  }
  return cudaGetLastError();
}

// The rows of A that split_kernel flagged (a value TF32 cannot hold), recomputed in fp32 on the CUDA cores with
// B = hi + lo, through the same epilogue: there an inf meets each weight as in an fp32 product (inf * 0 is NaN,
// infinities of both signs make NaN), where in split TF32 it would also meet B's lo plane, zero where a weight is
// a TF32 value (inf * 0: NaN where fp32 gives +-inf). Rare inputs: a block per flagged row, a thread per output.
template <class Epilogue>
__global__ void __launch_bounds__(256) fixup_kernel(const float* __restrict__ a, const float* __restrict__ b_hi, const float* __restrict__ b_lo,
                                                    const float* __restrict__ bias, const int* __restrict__ flags, const Epilogue epilogue,
                                                    int M, int N, int K, int Kp) {
  for (int m = blockIdx.x; m < M; m += gridDim.x) {
    if (flags[m] == 0) continue;
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
      float s = 0.f;
      for (int k = 0; k < K; ++k) s = fmaf(a[static_cast<long long>(m) * K + k], b_hi[static_cast<long long>(n) * Kp + k] + b_lo[static_cast<long long>(n) * Kp + k], s);
      epilogue(m, n, s + (bias != nullptr ? bias[n] : 0.f));
    }
  }
}

// ---- the GEMM

// `epilogue(row, col, v)` stores output (row, col) from its value v (the product plus the bias, in fp32). T: the
// operands' type (Operand<T>). float: the maps are A's and B's TF32 hi and lo planes [rows, Kp]; 16-bit: `a_hi` and
// `b_hi` are A and B as stored [rows, Kp] (Kp = K) and the lo maps are not read.
template <class T, class Epilogue>
__global__ void __maxnreg__(224) gemm_kernel(  // 288 threads x 224 registers: __launch_bounds__ made ptxas cap them at 168 and spill (lab gemm_lab in docs/performance.md)
    const __grid_constant__ CUtensorMap a_hi, const __grid_constant__ CUtensorMap a_lo,
                                                           const __grid_constant__ CUtensorMap b_hi, const __grid_constant__ CUtensorMap b_lo,
                                                           const T* __restrict__ bias, const Epilogue epilogue, int M, int N, int Kp) {
#if KGEN_LINEAR_GEMM_WGMMA
  constexpr int kPlanes = Operand<T>::kPlanes, kStages = Operand<T>::kStages, kBKT = kBK<T>, kStage = kStageBytes<T>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle wants 1024-byte alignment
  const uint32_t full = base + kStages * kStage;  // stage s loaded: full + 8 s
  const uint32_t empty = full + 8 * kStages;  // stage s consumed by both warpgroups: empty + 8 s

  const int tiles_m = (M + kBM - 1) / kBM, tiles_n = (N + kBN - 1) / kBN;
  const int per_group = kGroupM * tiles_n;
  const int first_m = static_cast<int>(blockIdx.x) / per_group * kGroupM;
  const int group_rows = min(tiles_m - first_m, kGroupM);
  const int in_group = static_cast<int>(blockIdx.x) % per_group;
  const int m0 = (first_m + in_group % group_rows) * kBM, n0 = in_group / group_rows * kBN;
  const int k_blocks = (Kp + kBKT - 1) / kBKT;  // TMA reads K past Kp as zeros
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 2) {  // the producer warp: one thread issues every load
    if (tid == 0) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        const int s = kb % kStages;
        mbar_wait(empty + 8 * s, ((kb / kStages) & 1) ^ 1);
        mbar_expect_tx(full + 8 * s, kStage);  // the boxes' full bytes, out-of-bounds zeros included
        const uint32_t st = base + s * kStage;
        // the stage: A's planes, then B's (tile p at p * kTileBytes); coordinates (K in values, row)
        tma_load(st, &a_hi, kb * kBKT, m0, full + 8 * s);
        if constexpr (kPlanes == 2) tma_load(st + kTileBytes, &a_lo, kb * kBKT, m0, full + 8 * s);
        tma_load(st + kPlanes * kTileBytes, &b_hi, kb * kBKT, n0, full + 8 * s);
        if constexpr (kPlanes == 2) tma_load(st + 3 * kTileBytes, &b_lo, kb * kBKT, n0, full + 8 * s);
      }
    }
    return;
  }

  float total[64], chunk[64];  // the fp32 total and this k-block's products (64 x 128 per warpgroup)
#pragma unroll
  for (int i = 0; i < 64; ++i) total[i] = 0.f, chunk[i] = 0.f;
  fence_regs(total);
  fence_regs(chunk);
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int s = kb % kStages;
    mbar_wait(full + 8 * s, (kb / kStages) & 1);
    const uint32_t st = base + s * kStage;
    const uint32_t ah = st + wg * 64 * kRowBytes, al = ah + kTileBytes;  // this warpgroup's 64 rows of A (its hi, lo planes)
    const uint32_t bh = st + kPlanes * kTileBytes, bl = bh + kTileBytes;  // B (its hi, lo planes)
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kRowBytes / 32; ++kk) {
      const uint32_t off = kk * 32;  // 32 bytes along K inside the swizzle atom: 8 TF32 or 16 16-bit values
      if constexpr (kPlanes == 2) {
        wgmma_m64n128k8(chunk, smem_desc(al + off), smem_desc(bh + off), kk == 0 ? 0 : 1);
        wgmma_m64n128k8(chunk, smem_desc(ah + off), smem_desc(bl + off), 1);
        wgmma_m64n128k8(chunk, smem_desc(ah + off), smem_desc(bh + off), 1);
      } else {
        wgmma_m64n128k16<T>(chunk, smem_desc(ah + off), smem_desc(bh + off), kk == 0 ? 0 : 1);
      }
    }
    wg_commit();
    wg_wait<0>();
    fence_regs(chunk);
    mbar_arrive(empty + 8 * s);  // the stage's tiles are read: the producer may refill it
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] += chunk[i];  // round-to-nearest fp32 adds
  }

  const int warp = tid / 32, lane = tid % 32;
  const int row0 = m0 + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int col = n0 + j * 8 + (lane % 4) * 2 + i;
      if (col >= N) continue;
      float b = 0.f;
      if constexpr (kPlanes == 2) {
        b = bias != nullptr ? __ldg(bias + col) : 0.f;
      } else {
        b = bias != nullptr ? to_float(bias[col]) : 0.f;  // a 16-bit bias, read as float
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row < M) epilogue(row, col, total[j * 4 + h * 2 + i] + b);
      }
    }
  }
#else
  (void)bias, (void)epilogue, (void)M, (void)N, (void)Kp;
  __trap();
#endif
}

// The driver's cuTensorMapEncodeTiled, through the runtime (no link to libcuda).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                 const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<EncodeTiled>(p) : nullptr;
  }();
  return fn;
}

// A TMA map of a [rows, Kp] plane of T read in [128, kBK<T>] boxes (128-byte rows; rows and K past the end read as
// zeros). TMA needs the plane 16-byte aligned and its row stride (Kp values) a multiple of 16 bytes.
template <class T>
inline cudaError_t plane_map(CUtensorMap* map, const T* plane, long long rows, int Kp) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(plane) % 16 != 0 || Kp * sizeof(T) % 16 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(Kp), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(Kp) * sizeof(T)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kBK<T>), kBM};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, Operand<T>::kMapType, 2, const_cast<T*>(plane), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// C = (A_hi + A_lo) (B_hi + B_lo)^T + bias through `epilogue`: A's planes [M, Kp], B's [N, Kp].
template <class Epilogue>
cudaError_t gemm_planes(const float* a_hi, const float* a_lo, const float* b_hi, const float* b_lo, const float* bias,
                        const Epilogue& epilogue, long long M, int N, int Kp, cudaStream_t stream) {
  CUtensorMap maps[4];
  cudaError_t err = plane_map(&maps[0], a_hi, M, Kp);
  if (err == cudaSuccess) err = plane_map(&maps[1], a_lo, M, Kp);
  if (err == cudaSuccess) err = plane_map(&maps[2], b_hi, N, Kp);
  if (err == cudaSuccess) err = plane_map(&maps[3], b_lo, N, Kp);
  if (err != cudaSuccess) return err;
  const long long tiles = (M + kBM - 1) / kBM * ((N + kBN - 1) / kBN);
  if (M > 0x7fffffffLL || tiles > 0x7fffffffLL) return cudaErrorInvalidValue;
  KernelSetup setup;
  err = kernel_setup<gemm_kernel<float, Epilogue>>(kThreads, kSmemBytes<float>, &setup);
  if (err != cudaSuccess) return err;
  gemm_kernel<float, Epilogue><<<static_cast<unsigned>(tiles), kThreads, kSmemBytes<float>, stream>>>(maps[0], maps[1], maps[2], maps[3], bias,
                                                                                                     epilogue, static_cast<int>(M), N, Kp);
  return cudaGetLastError();
}


// C = A B^T + bias through `epilogue`: A [M, K] split into `a_hi`, `a_lo` [M, Kp] (rows flagged in `flags`, M
// ints), B's planes [N, Kp]; then the flagged rows again in fp32 (fixup_kernel).
template <class Epilogue>
cudaError_t gemm(const float* a, float* a_hi, float* a_lo, int* flags, const float* b_hi, const float* b_lo, const float* bias,
                 const Epilogue& epilogue, long long M, int N, int K, int Kp, int sm_count, cudaStream_t stream) {
  if (M > 0x7fffffffLL) return cudaErrorInvalidValue;
  cudaError_t err = split(a, a_hi, a_lo, flags, M, K, Kp, sm_count, stream);
  if (err == cudaSuccess) err = gemm_planes(a_hi, a_lo, b_hi, b_lo, bias, epilogue, M, N, Kp, stream);
  if (err != cudaSuccess) return err;
  const int blocks = M < sm_count * 4LL ? static_cast<int>(M) : sm_count * 4;
  fixup_kernel<Epilogue><<<blocks, 256, 0, stream>>>(a, b_hi, b_lo, bias, flags, epilogue, static_cast<int>(M), N, K, Kp);
  return cudaGetLastError();
}

// C = A B^T + bias through `epilogue` with 16-bit operands T as stored: A [M, K], B [N, K] and the bias [N] (or
// null) of T, A and B 16-byte aligned and K % 8 == 0 (16-byte rows, for TMA). One launch: no split, no fixup.
template <class T, class Epilogue>
cudaError_t gemm16(const T* a, const T* b, const T* bias, const Epilogue& epilogue, long long M, int N, int K, cudaStream_t stream) {
  static_assert(sizeof(T) == 2, "16-bit operands (float: gemm)");
  if (M > 0x7fffffffLL) return cudaErrorInvalidValue;
  CUtensorMap maps[2];
  cudaError_t err = plane_map(&maps[0], a, M, K);
  if (err == cudaSuccess) err = plane_map(&maps[1], b, N, K);
  if (err != cudaSuccess) return err;
  const long long tiles = (M + kBM - 1) / kBM * ((N + kBN - 1) / kBN);
  if (tiles > 0x7fffffffLL) return cudaErrorInvalidValue;
  KernelSetup setup;
  err = kernel_setup<gemm_kernel<T, Epilogue>>(kThreads, kSmemBytes<T>, &setup);
  if (err != cudaSuccess) return err;
  // one plane per operand: the kernel reads the first and third maps only (the lo maps repeat them)
  gemm_kernel<T, Epilogue><<<static_cast<unsigned>(tiles), kThreads, kSmemBytes<T>, stream>>>(maps[0], maps[0], maps[1], maps[1], bias,
                                                                                               epilogue, static_cast<int>(M), N, K);
  return cudaGetLastError();
}

}  // namespace linear_gemm
}  // namespace kgen
