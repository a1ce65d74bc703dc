// instnorm_clamp_max's convolution with both wgmma operands in shared memory (notes/next_conv_gemm.md
// 0l): the input box is stored as [position][4 channels] (3 input channels padded to 4, 16 bytes per
// position), so the A operand of two taps is one descriptor: the core matrices along M are 8
// consecutive positions (SBO = 128 bytes), and the second core matrix along K is the second tap, LBO
// = the byte offset between the two taps (16 for kw, kw + 1; a row of 32 positions minus two, 480, for
// (kh, 2), (kh + 1, 0)): core matrices that overlap in memory. This lab
//   1. checks that reading (LBO below the core matrix's 128 bytes included) against a host product,
//      with integer values (exact in TF32);
//   2. measures how many clocks an SM takes per m64nNk8 wgmma with both operands from shared memory,
//      N = 16, 32, 48, 64 (dense TF32: N / 2 clocks), with the A start moving over the box each step
//      as the taps do.
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_ss_rate \
//     scripts/inst_mma_lab/wgmma_ss_rate.cu && /tmp/wgmma_ss_rate
// Projection for instnorm (0l): a tile (one 30 x 30 output plane) is 15 m-blocks x 14 k steps of
// A_hi x [B_hi | B_lo] (N = 32) + A_lo x B_hi (N = 16); the tile's tensor time is 210 x (c32 + c16) clocks.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "../../templates/conv_gemm/wgmma.cuh"

using kgen::conv_gemm::Wgmma;

constexpr int kBoxPositions = 4 * 32 + 64;  // 4 rows of 32 positions, and a margin past the last tap
constexpr int kBoxFloats = kBoxPositions * 4;

__device__ __forceinline__ uint64_t desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int K>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(K) : "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// B (N x 8, K-major) as the conv_gemm wgmma loop keeps its weights: [n-tile of 8][k quad][8 columns][4 k]:
// quads 128 bytes apart (LBO), n-tiles 256 (SBO).
__device__ __forceinline__ int b_index(int n, int k) { return (n / 8) * 64 + (k / 4) * 32 + (n % 8) * 4 + k % 4; }

// 1. One warpgroup, one m64n16k8: A = positions first, first + 1, ... (64 rows) x the 4 channels of tap
// offset `tap_a` and of `tap_b` (positions); B = w. out[64][16].
__global__ void check_kernel(const float* box_in, const float* w, int first, int tap_a, int tap_b, float* out) {
  __shared__ __align__(128) float box[kBoxFloats];
  __shared__ __align__(128) float b[16 * 8];
  for (int i = threadIdx.x; i < kBoxFloats; i += blockDim.x) box[i] = box_in[i];
  for (int i = threadIdx.x; i < 16 * 8; i += blockDim.x) b[b_index(i / 8, i % 8)] = w[i];
  fence_async_shared();
  __syncthreads();
  float d[2][4] = {};
  fence();
  Wgmma<16>::mma(d, desc(box + (first + tap_a) * 4, (tap_b - tap_a) * 16, 128), desc(b, 128, 256));
  commit();
  wait<0>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * warp + g + (i >= 2 ? 8 : 0), col = 8 * j + 2 * t + (i % 2);
      out[row * 16 + col] = d[j][i];
    }
}

bool check(int first, int tap_a, int tap_b) {
  static float box[kBoxFloats], w[16 * 8], got[64 * 16];
  for (int p = 0; p < kBoxPositions; ++p)
    for (int c = 0; c < 4; ++c) box[p * 4 + c] = static_cast<float>((p * 7 + c * 3) % 11 - 5);
  for (int n = 0; n < 16; ++n)
    for (int k = 0; k < 8; ++k) w[n * 8 + k] = static_cast<float>((n * 5 + k) % 7 - 3);
  float *d_box, *d_w, *d_out;
  cudaMalloc(&d_box, sizeof box);
  cudaMalloc(&d_w, sizeof w);
  cudaMalloc(&d_out, sizeof got);
  cudaMemcpy(d_box, box, sizeof box, cudaMemcpyHostToDevice);
  cudaMemcpy(d_w, w, sizeof w, cudaMemcpyHostToDevice);
  check_kernel<<<1, 128>>>(d_box, d_w, first, tap_a, tap_b, d_out);
  const cudaError_t err = cudaMemcpy(got, d_out, sizeof got, cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 16; ++n) {
      float want = 0.f;
      for (int k = 0; k < 8; ++k) {
        const int p = first + m + (k < 4 ? tap_a : tap_b);
        want += box[p * 4 + k % 4] * w[n * 8 + k];
      }
      bad += got[m * 16 + n] != want;
    }
  printf("check: first %d, taps %d and %d (LBO %d bytes): %s (%d of 1024 wrong)%s%s\n", first, tap_a, tap_b,
         (tap_b - tap_a) * 16, bad ? "WRONG" : "exact", bad, err ? "  " : "", err ? cudaGetErrorString(err) : "");
  cudaFree(d_box);
  cudaFree(d_w);
  cudaFree(d_out);
  return bad == 0 && err == cudaSuccess;
}

