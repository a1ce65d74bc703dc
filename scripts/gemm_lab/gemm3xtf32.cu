// Split-TF32 ("3xTF32") GEMM for Hopper (sm_90a):  C[M,N] = A[M,K] @ B[N,K]^T + bias[N], fp32 in/out.
//
//   a = a_hi + a_lo,  a_hi = cvt.rna.tf32(a),  a_lo = cvt.rna.tf32(a - a_hi)   (same for b)
//   a*b ~= a_lo*b_hi + a_hi*b_lo + a_hi*b_hi     (three TF32 tensor-core products, fp32 accumulators)
//
// Pieces:
//   g3_split : elementwise split of a row-major [rows, K] fp32 matrix into hi/lo planes [rows, Kp]
//              (Kp = K rounded up to a multiple of 4, zero padded).  Used once per weight version
//              ("weight transform") and once per call for the activation.
//   g3_gemm  : TMA (cp.async.bulk.tensor, 64B/128B swizzle) -> STAGES-deep mbarrier ring ->
//              wgmma m64nBNk8 tf32 (both operands from shared memory, K-major), 2 consumer
//              warpgroups (warps 0-7, 64 rows of the 128-row tile each) + 1 producer warp
//              (warp 8, one thread issues TMA); 288 threads -> 224 registers/thread.  Epilogue: + bias, fp32 store straight
//              from the accumulator registers (bounds-checked: any M, N; K any via Kp padding).
//
// Build (here, no GPU needed): nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v
//        -shared -Xcompiler -fPIC -o build/libg3.so gemm3xtf32.cu
// Everything below is written for this lab; no CUTLASS/CuTe code.

#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "wgmma_tf32.h"

#ifndef G3_WATCHDOG
#define G3_WATCHDOG 1  // trap (instead of hanging) if an mbarrier wait lasts > ~4e10 cycles
#endif

namespace g3 {

// ----------------------------------------------------------------------------------------------
// small PTX helpers
// ----------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ float tf32_rna(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ uint32_t mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok;
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
#if G3_WATCHDOG
  long long t0 = clock64();
#endif
  while (!mbar_try_wait(bar, parity)) {
#if G3_WATCHDOG
    if (clock64() - t0 > 40000000000LL) asm volatile("trap;");  // no printf: a call would
                                                                 // serialize the wgmma pipeline
#endif
  }
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma shared-memory matrix descriptor, K-major operand, swizzle SW bytes (64 or 128):
// rows of SW bytes, 8-row swizzle atoms stacked at SBO = 8*SW bytes; LBO unused (1).
template <int SW>
__device__ __forceinline__ uint64_t make_desc(uint32_t saddr) {
  constexpr uint64_t mode = SW == 128 ? 1 : (SW == 64 ? 2 : 3);
  constexpr uint64_t sbo = 8 * SW;
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((sbo >> 4) << 32) |
         (mode << 62);
}

// ----------------------------------------------------------------------------------------------
// split kernel: [rows, K] -> hi/lo [rows, Kp]
// ----------------------------------------------------------------------------------------------
__global__ void split_kernel(const float* __restrict__ src, float* __restrict__ hi,
                             float* __restrict__ lo, int rows, int K, int Kp, int vec) {
  const int kq = Kp / 4;
  const long long nvec = (long long)rows * kq;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nvec;
       i += (long long)gridDim.x * blockDim.x) {
    const int r = (int)(i / kq);
    const int c = (int)(i - (long long)r * kq) * 4;
    float v[4];
    if (vec) {
      float4 t = __ldg(reinterpret_cast<const float4*>(src + (size_t)r * K + c));
      v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = (c + j < K) ? src[(size_t)r * K + c + j] : 0.f;
    }
    float h[4], l[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      h[j] = tf32_rna(v[j]);
      l[j] = tf32_rna(v[j] - h[j]);
    }
    *reinterpret_cast<float4*>(hi + (size_t)r * Kp + c) = make_float4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<float4*>(lo + (size_t)r * Kp + c) = make_float4(l[0], l[1], l[2], l[3]);
  }
}

