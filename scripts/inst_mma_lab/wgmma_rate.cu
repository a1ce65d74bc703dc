// How fast an H100 SM retires TF32 wgmma m64nNk8 with A from registers (B from shared memory
// through a descriptor), at the N = 16 of instnorm_clamp_max's 16 output channels, and what is left
// of that rate once every k step also loads its A values from shared memory and splits them into
// TF32 hi and lo parts (split TF32: a_hi b_hi + a_lo b_hi + a_hi b_lo, three wgmma per k step).
// notes/next_conv_gemm.md 0h, step 1. Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_rate scripts/inst_mma_lab/wgmma_rate.cu && /tmp/wgmma_rate
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  // no swizzle; leading / stride byte offsets of a K-major tf32 core-matrix layout (128 / 256 bytes)
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return (static_cast<uint64_t>((addr & 0x3FFFF) >> 4)) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}

template <int N>
struct Rs;

template <>
struct Rs<16> {  // d (8 floats) += a (registers) x b (descriptor)
  __device__ static void mma(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

template <>
struct Rs<32> {
  __device__ static void mma(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
  }
};

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int K>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(K) : "memory"); }

__device__ __forceinline__ uint32_t tf32_hi(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// T m-tiles per warpgroup (independent accumulators); each k step runs kMmas wgmma per m-tile
// (1: plain TF32, 3: split TF32). kLoad: the step's A values come from shared memory (4 per
// m-tile per thread, at a thread- and step-dependent offset as an im2col gather would) and are
// split there; else fixed registers. A registers live in kSets sets (steps s ... s + kSets - 1), so
// a step's loads overlap the wgmma of the kSets - 1 steps before it (wait<kSets - 1>).
template <int N, int T, int kMmas, bool kLoad, int kSets = 2>
__global__ void __launch_bounds__(256) rate(float* out, int steps) {
  __shared__ __align__(128) float box[8192];
  __shared__ __align__(128) float b[2][8 * N];
  for (int i = threadIdx.x; i < 8192; i += blockDim.x) box[i] = 1.0f + 1e-3f * (i % 97);
  for (int i = threadIdx.x; i < 16 * N; i += blockDim.x) (&b[0][0])[i] = 0.5f;
  __syncthreads();
  const int tid = threadIdx.x % 128;
  const uint64_t bd_hi = smem_desc(b[0]), bd_lo = smem_desc(b[1]);
  constexpr int kAcc = N / 2;
  float acc[T][kAcc] = {};
  uint32_t hi[kSets][T][4], lo[kSets][T][4];
  auto load = [&](int set, int s) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (kLoad) {
          const float v = box[(tid * 5 + t * 640 + i * 129 + (s & 63) * 37) & 8191];
          hi[set][t][i] = tf32_hi(v);
          lo[set][t][i] = __float_as_uint(v - __uint_as_float(hi[set][t][i]));
        } else {
          hi[set][t][i] = tid + i + t;
          lo[set][t][i] = tid * 3 + i;
        }
      }
  };
  auto step = [&](int set, int s) {  // called with a literal set: the register sets stay registers
    fence();
#pragma unroll
    for (int t = 0; t < T; ++t) {
      Rs<N>::mma(acc[t], hi[set][t], bd_hi);
      if constexpr (kMmas == 3) {
        Rs<N>::mma(acc[t], lo[set][t], bd_hi);
        Rs<N>::mma(acc[t], hi[set][t], bd_lo);
      }
    }
    commit();
    wait<kSets - 1>();  // step s - kSets + 1 is done: its A set is free for step s + 1
    load((set + kSets - 1) % kSets, s + kSets - 1);
  };
  for (int k = 0; k < kSets - 1; ++k) load(k, k);
  for (int s = 0; s < steps; s += kSets) {  // steps a multiple of kSets
#pragma unroll
    for (int k = 0; k < kSets; ++k) step(k, s + k);
  }
  wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) sum += acc[t][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

template <int N, int T, int kMmas, bool kLoad, int kSets = 2>
void run(const char* what, int wgs, int ctas_per_sm, float* out) {
  int sms = 0, clk = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);  // kHz
  const int steps = 2048 / kSets * kSets;
  auto kernel = rate<N, T, kMmas, kLoad, kSets>;
  kernel<<<sms * ctas_per_sm, 128 * wgs>>>(out, 16);
  cudaEvent_t s, e;
  cudaEventCreate(&s);
  cudaEventCreate(&e);
  cudaEventRecord(s);
  kernel<<<sms * ctas_per_sm, 128 * wgs>>>(out, steps);
  cudaEventRecord(e);
  cudaEventSynchronize(e);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, s, e);
  const cudaError_t err = cudaGetLastError();
  const double wgmma_per_sm = double(wgs) * ctas_per_sm * steps * T * kMmas;
  const double clocks = ms * 1e-3 * clk * 1e3;
  const double flops = wgmma_per_sm * sms * 2.0 * 64 * N * 8;
  printf("%-44s N=%-3d sets %d, tiles/wg %d, %d wg x %d CTA/SM: %7.3f ms  %6.2f clk per wgmma/SM  %6.1f TFLOP/s%s%s\n", what, N, kSets, T,
         wgs, ctas_per_sm, ms, clocks / wgmma_per_sm, flops / (ms * 1e-3) / 1e12, err ? "  ERROR " : "",
         err ? cudaGetErrorString(err) : "");
}

int main() {
  float* out;
  cudaMalloc(&out, 132 * 4 * 256 * sizeof(float) * 4);
  int clk = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  printf("max clock %d MHz; dense TF32 peak 8 clk per m64n16k8 wgmma per SM (1024 MAC/clk)\n", clk / 1000);
  run<16, 4, 1, false>("rs, registers only, plain", 1, 1, out);
  run<16, 4, 1, false>("rs, registers only, plain", 2, 1, out);
  run<16, 8, 1, false>("rs, registers only, plain", 2, 1, out);
  run<16, 4, 1, false>("rs, registers only, plain", 2, 2, out);
  run<16, 8, 3, false>("rs, registers only, split (3 per step)", 2, 1, out);
  run<16, 4, 3, false>("rs, registers only, split (3 per step)", 2, 2, out);
  run<32, 4, 3, false>("rs, registers only, split (3 per step)", 2, 1, out);
  run<16, 4, 3, true>("rs, A loaded and split each step", 2, 1, out);
  run<16, 8, 3, true>("rs, A loaded and split each step", 2, 1, out);
  run<16, 4, 3, true>("rs, A loaded and split each step", 2, 2, out);
  run<16, 8, 3, true>("rs, A loaded and split each step", 1, 2, out);
  run<32, 4, 3, true>("rs, A loaded and split each step", 2, 1, out);
  run<16, 4, 3, true, 3>("rs, A loaded and split each step", 2, 1, out);
  run<16, 4, 3, true, 4>("rs, A loaded and split each step", 2, 1, out);
  run<16, 2, 3, true, 4>("rs, A loaded and split each step", 2, 2, out);
  run<32, 4, 3, true, 3>("rs, A loaded and split each step", 2, 1, out);
  run<32, 2, 3, true, 4>("rs, A loaded and split each step", 2, 2, out);
  return 0;
}
