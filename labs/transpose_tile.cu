// Lab: the channels_last -> NCHW tile of KernelBench #5's stage (tanh of [32, 64, 513, 513], 4.3 GB moved) in
// tile shapes and store orders, each timed best of 10 (`nvcc -O3 -arch=sm_90a transpose_tile.cu && ./a.out [variant]`);
// results in docs/performance.md (H200, 2026-12-04).
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
constexpr long long P = 513LL * 513, C = 64, N = 32;

double checksum(const float* out) {
  static float* h = (float*)malloc(N * P * C * 4);
  cudaMemcpy(h, out, N * P * C * 4, cudaMemcpyDeviceToHost);
  double s = 0; for (long long i = 0; i < N * P * C; ++i) s += h[i] * (double)((i % 7) + 1);
  return s;
}
template <int TC, int TP, int THREADS, int PAD>
__global__ void __launch_bounds__(THREADS) tk(const float* __restrict__ in, const float* __restrict__ b1, const float* __restrict__ b2, float* __restrict__ out) {
  constexpr long long PT = (P + TP - 1) / TP;
  __shared__ float tile[TC][TP + PAD];
  const long long n = blockIdx.x / PT;
  const long long p0 = (blockIdx.x % PT) * TP;
  const int c0 = blockIdx.y * TC;
  constexpr int PV = TC / 4, ROWS = THREADS / PV, LOADS = TP / ROWS;
  const int tc = threadIdx.x % PV * 4, tp0 = threadIdx.x / PV;
  float4 v[LOADS];
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    long long p = p0 + tp0 + i * ROWS; p = p < P ? p : P - 1;
    v[i] = *reinterpret_cast<const float4*>(in + n * P * C + p * C + c0 + tc);
  }
  float bb[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bb[j] = b1[c0 + tc + j];
  float bs[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bs[j] = b2[c0 + tc + j];
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    const int tp = tp0 + i * ROWS;
    if (p0 + tp < P) {
      tile[tc + 0][tp] = tanhf(v[i].x + bb[0] - bs[0]);
      tile[tc + 1][tp] = tanhf(v[i].y + bb[1] - bs[1]);
      tile[tc + 2][tp] = tanhf(v[i].z + bb[2] - bs[2]);
      tile[tc + 3][tp] = tanhf(v[i].w + bb[3] - bs[3]);
    }
  }
  __syncthreads();
  constexpr int STORES = TC * TP / THREADS;
#pragma unroll
  for (int i = 0; i < STORES; ++i) {
    const int t = threadIdx.x + i * THREADS;
    const int c = t / TP, tp = t % TP;
    if (p0 + tp < P) out[n * P * C + (c0 + c) * P + p0 + tp] = tile[c][tp];
  }
}
template <int TC, int TP, int THREADS, int PAD>
float run(const float* in, const float* b1, const float* b2, float* out, const char* name) {
  constexpr long long PT = (P + TP - 1) / TP;
  dim3 grid(N * PT, C / TC);
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
  for (int w = 0; w < 3; ++w) tk<TC, TP, THREADS, PAD><<<grid, THREADS>>>(in, b1, b2, out);
  float best = 1e9;
  for (int r = 0; r < 10; ++r) {
    cudaEventRecord(s);
    tk<TC, TP, THREADS, PAD><<<grid, THREADS>>>(in, b1, b2, out);
    cudaEventRecord(e); cudaEventSynchronize(e);
    float ms; cudaEventElapsedTime(&ms, s, e); if (ms < best) best = ms;
  }
  cudaFuncAttributes at; cudaFuncGetAttributes(&at, tk<TC, TP, THREADS, PAD>);
  printf("%-28s %.3f ms  %.2f TB/s  regs %d\n", name, best, 2.0 * N * P * C * 4 / best / 1e9, at.numRegs);
  return best;
}

