// Lab (notes/next_conv_gemm.md 0h): instnorm_clamp_max's 3 -> 16 conv3d (k 3, 16 x 32 x 32 input) on
// wgmma in split TF32, with N = 32 = two output planes x 16 channels, so that the wgmma runs at
// N = 32 (scripts/inst_mma_lab/wgmma_rate.cu: 27 clocks per m64n32k8 with the A gather, against
// 23 per m64n16k8). Computes conv + bias, then the max over the channels (the old labs' output),
// [N, 14, 30, 30]. Driver: scripts/inst_mma_lab/run_wg32.py.
//
// GEMM: M = 64 positions (2 rows x 32 columns of one output-plane pair; columns 30, 31 are
// computed and dropped), N = (plane p, channel co), K = (cin, kd' in 0..3, kh, kw) = 108 padded to
// 112: 14 k steps. B[k][(p, co)] = W[co][cin][kd' - p][kh][kw] where 0 <= kd' - p <= 2, else 0;
// packed by the driver in wgmma's K-major core-matrix layout, hi and lo TF32 parts.
// A (registers): the m16n8k8-style fragment of each warp's 16 rows; a thread gathers its 4 values
// per m-tile and k step from the input box in shared memory (a k -> box offset table) and splits
// them: hi = cvt.rna, lo = x - hi (0 where x is not finite). Three wgmma per k step and m-tile:
// a_hi b_hi + a_lo b_hi + a_hi b_lo.
// A CTA is one warpgroup; a tile is an output-plane pair x 8 rows x 32 columns (LAB_T = 4 m-tiles);
// persistent CTAs; the box (3 x 4 x 10 x 36 floats) double-buffered: the next tile's by cp.async
// (zero-filled beyond the input) under this tile's MMAs (LAB_SYNC_BOX=1: loaded synchronously).
#include <cstdint>
#include <cuda_runtime.h>

#ifndef LAB_T
#define LAB_T 4
#endif
#ifndef LAB_MINB
#define LAB_MINB 3
#endif
#ifndef LAB_SYNC_BOX
#define LAB_SYNC_BOX 0
#endif

namespace {
constexpr int kCin = 3, kD = 16, kH = 32, kW = 32, kOD = 14, kOH = 30, kOW = 30;
constexpr int kT = LAB_T;                // m-tiles per warpgroup (2 rows each)
constexpr int kRows = 2 * kT;            // output rows per tile
constexpr int kRowGroups = (kOH + kRows - 1) / kRows;
constexpr int kTilesPerSample = (kOD / 2) * kRowGroups;
constexpr int kPitch = 36, kBoxRows = kRows + 2, kBoxD = kBoxRows * kPitch, kBoxC = 4 * kBoxD;
constexpr int kBoxFloats = kCin * kBoxC;
constexpr int kZero = kBoxFloats;        // a zero slot: the padded k's A value
constexpr int kK = 112, kSteps = kK / 8;
constexpr int kStepFloats = 256;         // B of one k step, N = 32: 4 n-tiles x 2 k quads x 8 x 4
constexpr int kBFloats = kSteps * kStepFloats;

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {  // no swizzle; k quads 128 bytes apart, n-tiles 256
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int K>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(K) : "memory"); }

__device__ __forceinline__ void mma(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "{%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

__device__ __forceinline__ void split(float v, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(v));
  lo = __float_as_uint(fabsf(v) < INFINITY ? v - __uint_as_float(hi) : 0.f);
}

__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// 16 bytes global -> shared, zero-filled when !valid
__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int K>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(K) : "memory"); }

