// Does mma.sync (m16n8k8, .tf32) read an fp32 operand's 13 low bits? For the GPU machine:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/lowbits scripts/tf32_lab/mma_low_bits.cu && /tmp/lowbits
// Each block runs one MMA whose A fragment is four copies of a bit pattern and B is 1.0: the result is
// 8 x the value the tensor core saw. H100 (stop 23, notes/perf.md): the low 13 bits are ignored
// (1 + 2^-12 gives 8, 0x7F801000 gives inf, 0x80000FFF gives 0), so "add half a TF32 unit" leaves
// the same operand as cvt.rna.
#include <cstdio>
#include <cstdint>
#include <cstring>
__global__ void k(const uint32_t* abits, float* out, int n) {
  int i = blockIdx.x;
  uint32_t a = abits[i];
  uint32_t b = 0x3F800000u;  // 1.0
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a), "r"(a), "r"(a), "r"(a), "r"(b), "r"(b));
  if (threadIdx.x == 0) out[i] = d0;
}
int main() {
  uint32_t h[] = {0x3F800800u, 0x3F800C00u, 0x3F801FFFu, 0x3F802000u, 0xBF800C00u, 0x7F800000u, 0x7F801000u, 0x7FC00000u, 0x7FFFFFFFu, 0x80000FFFu, 0x7F7FF000u};
  int n = sizeof(h) / 4;
  uint32_t* d; float* o; cudaMalloc(&d, sizeof(h)); cudaMalloc(&o, n * 4);
  cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice);
  k<<<n, 32>>>(d, o, n);
  float r[16]; cudaMemcpy(r, o, n * 4, cudaMemcpyDeviceToHost);
  for (int i = 0; i < n; ++i) { float a; memcpy(&a, &h[i], 4); uint32_t rb; memcpy(&rb, &r[i], 4);
    printf("a=0x%08x (%.9g): sum of 8 products = %.9g (0x%08x); 8*a = %.9g\n", h[i], a, r[i], rb, 8.0f * a); }
  return 0;
}