// ----------------------------------------------------------------------------------------------
// GEMM kernel
// ----------------------------------------------------------------------------------------------
// NPROD: 3 = split TF32 (fp32-accurate), 1 = plain TF32 (hi*hi only; a speed reference).
// ACC: how the products are accumulated.  The tensor cores' fp32 accumulation does not round
//      to nearest (measured: with one long-lived accumulator the error grows ~linearly with K,
//      20-50x cuBLAS at K=4096), so:
//   0: one tensor-core accumulator for everything (fast, NOT fp32-accurate for large K)
//   1: two long-lived tensor-core accumulators (hi*hi | corrections)             BN <= 128
//   2: "promotion": each k-block's 3 products go to a fresh chunk accumulator
//      (scale-d = 0 on its first wgmma), then total += chunk in CUDA-core fp32   BN <= 192
//   3: like 2 but only hi*hi is chunked; the two corrections (2^-11 smaller) stay in a
//      long-lived tensor-core accumulator added at the end                       BN <= 128
// CH: (ACC 2/3) k-blocks per chunk, i.e. the chunk spans CH*BK of K.
template <int BN_, int BK_, int STAGES_, int NPROD_, int ACC_, int CH_ = 1>
struct Cfg {
  static constexpr int BM = 128, BN = BN_, BK = BK_, STAGES = STAGES_, NPROD = NPROD_;
  static constexpr int ACC = ACC_, CH = CH_;
  static_assert(NPROD == 3 || ACC == 0, "plain tf32 uses ACC 0");
  static_assert(ACC == 0 || (ACC == 2 && BN <= 192) || BN <= 128, "accumulators exceed registers");
  static constexpr int SW = BK * 4;  // bytes per smem row = swizzle width
  static_assert(SW == 64 || SW == 128, "BK must be 16 or 32");
  static constexpr int A_BYTES = BM * BK * 4;
  static constexpr int B_BYTES = BN * BK * 4;
  static constexpr int STAGE_BYTES = 2 * A_BYTES + 2 * B_BYTES;  // Ahi, Alo, Bhi, Blo
  static constexpr int TX_BYTES = NPROD == 3 ? STAGE_BYTES : A_BYTES + B_BYTES;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024 + 2 * STAGES * 8;
  static_assert(SMEM <= 232448, "shared memory");
  static constexpr int GROUP_M = 8;  // tile raster: groups of 8 M-tiles sweep N
};

template <int BN>
__device__ __forceinline__ void wgmma_tf32(float (&d)[BN / 2], uint64_t da, uint64_t db,
                                           int scale_d = 1) {
  if constexpr (BN == 256) wgmma_tf32_n256(d, da, db, scale_d);
  else if constexpr (BN == 192) wgmma_tf32_n192(d, da, db, scale_d);
  else wgmma_tf32_n128(d, da, db, scale_d);
}


