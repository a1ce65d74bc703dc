// kgen_launch.cuh: launch setup shared by the generated kernels' launchers (conv_gemm, linear_gemm), kept
// per device: a kernel's shared-memory attribute is set per device, and CTAs per SM and SMs are the
// device's (a process may run a module on several GPUs; kept once per process, a module failed to
// launch on a second GPU: docs/performance.md, 2026-11-24).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace kgen {

constexpr int kMaxDevices = 64;

// The current device, an index into the per-device caches.
inline cudaError_t current_device(int* device) {
  const cudaError_t err = cudaGetDevice(device);
  return err == cudaSuccess && (*device < 0 || *device >= kMaxDevices) ? cudaErrorInvalidDevice : err;
}

// A kernel's launch setup on one device: its CTAs per SM (at its threads and shared memory) and
// the device's SMs.
struct KernelSetup {
  int per_sm = 0, sms = 0;
  int resident() const { return per_sm * sms; }
};

// Sets up `Kernel` on the current device, the first time per device: its dynamic shared memory
// (`smem` bytes) and the occupancy at `threads` threads; later calls return what was kept. One
// cache per kernel (the template argument); racing first calls store the same value.
template <auto Kernel>
cudaError_t kernel_setup(int threads, int smem, KernelSetup* setup) {
  static std::atomic<long long> kept[kMaxDevices] = {};  // per_sm << 32 | sms; 0: not set up
  int device = 0;
  cudaError_t err = current_device(&device);
  if (err != cudaSuccess) return err;
  long long v = kept[device].load(std::memory_order_relaxed);
  if (v == 0) {
    int per_sm = 0, sms = 0;
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, smem);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    if (per_sm < 1 || sms < 1) return cudaErrorInvalidConfiguration;  // the kernel does not fit on an SM
    v = static_cast<long long>(per_sm) << 32 | sms;
    kept[device].store(v, std::memory_order_relaxed);
  }
  setup->per_sm = static_cast<int>(v >> 32);
  setup->sms = static_cast<int>(v & 0xffffffff);
  return cudaSuccess;
}

}  // namespace kgen