template <int TC, int TP, int THREADS, int PAD, int HINT = 0>
__global__ void __launch_bounds__(THREADS) tk2(const float* __restrict__ in, const float* __restrict__ b1, const float* __restrict__ b2, float* __restrict__ out) {
  constexpr int PT = (P + TP - 1) / TP;
  __shared__ float tile[TC][TP + PAD];
  const int n = blockIdx.x / PT;
  const int p0 = (blockIdx.x % PT) * TP;
  const int c0 = blockIdx.y * TC;
  constexpr int PV = TC / 4, ROWS = THREADS / PV, LOADS = TP / ROWS;
  const int tc = threadIdx.x % PV * 4, tp0 = threadIdx.x / PV;
  const bool whole = p0 + TP <= P;
  const float* in_n = in + (long long)n * P * C + c0 + tc;
  float4 v[LOADS];
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    int p = p0 + tp0 + i * ROWS; p = whole || p < P ? p : P - 1;
    if (HINT & 1) v[i] = __ldcs(reinterpret_cast<const float4*>(in_n + p * C));
    else if (HINT & 4) v[i] = __ldlu(reinterpret_cast<const float4*>(in_n + p * C));
    else v[i] = *reinterpret_cast<const float4*>(in_n + p * C);
  }
  float bb[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bb[j] = b1[c0 + tc + j];
  float bs[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bs[j] = b2[c0 + tc + j];
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    const int tp = tp0 + i * ROWS;
    tile[tc + 0][tp] = tanhf(v[i].x + bb[0] - bs[0]);
    tile[tc + 1][tp] = tanhf(v[i].y + bb[1] - bs[1]);
    tile[tc + 2][tp] = tanhf(v[i].z + bb[2] - bs[2]);
    tile[tc + 3][tp] = tanhf(v[i].w + bb[3] - bs[3]);
  }
  __syncthreads();
  constexpr int STORES = TC * TP / THREADS;
  float* out_t = out + (long long)n * P * C + (long long)c0 * P + p0;
  if (whole) {
#pragma unroll
    for (int i = 0; i < STORES; ++i) {
      const int t = threadIdx.x + i * THREADS;
      const int c = t / TP, tp = t % TP;
      if (HINT & 2) __stcs(out_t + c * (int)P + tp, tile[c][tp]); else out_t[c * (int)P + tp] = tile[c][tp];
    }
  } else {
#pragma unroll
    for (int i = 0; i < STORES; ++i) {
      const int t = threadIdx.x + i * THREADS;
      const int c = t / TP, tp = t % TP;
      if (p0 + tp < P) out_t[c * (int)P + tp] = tile[c][tp];
    }
  }
}
template <int TC, int TP, int THREADS, int PAD, int HINT = 0>
float run2(const float* in, const float* b1, const float* b2, float* out, const char* name) {
  constexpr long long PT = (P + TP - 1) / TP;
  dim3 grid(N * PT, C / TC);
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
  for (int w = 0; w < 3; ++w) tk2<TC, TP, THREADS, PAD, HINT><<<grid, THREADS>>>(in, b1, b2, out);
  float best = 1e9;
  for (int r = 0; r < 10; ++r) {
    cudaEventRecord(s);
    tk2<TC, TP, THREADS, PAD, HINT><<<grid, THREADS>>>(in, b1, b2, out);
    cudaEventRecord(e); cudaEventSynchronize(e);
    float ms; cudaEventElapsedTime(&ms, s, e); if (ms < best) best = ms;
  }
  cudaFuncAttributes at; cudaFuncGetAttributes(&at, tk2<TC, TP, THREADS, PAD, HINT>);
  printf("%-28s %.3f ms  %.2f TB/s  regs %d  checksum %.6e\n", name, best, 2.0 * N * P * C * 4 / best / 1e9, at.numRegs, checksum(out));
  return best;
}