template <class C>
__global__ void __maxnreg__(224)  // 288 threads x <= 224 regs fit the 64K register file
    gemm_kernel(const __grid_constant__ CUtensorMap tAhi, const __grid_constant__ CUtensorMap tAlo,
                const __grid_constant__ CUtensorMap tBhi, const __grid_constant__ CUtensorMap tBlo,
                const float* __restrict__ bias, float* __restrict__ Cout, int M, int N, int Kp) {
  constexpr int BM = C::BM, BN = C::BN, BK = C::BK, STAGES = C::STAGES;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bar_full = sbase + STAGES * C::STAGE_BYTES;
  const uint32_t bar_empty = bar_full + 8 * STAGES;

  // tile raster (grouped along M for L2 reuse of the B tiles)
  const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const int pid = blockIdx.x;
  const int per_group = C::GROUP_M * tiles_n;
  const int first_m = (pid / per_group) * C::GROUP_M;
  const int gsize = min(tiles_m - first_m, C::GROUP_M);
  const int pid_m = first_m + (pid % per_group) % gsize;
  const int pid_n = (pid % per_group) / gsize;
  const int m0 = pid_m * BM, n0 = pid_n * BN;
  const int nk = (Kp + BK - 1) / BK;

  // warps 0-7: two consumer warpgroups (wgmma needs warpgroups aligned to 4 warps);
  // warp 8: producer.  288 threads -> up to 224 registers per thread, no setmaxnreg needed
  // (ptxas capped a 288-thread __launch_bounds__ at 168 registers, as for 384, and spilled).
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 2) {
    // ---------------- producer warp: one thread issues all TMA loads ----------------
    if (tid == 0) {
      for (int kb = 0; kb < nk; ++kb) {
        const int s = kb % STAGES;
        const uint32_t ph = (kb / STAGES) & 1;
        mbar_wait(bar_empty + 8 * s, ph ^ 1);
        const uint32_t full = bar_full + 8 * s;
        mbar_expect_tx(full, C::TX_BYTES);
        const uint32_t st = sbase + s * C::STAGE_BYTES;
        const int k = kb * BK;
        tma_load_2d(st, &tAhi, k, m0, full);
        tma_load_2d(st + 2 * C::A_BYTES, &tBhi, k, n0, full);
        if (C::NPROD == 3) {
          tma_load_2d(st + C::A_BYTES, &tAlo, k, m0, full);
          tma_load_2d(st + 2 * C::A_BYTES + C::B_BYTES, &tBlo, k, n0, full);
        }
      }
    }
  } else {
    // ---------------- consumer warpgroups: 64 x BN each ----------------
    const int cw = wg;
    constexpr int R = BN / 2;                       // accumulator registers per thread
    constexpr int R2 = C::ACC == 0 ? 1 : R;         // chunk (ACC 1: corrections)
    constexpr int R3 = C::ACC == 3 ? R : 1;         // long-lived corrections (ACC 3)
    float acc[R], acc2[R2], acc3[R3];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < R2; ++i) acc2[i] = 0.f;
