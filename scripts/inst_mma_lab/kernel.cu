// Lab: instnorm_clamp_max's 3 -> 16 conv3d (k 3, 16x32x32 -> 14x30x30) on tensor cores with
// fp32-level accuracy (split TF32, three mma.sync m16n8k8 per product), channels as M.
//
// GEMM view, transposed from conv_gemm.cuh's: M = the 16 output channels (one m16 tile), N = output
// positions (n-tiles of 8 consecutive positions in W), K = the 81 taps (ci, kd, kh, kw) in an order
// chosen so that a thread's two k-slots of a step are one box row each: row r = 9 ci + 3 kd + kh goes
// to lane t = r % 4 (rows 4q + t), kw and q follow from the step. The box's row, depth and channel
// pitches make row r start at bank 8 (r % 4), so the 32 lanes of a B load (8 positions x 4 rows) hit
// 32 banks. A (the weights, hi and lo) is packed per step and lane; B (the box) is split once into
// (hi, lo) pairs, so a k step of an n-tile is two 8-byte loads and three MMAs.
// The epilogue here is a stand-in for the norm: bias, then the max over channels.
#include <cuda_runtime.h>
#include <cstdint>

namespace lab {
constexpr int kCin = 3, kCout = 16, kID = 16, kIH = 32, kIW = 32;
constexpr int kOD = 14, kOH = 30, kOW = 30;
#ifndef LAB_MINB
#define LAB_MINB 3
#endif
#ifndef LAB_TH
#define LAB_TH 16
#endif
constexpr int kTD = 2, kTH = LAB_TH;  // W: 32  // a CTA tile; 4 warps: (d, 8-row half of H)
constexpr int kBD = kTD + 2, kBH = kTH + 2;  // the box (W: 34 columns, 32 read + 2 zero)
constexpr int kRows = 27, kSteps = 11;      // 81 taps = 27 rows x 3 kw -> 21 (q, kw) combos, 2 per step
// pitches in floats; residues mod 32 (banks) make row r start at bank 8 (r % 4)
constexpr int kPH = 40;                       // >= 34, = 8 mod 32
__host__ __device__ constexpr int pad_to(int v, int r) { return v + ((r - v % 32) + 32) % 32; }
constexpr int kPD = pad_to(kBH * kPH, 24);    // = 24 mod 32
constexpr int kPC = pad_to(kBD * kPD, 8);     // = 8 mod 32
constexpr int kBoxFloats = kCin * kPC;
constexpr int kZeroBase = kBoxFloats;         // zeros read by the padded row 27 (lane t = 3)
constexpr int kZeroFloats = 32 + (kTH / 2 - 1) * kPH + 32 + 8;
constexpr int kRegion = (kZeroBase + kZeroFloats + 31) / 32 * 32;  // the hi box + zeros; the lo box follows
constexpr int kStageFloats = kCin * kBD * kBH * 32;  // the next tile's raw box, [ci][bd][bh][32]
constexpr int kPackedFloats = kSteps * 32 * 8;
constexpr int kSmemFloats = 2 * kRegion + kStageFloats + kPackedFloats;
constexpr int kNT = kTH / 2 * 4;
#ifndef LAB_GROUP
#define LAB_GROUP 4
#endif
constexpr int kGroup = LAB_GROUP;  // n-tiles per warp: 8 rows in H x 4 groups of 8 in W
constexpr int kTilesD = kOD / kTD, kTilesH = (kOH + kTH - 1) / kTH, kTilesPerSample = kTilesD * kTilesH;

__device__ __forceinline__ void mma(float (&d)[4], const float (&a)[4], float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])), "r"(__float_as_uint(a[3])),
        "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

__device__ __forceinline__ float2 split(float x) {
  const float hi = __uint_as_float(__float_as_uint(x) & 0xffffe000u);
  return make_float2(hi, isfinite(x) ? x - hi : 0.f);
}

__host__ __device__ constexpr int row_offset(int r) { return r >= kRows ? 0 : (r / 9) * kPC + (r / 3 % 3) * kPD + (r % 3) * kPH; }

