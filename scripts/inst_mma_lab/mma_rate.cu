// How many TF32 mma.sync m16n8k8 an H100 SM retires per clock: 8 warps per SM, 8 independent
// accumulator chains per warp, no memory traffic.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__global__ void k(float* out, int iters) {
  float acc[8][4] = {};
  uint32_t a[4] = {threadIdx.x, 1u, 2u, 3u}, b0 = threadIdx.x * 3u, b1 = 7u;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  float s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  float* out; cudaMalloc(&out, sms * 1024 * 4 * 4);
  for (int warps : {4, 8, 16}) {
    const int iters = 4096;
    k<<<sms, 32 * warps>>>(out, 16);
    cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
    cudaEventRecord(s); k<<<sms, 32 * warps>>>(out, iters); cudaEventRecord(e); cudaEventSynchronize(e);
    float ms; cudaEventElapsedTime(&ms, s, e);
    const double mmas_per_sm = double(warps) * iters * 8;
    printf("warps/SM %d: %.3f ms, %.3f mma/clk/SM at the %d MHz max clock, %.1f TFLOP/s\n", warps, ms,
           mmas_per_sm / (ms * 1e-3 * clk * 1e3), clk / 1000, mmas_per_sm * sms * 2048 / (ms * 1e-3) / 1e12);
  }
}