// E1 (SPLIT=0): all LDS into registers, then all STG.  E3 (TILES=2): a block runs TILES position tiles,
// the next tile's loads issued before this tile's stores.
template <int TC, int TP, int THREADS, int TILES>
__global__ void __launch_bounds__(THREADS) tk3(const float* __restrict__ in, const float* __restrict__ b1, const float* __restrict__ b2, float* __restrict__ out) {
  constexpr int PT = (P + TP - 1) / TP;
  constexpr int BT = (PT + TILES - 1) / TILES;  // blocks per sample
  __shared__ float tile[TC][TP + 1];
  const int n = blockIdx.x / BT;
  const int c0 = blockIdx.y * TC;
  constexpr int PV = TC / 4, ROWS = THREADS / PV, LOADS = TP / ROWS;
  const int tc = threadIdx.x % PV * 4, tp0 = threadIdx.x / PV;
  const float* in_n = in + (long long)n * P * C + c0 + tc;
  float bb[4], bs[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) { bb[j] = b1[c0 + tc + j]; bs[j] = b2[c0 + tc + j]; }
  float4 v[LOADS];
  int p0 = (blockIdx.x % BT) * TILES * TP;
  auto load = [&](int q0) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      int p = q0 + tp0 + i * ROWS; p = p < P ? p : P - 1;
      v[i] = *reinterpret_cast<const float4*>(in_n + p * C);
    }
  };
  load(p0);
  for (int t = 0; t < TILES && p0 < P; ++t, p0 += TP) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int tp = tp0 + i * ROWS;
      tile[tc + 0][tp] = tanhf(v[i].x + bb[0] - bs[0]);
      tile[tc + 1][tp] = tanhf(v[i].y + bb[1] - bs[1]);
      tile[tc + 2][tp] = tanhf(v[i].z + bb[2] - bs[2]);
      tile[tc + 3][tp] = tanhf(v[i].w + bb[3] - bs[3]);
    }
    __syncthreads();
    if (t + 1 < TILES && p0 + TP < P) load(p0 + TP);
    constexpr int STORES = TC * TP / THREADS;
    float w[STORES];
#pragma unroll
    for (int i = 0; i < STORES; ++i) {
      const int s = threadIdx.x + i * THREADS;
      w[i] = tile[s / TP][s % TP];
    }
    __syncthreads();
    float* out_t = out + (long long)n * P * C + (long long)c0 * P + p0;
    const bool whole = p0 + TP <= P;