#pragma unroll
    for (int i = 0; i < R3; ++i) acc3[i] = 0.f;
    fence_regs(acc);
    fence_regs(acc2);
    fence_regs(acc3);

    int rel = 0;  // first k-block whose stage is not yet released
    for (int kb = 0; kb < nk; ++kb) {
      const int s = kb % STAGES;
      mbar_wait(bar_full + 8 * s, (kb / STAGES) & 1);
      const bool chunk_start = (kb % C::CH) == 0;
      const uint32_t st = sbase + s * C::STAGE_BYTES;
      const uint32_t a_hi = st + cw * 64 * BK * 4;
      const uint32_t a_lo = a_hi + C::A_BYTES;
      const uint32_t b_hi = st + 2 * C::A_BYTES;
      const uint32_t b_lo = b_hi + C::B_BYTES;
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 8; ++kk) {
        const uint32_t off = kk * 32;  // 8 tf32 = 32 bytes along K inside the swizzle atom
        const uint64_t dah = make_desc<C::SW>(a_hi + off);
        const uint64_t dbh = make_desc<C::SW>(b_hi + off);
        const int fresh = (kk == 0 && chunk_start) ? 0 : 1;  // scale-d 0 starts a new chunk
        if constexpr (C::NPROD == 1) {
          wgmma_tf32<BN>(acc, dah, dbh);
        } else if constexpr (C::ACC == 0) {
          wgmma_tf32<BN>(acc, make_desc<C::SW>(a_lo + off), dbh);
          wgmma_tf32<BN>(acc, dah, make_desc<C::SW>(b_lo + off));
          wgmma_tf32<BN>(acc, dah, dbh);
        } else if constexpr (C::ACC == 1) {
          wgmma_tf32<BN>(acc2, make_desc<C::SW>(a_lo + off), dbh);
          wgmma_tf32<BN>(acc2, dah, make_desc<C::SW>(b_lo + off));
          wgmma_tf32<BN>(acc, dah, dbh);
        } else if constexpr (C::ACC == 2) {
          wgmma_tf32<BN>(acc2, make_desc<C::SW>(a_lo + off), dbh, fresh);
          wgmma_tf32<BN>(acc2, dah, make_desc<C::SW>(b_lo + off));
          wgmma_tf32<BN>(acc2, dah, dbh);
        } else {
          wgmma_tf32<BN>(acc3, make_desc<C::SW>(a_lo + off), dbh);
          wgmma_tf32<BN>(acc3, dah, make_desc<C::SW>(b_lo + off));
          wgmma_tf32<BN>(acc2, dah, dbh, fresh);
        }
      }
      wg_commit();
      if constexpr (C::ACC >= 2) {
        if ((kb % C::CH) == C::CH - 1 || kb == nk - 1) {
          wg_wait<0>();  // chunk complete: promote it with round-to-nearest fp32 adds
          fence_regs(acc2);
          for (; rel <= kb; ++rel) mbar_arrive(bar_empty + 8 * (rel % STAGES));
#pragma unroll
          for (int i = 0; i < R; ++i) acc[i] += acc2[i];
        } else {
          wg_wait<1>();
          for (; rel < kb; ++rel) mbar_arrive(bar_empty + 8 * (rel % STAGES));
        }
      } else {
        wg_wait<1>();  // the group of kb-1 is done: its stage can be refilled
        if (kb > 0) mbar_arrive(bar_empty + 8 * ((kb - 1) % STAGES));
      }
    }
    wg_wait<0>();
    fence_regs(acc);
    fence_regs(acc2);
    fence_regs(acc3);
    if constexpr (C::ACC == 1) {
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] += acc2[i];
    }
    if constexpr (C::ACC == 3) {
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] += acc3[i];
    }

    // ---------------- epilogue: + bias, store fp32 ----------------
    // (in the product an elementwise epilogue would be applied to v0/v1 right here)
    const int warp = tid / 32, lane = tid % 32;
    const int row0 = m0 + cw * 64 + warp * 16 + lane / 4;
    const bool n_even = (N % 2) == 0;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = n0 + j * 8 + (lane % 4) * 2;
      float b0 = 0.f, b1 = 0.f;
      if (bias != nullptr) {
        if (col < N) b0 = __ldg(bias + col);
        if (col + 1 < N) b1 = __ldg(bias + col + 1);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row < M) {
          const float v0 = acc[j * 4 + h * 2 + 0] + b0;
          const float v1 = acc[j * 4 + h * 2 + 1] + b1;
          float* p = Cout + (size_t)row * N + col;
          if (n_even && col + 1 < N) {
            *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
          } else {
            if (col < N) p[0] = v0;
            if (col + 1 < N) p[1] = v1;
          }
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// host side
// ----------------------------------------------------------------------------------------------
static char g_err[512] = "";
static int fail(const char* msg) {
  snprintf(g_err, sizeof g_err, "%s", msg);
  return 1;
}
static int cuda_fail(const char* where, cudaError_t e) {
  snprintf(g_err, sizeof g_err, "%s: %s", where, cudaGetErrorString(e));
  return 1;
}

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                  const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                  const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn get_encode() {
  static EncodeTiledFn fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}

static int make_map(CUtensorMap* m, const float* p, int rows, int Kp, int box_k, int box_rows) {
  EncodeTiledFn enc = get_encode();
  if (!enc) return fail("cuTensorMapEncodeTiled not available");
  if (reinterpret_cast<uintptr_t>(p) % 16) return fail("operand plane not 16-byte aligned");
  cuuint64_t dims[2] = {(cuuint64_t)Kp, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)Kp * 4};
  cuuint32_t box[2] = {(cuuint32_t)box_k, (cuuint32_t)box_rows};
  cuuint32_t estr[2] = {1, 1};
  CUtensorMapSwizzle sw = box_k * 4 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(p), dims, strides, box,
                   estr, CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    snprintf(g_err, sizeof g_err, "cuTensorMapEncodeTiled failed (%d)", (int)r);
    return 1;
  }
  return 0;
}