// The box of tile `tile` into `box` by cp.async: per (cin, depth, row) 9 chunks of 4 columns.
__device__ __forceinline__ void load_box(float* box, const float* __restrict__ x, int tile, int tid) {
  const int n = tile / kTilesPerSample, rest = tile % kTilesPerSample;
  const int d0 = 2 * (rest / kRowGroups), h0 = kRows * (rest % kRowGroups);
  const float* xs = x + static_cast<long long>(n) * kCin * kD * kH * kW;
  constexpr int kChunks = kCin * 4 * kBoxRows * (kPitch / 4);
  for (int e = tid; e < kChunks; e += 128) {
    const int q = e % (kPitch / 4), r = e / (kPitch / 4) % kBoxRows, dz = e / ((kPitch / 4) * kBoxRows) % 4;
    const int c = e / ((kPitch / 4) * kBoxRows * 4), h = h0 + r;
    const bool valid = 4 * q < kW && h < kH;
    cp_async16(box + c * kBoxC + dz * kBoxD + r * kPitch + 4 * q,
               valid ? xs + ((c * kD + d0 + dz) * kH + h) * kW + 4 * q : xs, valid);
  }
}

__global__ void __launch_bounds__(128, LAB_MINB) conv_max_wg32(const float* __restrict__ x, const float* __restrict__ packed,
                                                              const float* __restrict__ bias, float* __restrict__ out,
                                                              int batch) {
  extern __shared__ __align__(128) float smem[];
  float* s_b = smem;                       // hi: kBFloats, then lo
  float* s_boxes = smem + 2 * kBFloats;    // two boxes of kBoxFloats + 4 (the zero slot, padding)
  __shared__ int s_koff[kK];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  for (int i = tid; i < 2 * kBFloats / 4; i += 128)
    reinterpret_cast<float4*>(s_b)[i] = __ldg(reinterpret_cast<const float4*>(packed) + i);
  for (int k = tid; k < kK; k += 128) {
    if (k < 108) {
      const int kw = k % 3, kh = k / 3 % 3, kd = k / 9 % 4, cin = k / 36;
      s_koff[k] = cin * kBoxC + kd * kBoxD + kh * kPitch + kw;
    } else {
      s_koff[k] = -1;  // -> the zero slot
    }
  }
  if (tid == 0) s_boxes[kZero] = s_boxes[kBoxFloats + 4 + kZero] = 0.f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // wgmma reads B through the async proxy
  __syncthreads();
  const uint64_t b_hi = smem_desc(smem_addr(s_b)), b_lo = smem_desc(smem_addr(s_b + kBFloats));
  // this thread's rows: warp w covers m 16w .. 16w + 15 of each m-tile (row w / 2, columns 16 (w % 2) + 0..15)
  const int row_in_mt = warp / 2, col0 = 16 * (warp % 2) + g;
  float bias_reg[4];  // channels 2t, 2t + 1, 8 + 2t, 8 + 2t + 1
  bias_reg[0] = bias[2 * t];
  bias_reg[1] = bias[2 * t + 1];
  bias_reg[2] = bias[8 + 2 * t];
  bias_reg[3] = bias[8 + 2 * t + 1];

  const int tiles = batch * kTilesPerSample;
  if (!LAB_SYNC_BOX && blockIdx.x < tiles) load_box(s_boxes, x, blockIdx.x, tid);
  cp_commit();
  int buf = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, buf ^= 1) {
    const int n = tile / kTilesPerSample, rest = tile % kTilesPerSample;
    const int d0 = 2 * (rest / kRowGroups), h0 = kRows * (rest % kRowGroups);
    float* s_box = s_boxes + buf * (kBoxFloats + 4);
    if (LAB_SYNC_BOX) {
      load_box(s_box, x, tile, tid);
      cp_commit();
      cp_wait<0>();
    } else {
      if (tile + static_cast<int>(gridDim.x) < tiles) load_box(s_boxes + (buf ^ 1) * (kBoxFloats + 4), x, tile + gridDim.x, tid);
      cp_commit();
      cp_wait<1>();  // this tile's box (this thread's part)
    }
    __syncthreads();
    int pos[kT][2];
#pragma unroll
    for (int mt = 0; mt < kT; ++mt) {
      pos[mt][0] = (2 * mt + row_in_mt) * kPitch + col0;
      pos[mt][1] = pos[mt][0] + 8;
    }
    float acc[kT][16];
#pragma unroll
    for (int mt = 0; mt < kT; ++mt)
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[mt][i] = 0.f;
    uint32_t hi[2][kT][4], lo[2][kT][4];
    auto gather = [&](int set, int s) {
      const int o0 = s_koff[8 * s + t], o1 = s_koff[8 * s + t + 4];
#pragma unroll
      for (int mt = 0; mt < kT; ++mt) {
        const float v0 = s_box[o0 < 0 ? kZero : pos[mt][0] + o0];
        const float v1 = s_box[o0 < 0 ? kZero : pos[mt][1] + o0];
        const float v2 = s_box[o1 < 0 ? kZero : pos[mt][0] + o1];
        const float v3 = s_box[o1 < 0 ? kZero : pos[mt][1] + o1];
        split(v0, hi[set][mt][0], lo[set][mt][0]);
        split(v1, hi[set][mt][1], lo[set][mt][1]);
        split(v2, hi[set][mt][2], lo[set][mt][2]);
        split(v3, hi[set][mt][3], lo[set][mt][3]);
      }
    };
    auto step = [&](int set, int s) {  // called with a literal set: the sets stay in registers
      fence();
      const uint64_t off = static_cast<uint64_t>(s * kStepFloats * 4 / 16);
#pragma unroll
      for (int mt = 0; mt < kT; ++mt) {
        mma(acc[mt], lo[set][mt], b_hi + off);
        mma(acc[mt], hi[set][mt], b_lo + off);
        mma(acc[mt], hi[set][mt], b_hi + off);
      }
      commit();
      wait<1>();  // step s - 1 done: its set is free
      if (s + 1 < kSteps) gather(set ^ 1, s + 1);
    };
    gather(0, 0);
#pragma unroll 1
    for (int s = 0; s < kSteps; s += 2) {
      step(0, s);
      step(1, s + 1);
    }
    wait<0>();
    // epilogue: per (m-tile, row half, plane) the max over the 16 channels: 4 in this thread, then over t
#pragma unroll
    for (int mt = 0; mt < kT; ++mt) {
      const int h = h0 + 2 * mt + row_in_mt;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int w = col0 + 8 * half;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          // n-tiles 2p (channels 2t, 2t + 1) and 2p + 1 (channels 8 + 2t, 8 + 2t + 1)
          float m = acc[mt][8 * p + 2 * half] + bias_reg[0];
          m = max_nan(m, acc[mt][8 * p + 2 * half + 1] + bias_reg[1]);
          m = max_nan(m, acc[mt][8 * p + 4 + 2 * half] + bias_reg[2]);
          m = max_nan(m, acc[mt][8 * p + 4 + 2 * half + 1] + bias_reg[3]);
          m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
          m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
          if (t == 0 && h < kOH && w < kOW) out[((static_cast<long long>(n) * kOD + d0 + p) * kOH + h) * kOW + w] = m;
        }
      }
    }
    __syncthreads();  // every gather is done with this box before the next tile's loads go into it
  }
  cp_wait<0>();
}
}  // namespace

extern "C" int lab_run(const float* x, const float* packed, const float* bias, float* out, int batch, void* stream) {
  constexpr int kSmem = 2 * kBFloats * 4 + 2 * (kBoxFloats + 4) * 4;
  static int grid = 0;
  if (grid == 0) {
    cudaFuncSetAttribute(conv_max_wg32, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    int per_sm = 0, sms = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, conv_max_wg32, 128, kSmem);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    grid = per_sm * sms;
    if (grid == 0) return 1;
  }
  conv_max_wg32<<<grid, 128, kSmem, static_cast<cudaStream_t>(stream)>>>(x, packed, bias, out, batch);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int lab_tiles_per_sample() { return kTilesPerSample; }