// packed: [step][lane][hi a0..a3, lo a0..a3]
__global__ void __launch_bounds__(128, LAB_TH == 8 ? LAB_MINB : 2) conv_max_kernel(const float* __restrict__ x, const float4* __restrict__ packed,
                                                         const float* __restrict__ bias, float* __restrict__ out, int batch) {
  extern __shared__ float4 smem4[];
  float* hi = reinterpret_cast<float*>(smem4);
  float* lo = hi + kRegion;
  float* stage = lo + kRegion;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int tiles = batch * kTilesPerSample;
  // the raw box of `tile` into the stage (cp.async, rows outside the input zero-filled)
  auto load = [&](int tile) {
    if (tile >= tiles) return;
    const int tn = tile / kTilesPerSample, tt = tile % kTilesPerSample;
    const int td0 = (tt / kTilesH) * kTD, th0 = (tt % kTilesH) * kTH;
    const float* xs = x + static_cast<long long>(tn) * kCin * kID * kIH * kIW;
    for (int e = tid; e < kCin * kBD * kBH * 8; e += 128) {
      const int piece = e % 8, row = e / 8, bh = row % kBH, bd = row / kBH % kBD, ci = row / (kBH * kBD);
      const int d = td0 + bd, h = th0 + bh;
      const bool in = d < kID && h < kIH;
      const float* src = in ? xs + ((ci * kID + d) * kIH + h) * kIW + piece * 4 : x;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage + row * 32 + piece * 4));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  // the stage, split into the hi and lo boxes (columns 32.. stay zero)
  auto unpack = [&] {
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // the stage is complete; every warp is done with the boxes
    for (int e = tid; e < kCin * kBD * kBH * 8; e += 128) {
      const int piece = e % 8, row = e / 8, bh = row % kBH, bd = row / kBH % kBD, ci = row / (kBH * kBD);
      const float4 v = reinterpret_cast<const float4*>(stage)[e];
      const int at = ci * kPC + bd * kPD + bh * kPH + piece * 4;
      const float2 a = split(v.x), b = split(v.y), c = split(v.z), dd = split(v.w);
      *reinterpret_cast<float4*>(hi + at) = make_float4(a.x, b.x, c.x, dd.x);
      *reinterpret_cast<float4*>(lo + at) = make_float4(a.y, b.y, c.y, dd.y);
    }
    __syncthreads();
  };
  for (int e = tid; e < kRegion; e += 128) hi[e] = lo[e] = 0.f;
  float4* sw = reinterpret_cast<float4*>(stage + kStageFloats);  // the packed weights, [step][lane][2] float4
  for (int e = tid; e < kPackedFloats / 4; e += 128) sw[e] = __ldg(packed + e);
  load(blockIdx.x);
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
  unpack();
  load(tile + gridDim.x);
  const int n = tile / kTilesPerSample, tt = tile % kTilesPerSample;
  const int d0 = (tt / kTilesH) * kTD, h0 = (tt % kTilesH) * kTH;

  const int wd = warp / 2, wh = (warp % 2) * (kTH / 2);
  const int warp_base = wd * kPD + wh * kPH + g;
  int rbase[7];
#pragma unroll
  for (int q = 0; q < 7; ++q) {
    const int r = 4 * q + t;
    // the padded row reads zeros, at the bank its lane's real rows would use
    rbase[q] = r < kRows ? warp_base + row_offset(r) : kZeroBase + (warp_base - g) % 32 + g;
  }
  float acc[kNT][4];
#pragma unroll
  for (int j = 0; j < kNT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    // volatile: kept after the previous step's MMAs (else ptxas hoists every step's fragments: 88 registers)
    float ahi[4], alo[4];
    const uint32_t wa = static_cast<uint32_t>(__cvta_generic_to_shared(sw + (s * 32 + lane) * 2));
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(ahi[0]), "=f"(ahi[1]), "=f"(ahi[2]), "=f"(ahi[3]) : "r"(wa));
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(alo[0]), "=f"(alo[1]), "=f"(alo[2]), "=f"(alo[3]) : "r"(wa + 16));
    const int c0 = 2 * s, c1 = 2 * s + 1;
    const int q0 = c0 / 3, kw0 = c0 % 3, q1 = c1 / 3, kw1 = c1 % 3;
    const bool pad1 = c1 >= 21;
    // groups of kGroup n-tiles: their B values first, then the three products round-robin, so that an
    // MMA's accumulator was last written kGroup MMAs earlier (HMMA's latency)
#pragma unroll
    for (int j0 = 0; j0 < kNT; j0 += kGroup) {
      float bh0[kGroup], bh1[kGroup], bl0[kGroup], bl1[kGroup];
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) {
        const int j = j0 + jj, off = (j / 4) * kPH + (j % 4) * 8;
        const int at0 = rbase[q0] + off + kw0, at1 = rbase[q1 < 7 ? q1 : 6] + off + kw1;
        bh0[jj] = hi[at0]; bh1[jj] = pad1 ? 0.f : hi[at1];
        bl0[jj] = lo[at0]; bl1[jj] = pad1 ? 0.f : lo[at1];
      }
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) mma(acc[j0 + jj], alo, bh0[jj], bh1[jj]);
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) mma(acc[j0 + jj], ahi, bl0[jj], bl1[jj]);
#pragma unroll
      for (int jj = 0; jj < kGroup; ++jj) mma(acc[j0 + jj], ahi, bh0[jj], bh1[jj]);
    }
  }
  // epilogue: bias, max over the 16 channels (rows g and g + 8 of the thread, then across g)
  const float bg = __ldg(bias + g), bg8 = __ldg(bias + g + 8);
  const int d = d0 + wd;
  float* os = out + static_cast<long long>(n) * kOD * kOH * kOW;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    float v0 = fmaxf(acc[j][0] + bg, acc[j][2] + bg8), v1 = fmaxf(acc[j][1] + bg, acc[j][3] + bg8);
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
      v0 = fmaxf(v0, __shfl_xor_sync(0xffffffffu, v0, o));
      v1 = fmaxf(v1, __shfl_xor_sync(0xffffffffu, v1, o));
    }
    const int h = h0 + wh + j / 4, w = (j % 4) * 8 + 2 * t;
    if (g == 0 && h < kOH && w < kOW) {
      os[(d * kOH + h) * kOW + w] = v0;
      if (w + 1 < kOW) os[(d * kOH + h) * kOW + w + 1] = v1;
    }
  }
  }
}
}  // namespace lab


extern "C" int lab_run(const float* x, const float* packed, const float* bias, float* out, int batch, void* stream) {
  static bool init = false;
  if (!init) {
    cudaFuncSetAttribute(lab::conv_max_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lab::kSmemFloats * 4);
    init = true;
  }
  static int grid = 0;
  if (!grid) {
    int per_sm = 0, sms = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, lab::conv_max_kernel, 128, lab::kSmemFloats * 4);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    grid = per_sm * sms;
  }
  const int tiles = batch * lab::kTilesPerSample;
  lab::conv_max_kernel<<<tiles < grid ? tiles : grid, 128, lab::kSmemFloats * 4, static_cast<cudaStream_t>(stream)>>>(
      x, reinterpret_cast<const float4*>(packed), bias, out, batch);
  return static_cast<int>(cudaGetLastError());
}