template <class C>
static int launch(const float* Ahi, const float* Alo, const float* Bhi, const float* Blo,
                  const float* bias, float* Cout, int M, int N, int Kp, cudaStream_t st) {
  static bool attr = false;
  if (!attr) {
    cudaError_t e = cudaFuncSetAttribute(gemm_kernel<C>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (e != cudaSuccess) return cuda_fail("cudaFuncSetAttribute", e);
    attr = true;
  }
  CUtensorMap tAhi, tAlo, tBhi, tBlo;
  if (make_map(&tAhi, Ahi, M, Kp, C::BK, C::BM) || make_map(&tAlo, Alo, M, Kp, C::BK, C::BM) ||
      make_map(&tBhi, Bhi, N, Kp, C::BK, C::BN) || make_map(&tBlo, Blo, N, Kp, C::BK, C::BN))
    return 1;
  const long long tiles = (long long)((M + C::BM - 1) / C::BM) * ((N + C::BN - 1) / C::BN);
  if (tiles > 0x7fffffffLL) return fail("too many tiles");
  gemm_kernel<C><<<(unsigned)tiles, 288, C::SMEM, st>>>(tAhi, tAlo, tBhi, tBlo, bias, Cout, M, N,
                                                        Kp);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_fail("gemm launch", e);
  return 0;
}

struct Variant {
  const char* name;
  int (*fn)(const float*, const float*, const float*, const float*, const float*, float*, int, int,
            int, cudaStream_t);
};

static const Variant kVariants[] = {
    {"3x_acc0_bn256_bk16_s4(inaccurate)", launch<Cfg<256, 16, 4, 3, 0>>},
    {"3x_acc2_bn128_bk32_s3_ch1", launch<Cfg<128, 32, 3, 3, 2, 1>>},
    {"3x_acc2_bn128_bk32_s3_ch2", launch<Cfg<128, 32, 3, 3, 2, 2>>},
    {"3x_acc2_bn128_bk32_s3_ch4", launch<Cfg<128, 32, 3, 3, 2, 4>>},
    {"3x_acc2_bn128_bk16_s6_ch2", launch<Cfg<128, 16, 6, 3, 2, 2>>},
    {"3x_acc2_bn128_bk16_s6_ch4", launch<Cfg<128, 16, 6, 3, 2, 4>>},
    {"1x_bn256_bk16_s4(plain tf32, NOT fp32-accurate)", launch<Cfg<256, 16, 4, 1, 0>>},
    // kept out (measured 2026-11-27, H100): ACC 3 and BN=192 need ~205 registers; with 288
    // threads the launch fails ("too many resources requested": allocation as for 12 warps),
    // with 384 threads ptxas caps them at 168 and spills.
};

}  // namespace g3

extern "C" {

const char* g3_last_error() { return g3::g_err; }

int g3_num_variants() { return (int)(sizeof(g3::kVariants) / sizeof(g3::kVariants[0])); }

const char* g3_variant_name(int v) {
  if (v < 0 || v >= g3_num_variants()) return "";
  return g3::kVariants[v].name;
}

// Kp must be >= K and a multiple of 4; hi/lo are [rows, Kp] (pad columns written as 0).
int g3_split(const float* src, float* hi, float* lo, int rows, int K, int Kp, void* stream) {
  if (rows <= 0 || K <= 0 || Kp < K || Kp % 4) return g3::fail("g3_split: bad sizes");
  if (reinterpret_cast<uintptr_t>(hi) % 16 || reinterpret_cast<uintptr_t>(lo) % 16)
    return g3::fail("g3_split: hi/lo not 16-byte aligned");
  const int vec = (K == Kp) && (reinterpret_cast<uintptr_t>(src) % 16 == 0);
  const long long nvec = (long long)rows * (Kp / 4);
  long long blocks = (nvec + 255) / 256;
  if (blocks > 132LL * 64) blocks = 132LL * 64;
  g3::split_kernel<<<(unsigned)blocks, 256, 0, (cudaStream_t)stream>>>(src, hi, lo, rows, K, Kp,
                                                                       vec);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return g3::cuda_fail("split launch", e);
  return 0;
}

// C[M,N] = (Ahi+Alo)[M,Kp] @ (Bhi+Blo)[N,Kp]^T + bias[N]   (bias may be null)
int g3_gemm(int variant, const float* Ahi, const float* Alo, const float* Bhi, const float* Blo,
            const float* bias, float* C, int M, int N, int Kp, void* stream) {
  if (variant < 0 || variant >= g3_num_variants()) return g3::fail("g3_gemm: bad variant");
  if (M <= 0 || N <= 0 || Kp <= 0 || Kp % 4) return g3::fail("g3_gemm: bad sizes (Kp % 4 != 0?)");
  return g3::kVariants[variant].fn(Ahi, Alo, Bhi, Blo, bias, C, M, N, Kp, (cudaStream_t)stream);
}

}  // extern "C"