#pragma unroll
    for (int i = 0; i < STORES; ++i) {
      const int s = threadIdx.x + i * THREADS;
      const int c = s / TP, tp = s % TP;
      if (whole || p0 + tp < P) out_t[c * (int)P + tp] = w[i];
    }
  }
}
template <int TC, int TP, int THREADS, int TILES>
float run3(const float* in, const float* b1, const float* b2, float* out, const char* name) {
  constexpr long long PT = (P + TP - 1) / TP, BT = (PT + TILES - 1) / TILES;
  dim3 grid(N * BT, C / TC);
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
  for (int w = 0; w < 3; ++w) tk3<TC, TP, THREADS, TILES><<<grid, THREADS>>>(in, b1, b2, out);
  float best = 1e9;
  for (int r = 0; r < 10; ++r) {
    cudaEventRecord(s);
    tk3<TC, TP, THREADS, TILES><<<grid, THREADS>>>(in, b1, b2, out);
    cudaEventRecord(e); cudaEventSynchronize(e);
    float ms; cudaEventElapsedTime(&ms, s, e); if (ms < best) best = ms;
  }
  cudaFuncAttributes at; cudaFuncGetAttributes(&at, tk3<TC, TP, THREADS, TILES>);
  printf("%-28s %.3f ms  %.2f TB/s  regs %d  checksum %.6e\n", name, best, 2.0 * N * P * C * 4 / best / 1e9, at.numRegs, checksum(out));
  return best;
}
int main(int argc, char** argv) {
  const int only = argc > 1 ? atoi(argv[1]) : -1; int k = 0;
  float *in, *out, *b1, *b2;
  cudaMalloc(&in, N * P * C * 4); cudaMalloc(&out, N * P * C * 4); cudaMalloc(&b1, C * 4); cudaMalloc(&b2, C * 4);
  { float* h = (float*)malloc(N * P * C * 4); for (long long i = 0; i < N * P * C; ++i) h[i] = (float)((i * 2654435761LL) % 2001) / 500.f - 2.f; cudaMemcpy(in, h, N * P * C * 4, cudaMemcpyHostToDevice); free(h); } cudaMemset(b1, 0, C * 4); cudaMemset(b2, 0, C * 4);
  for (int rep = 0; rep < (only < 0 ? 2 : 1); ++rep) { k = 0;
  if (only < 0 || only == k) run<64, 64, 256, 1>(in, b1, b2, out, "64c x 64p t256 pad1"); ++k;
  if (only < 0 || only == k) run<64, 128, 256, 1>(in, b1, b2, out, "64c x 128p t256 pad1"); ++k;
  if (only < 0 || only == k) run<32, 128, 256, 1>(in, b1, b2, out, "32c x 128p t256 pad1"); ++k;
  if (only < 0 || only == k) run<32, 128, 256, 2>(in, b1, b2, out, "32c x 128p t256 pad2"); ++k;
  if (only < 0 || only == k) run<16, 256, 256, 1>(in, b1, b2, out, "16c x 256p t256 pad1"); ++k;
  if (only < 0 || only == k) run<16, 256, 256, 2>(in, b1, b2, out, "16c x 256p t256 pad2"); ++k;
  if (only < 0 || only == k) run<16, 512, 256, 2>(in, b1, b2, out, "16c x 512p t256 pad2"); ++k;
  if (only < 0 || only == k) run<32, 256, 256, 2>(in, b1, b2, out, "32c x 256p t256 pad2"); ++k;
  if (only < 0 || only == k) run<16, 256, 128, 2>(in, b1, b2, out, "16c x 256p t128 pad2"); ++k;
  if (only < 0 || only == k) run<8, 512, 256, 2>(in, b1, b2, out, "8c x 512p t256 pad2"); ++k;
  if (only < 0 || only == k) run2<32, 128, 256, 1>(in, b1, b2, out, "v2 32c x 128p t256 pad1"); ++k;
  if (only < 0 || only == k) run2<64, 64, 256, 1>(in, b1, b2, out, "v2 64c x 64p t256 pad1"); ++k;
  if (only < 0 || only == k) run2<32, 64, 256, 1>(in, b1, b2, out, "v2 32c x 64p t256 pad1"); ++k;
  if (only < 0 || only == k) run2<32, 128, 128, 1>(in, b1, b2, out, "v2 32c x 128p t128 pad1"); ++k;
  if (only < 0 || only == k) run2<16, 256, 256, 2>(in, b1, b2, out, "v2 16c x 256p t256 pad2"); ++k;
  if (only < 0 || only == k) run2<32, 128, 256, 1, 1>(in, b1, b2, out, "v2 32x128 ldcs"); ++k;
  if (only < 0 || only == k) run2<32, 128, 256, 1, 2>(in, b1, b2, out, "v2 32x128 stcs"); ++k;
  if (only < 0 || only == k) run2<32, 128, 256, 1, 3>(in, b1, b2, out, "v2 32x128 ldcs stcs"); ++k;
  if (only < 0 || only == k) run2<32, 128, 256, 1, 4>(in, b1, b2, out, "v2 32x128 ldlu"); ++k;
  if (only < 0 || only == k) run2<64, 64, 256, 1, 3>(in, b1, b2, out, "v2 64x64 ldcs stcs"); ++k;
  if (only < 0 || only == k) run2<16, 256, 256, 2, 3>(in, b1, b2, out, "v2 16x256 ldcs stcs"); ++k;
  if (only < 0 || only == k) run3<32, 128, 256, 1>(in, b1, b2, out, "v3 32x128 regs-then-stores"); ++k;
  if (only < 0 || only == k) run3<32, 128, 256, 2>(in, b1, b2, out, "v3 32x128 2 tiles"); ++k;
  if (only < 0 || only == k) run3<32, 128, 256, 4>(in, b1, b2, out, "v3 32x128 4 tiles"); ++k;
  if (only < 0 || only == k) run3<64, 64, 256, 1>(in, b1, b2, out, "v3 64x64 regs-then-stores"); ++k;
  if (only < 0 || only == k) run3<64, 64, 256, 2>(in, b1, b2, out, "v3 64x64 2 tiles"); ++k;
  if (only < 0 || only == k) run3<16, 256, 256, 1>(in, b1, b2, out, "v3 16x256 regs-then-stores"); ++k;
  if (only < 0 || only == k) run3<16, 256, 256, 2>(in, b1, b2, out, "v3 16x256 2 tiles"); ++k;
  }
  cudaError_t err = cudaDeviceSynchronize(); printf("%s\n", cudaGetErrorString(err));
}