// 2. Rate: each warpgroup runs T m-blocks (independent accumulators) per step, one m64nNk8 each, A from the
// box at a start that moves with the step (as a tap does), B from the weights; kInFlight steps' groups
// stay in flight.
template <int N, int T, int kInFlight>
__global__ void __launch_bounds__(256) rate_kernel(float* out, int steps) {
  __shared__ __align__(128) float box[kBoxFloats];
  __shared__ __align__(128) float b[2 * 64 * 8];  // up to N = 64, two sets (hi, lo)
  for (int i = threadIdx.x; i < kBoxFloats; i += blockDim.x) box[i] = 1.0f + 1e-3f * (i % 97);
  for (int i = threadIdx.x; i < 2 * 64 * 8; i += blockDim.x) b[i] = 0.5f;
  fence_async_shared();
  __syncthreads();
  float d[T][N / 8][4] = {};
  const uint64_t a0 = desc(box, 16, 128), b0 = desc(b, 128, 256);
  for (int s = 0; s < steps; ++s) {
    fence();
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int start = (s * 5 + t * 37) % 60;  // positions; 16-byte units of the descriptor's address
      const uint64_t lbo = static_cast<uint64_t>(1 + (s & 1) * 29) << 16;  // taps 1 or 30 positions apart
      Wgmma<N>::mma(d[t], (a0 & ~(0x3fffull << 16)) + static_cast<uint64_t>(start) + lbo, b0 + ((s & 1) ? 32 : 0));
    }
    commit();
    wait<kInFlight - 1>();
  }
  wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) sum += d[t][j][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

template <int N, int T, int kInFlight = 2>
void rate(int wgs, int ctas_per_sm, float* out) {
  int sms = 0, clk = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);  // kHz
  const int steps = 4096;
  auto kernel = rate_kernel<N, T, kInFlight>;
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
  const double wgmma_per_sm = double(wgs) * ctas_per_sm * steps * T;
  const double clocks = ms * 1e-3 * clk * 1e3;
  printf("ss m64n%dk8, %d m-blocks per wg, %d in flight, %d wg x %d CTA/SM: %7.3f ms  %6.2f clk per wgmma/SM "
         "(dense %d)%s%s\n", N, T, kInFlight, wgs, ctas_per_sm, ms, clocks / wgmma_per_sm, N / 2, err ? "  ERROR " : "",
         err ? cudaGetErrorString(err) : "");
}

int main() {
  bool ok = check(0, 0, 1);           // kw, kw + 1: LBO 16 bytes (the core matrices overlap)
  ok = check(5, 2, 32) && ok;         // (kh, 2), (kh + 1, 0) in rows of 32: LBO 480
  ok = check(3, 1, 65) && ok;         // two rows apart: LBO 1024
  ok = check(0, 0, 8) && ok;          // LBO 128: adjacent core matrices
  if (!ok) printf("the tap-pair descriptor does not read what 0l assumes\n");
  float* out;
  cudaMalloc(&out, 132 * 4 * 256 * sizeof(float));
  int clk = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  printf("max clock %d MHz; dense TF32: N / 2 clocks per m64nNk8 per SM\n", clk / 1000);
  rate<16, 4>(1, 1, out);
  rate<16, 4>(2, 1, out);
  rate<16, 4>(1, 2, out);
  rate<16, 8>(2, 1, out);
  rate<16, 4, 3>(2, 2, out);
  rate<32, 4>(1, 1, out);
  rate<32, 4>(2, 1, out);
  rate<32, 4>(1, 2, out);
  rate<32, 4, 3>(2, 2, out);
  rate<48, 2>(2, 1, out);
  rate<48, 4>(2, 1, out);
  rate<64, 2>(2, 1, out);
  rate<64, 4>(2, 1, out);
  return ok ? 0 : 1;
}
