// kgen_math.h: scalar math shared by the CUDA and the C++ kernels of every
// generated module, so both backends compute the same function. Each
// elementwise op of the op table (kgen/ops.py) is one function here; also the
// grid shape of the CUDA kernels that run over samples.
// Copied verbatim into generated/ by `kgen render`; edit templates/kgen_math.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __CUDACC__
#define KGEN_HD __host__ __device__ __forceinline__
#define KGEN_UNROLL _Pragma("unroll")
#else
#define KGEN_HD inline
#define KGEN_UNROLL
#endif

namespace kgen {

#ifdef __CUDACC__
// Grids of (blocks per sample, samples). gridDim.y stops at 65535, so the samples
// run over y and z; a block past the last sample returns at once (the whole block).
constexpr long long kMaxGridY = 65535;
inline dim3 sample_grid(unsigned per_sample, long long batch) {
  if (batch < 1) return dim3(per_sample, 1, 1);  // a valid grid; its blocks return at once
  const long long y = batch < kMaxGridY ? batch : kMaxGridY;
  return dim3(per_sample, static_cast<unsigned>(y), static_cast<unsigned>((batch + y - 1) / y));
}
__device__ __forceinline__ long long grid_sample() { return static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y; }
// Whether `p` may be read or written as whole `Bytes`-byte vectors (a tensor's storage is, a view into it
// need not be).
template <int Bytes>
inline bool aligned_to(const void* p) { return reinterpret_cast<unsigned long long>(p) % Bytes == 0; }
#endif

// ---- 16-bit storage types: a stage of a bfloat16 or float16 plan reads and
// writes these (its inputs, parameters and output), converts every load to
// float and computes in float; each store rounds to nearest even, as PyTorch's
// conversion does (NaN stays NaN; a float16 store beyond its range is +-inf).
// One small type for both builds, so the Args struct a binding fills (host
// compiler) and the kernels read (nvcc) agree: the CUDA path converts with
// the hardware's cvt instructions, the C++ path with the same rounding in
// integer arithmetic. A load converts implicitly (operator float), a store
// through operator=(float); there is no implicit float -> 16-bit conversion,
// so `cond ? x16 : 0.f` is a float expression.
KGEN_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}
KGEN_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// x rounded to TF32 (10 mantissa bits), ties away from zero, as cvt.rna.tf32.f32 and eager's cuDNN NC[D]HW
// forward convolutions round their operands; inf and NaN stay (a carry past the largest float gives inf).
KGEN_HD float tf32_rounded_away(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  return bits_float((u + 0x1000u) & ~0x1fffu);
}

// float -> bfloat16 bits, round to nearest even; NaN -> a quiet NaN.
KGEN_HD uint16_t bfloat16_bits(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#else
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// float -> float16 bits, round to nearest even; beyond the largest finite value
// (65504, with ties at 65520 to even) +-inf; NaN -> a quiet NaN.
KGEN_HD uint16_t float16_bits(float f) {
#ifdef __CUDA_ARCH__
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#else
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, x = u & 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 (inf included): inf
  if (x >= 0x38800000u) {  // normal in float16 (>= 2^-14): rebias the exponent, drop 13 bits
    const uint32_t h = (x - 0x38000000u) >> 13, rest = x & 0x1fffu;
    return static_cast<uint16_t>(sign | (h + (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))));
  }
  const uint32_t e = x >> 23;  // subnormal in float16: k units of 2^-24
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
  const uint32_t m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;  // |f| = m * 2^(e - 150)
  const uint32_t k = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  return static_cast<uint16_t>(sign | (k + (rest > half || (rest == half && (k & 1u)))));
#endif
}

KGEN_HD float bfloat16_value(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

KGEN_HD float float16_value(uint16_t h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN
  if (e == 0) {  // zero or subnormal: m units of 2^-24 (exact in float)
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// x rounded to bfloat16 (nearest even at bit 16) as a float, in 32-bit integer arithmetic (no 16-bit register:
// conv_gemm.cuh conv_output on wgmma accumulators); NaN stays NaN.
KGEN_HD float bfloat16_rounded(float x) {
  const uint32_t u = float_bits(x);
  return (u & 0x7fffffffu) > 0x7f800000u ? x : bits_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

// x rounded to float16 (nearest even) as a float: no 16-bit register (cvt.rn.f16.f32 on wgmma accumulators makes
// ptxas serialize the wgmma, C7514, and it spilled a window loop's float16 epilogue) and one float addition does
// the rounding (the integer form, 14 instructions, made the 16-bit norm kernels ALU-bound). c = 2^13 times |x|'s
// binade (at least float16's smallest normal, 2^-14): the float spacing in c's binade is float16's unit in the last
// place at |x| (2^-24 for its subnormals), and |x| + c lies there, so the addition rounds |x| to nearest even and
// the subtraction is exact. From 65520 up (the tie above 65504 rounds to even, 65536) and inf: inf; NaN stays NaN;
// the sign is x's (-0 too).
KGEN_HD float float16_rounded(float x) {
  const uint32_t u = float_bits(x), a = u & 0x7fffffffu, e = u & 0x7f800000u;
  const float c = bits_float((e > 0x38800000u ? e : 0x38800000u) + (13u << 23));
  const float r = (bits_float(a) + c) - c;
  return bits_float((a >= 0x477ff000u && a <= 0x7f800000u ? 0x7f800000u : float_bits(r)) | (u & 0x80000000u));
}

// The same rounding in 32-bit integer arithmetic: nearest even at bit 13 of the float's bits (as bfloat16_rounded
// at bit 16), inf from 65520 up; below 2^-14, x + 0.75 has float spacing 2^-24 there, float16's subnormal step.
// The form for wgmma accumulators (conv_gemm.cuh conv_output), where float16_rounded's registers spilled a folded
// convolution's fused epilogue (168 registers, the launch bound's limit).
KGEN_HD float float16_rounded_integer(float x) {
  const uint32_t u = float_bits(x), sign = u & 0x80000000u, a = u & 0x7fffffffu;
  const uint32_t r = (a + 0xfffu + ((a >> 13) & 1u)) & ~0x1fffu;
  const float normal = bits_float(sign | (r >= 0x47800000u ? 0x7f800000u : r));
  const float sub = copysignf((x + 0.75f) - 0.75f, x);
  return a > 0x7f800000u ? x : a < 0x38800000u ? sub : normal;
}

struct alignas(2) bfloat16 {
  uint16_t bits;
  KGEN_HD operator float() const { return bfloat16_value(bits); }
  KGEN_HD bfloat16& operator=(float f) {
    bits = bfloat16_bits(f);
    return *this;
  }
};

struct alignas(2) float16 {
  uint16_t bits;
  KGEN_HD operator float() const { return float16_value(bits); }
  KGEN_HD float16& operator=(float f) {
    bits = float16_bits(f);
    return *this;
  }
};

// The conversions by name (vector loads and stores, workspaces of the stage's dtype).
KGEN_HD float to_float(float x) { return x; }
KGEN_HD float to_float(bfloat16 x) { return bfloat16_value(x.bits); }
KGEN_HD float to_float(float16 x) { return float16_value(x.bits); }
template <class T>
KGEN_HD T from_float(float f) {
  T r;
  r = f;
  return r;
}

// `v` rounded to the 16-bit type T (nearest even) and read back as float: a rounding point of a 16-bit
// plan (kgen/plan.py, rounding_points), where eager PyTorch materializes an op's output as a T tensor
// and the next op reads that tensor. A round trip in registers through the hardware's conversions; no
// memory is touched.
template <class T>
KGEN_HD float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The same in 32-bit registers only, for the stage math a generated convolution or GEMM runs in its epilogue
// (pool_reduce's, linear_gemm's): there cvt.rn.f16.f32's 16-bit register spilled a window loop's float16
// epilogue (a convolution, an eval-mode batch norm's affine, a ReLU), so float16 rounds by float16_rounded
// (bit for bit the conversion, a few more instructions: with it in the norm kernels instnorm_clamp_max's
// float16 plan took 0.22 ms on an H200, with the cvt at c458bc3 0.17).
template <class T>
KGEN_HD float round_to_in_32_bit_registers(float v) {
  if constexpr (std::is_same_v<T, float16>) {
    return float16_rounded(v);
  } else {
    return round_to<T>(v);
  }
}

// Tests NaN without std::isnan, which device code does not have.
KGEN_HD bool is_nan(float x) { return x != x; }

// max/min that propagate NaN from either side, as torch.max, max_pool and
// clamp do (fmaxf/fminf would drop it). Written as a compare-select and a NaN
// select, not `is_nan(a) || a > b`: on the CPU the short-circuit compiles to
// branches on the data, mispredicted on every other value of a random input
// (a ReLU + 3x3 max pool loop 19.4 -> 8.5 ms); the selects become maxss/minss
// and a blend. (`a > b ? a : b` is b where either is NaN.)
KGEN_HD float max_nan(float a, float b) {
  const float m = a > b ? a : b;
  return is_nan(a) ? a : m;
}
KGEN_HD float min_nan(float a, float b) {
  const float m = a < b ? a : b;
  return is_nan(a) ? a : m;
}

KGEN_HD float relu(float x) {
  const float m = x > 0.f ? x : 0.f;
  return is_nan(x) ? x : m;
}

// 1 / (1 + exp(-x)): exact limits 0 and 1 at -inf and +inf, NaN stays NaN.
// On the GPU the reciprocal is rcp.approx plus one Newton step (within 1 ulp
// of the rounded quotient): the IEEE division's slow path is a subroutine call
// that no load may be scheduled across, which halved the bandwidth of a
// sigmoid-then-sum loop. d = 1 + exp(-x) >= 1, so no denormal needs that path.
KGEN_HD float sigmoid(float x) {
  const float d = 1.f + expf(-x);
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = fmaf(r, fmaf(-d, r, 1.f), r);
  return d == INFINITY ? 0.f : r;  // inf * 0 in the Newton step would give NaN
#else
  return 1.f / d;
#endif
}

KGEN_HD float tanh(float x) { return tanhf(x); }

// torch.clamp: NaN stays NaN; with lo > hi every value becomes hi. On sm_80+ with nonzero bounds
// (constants in a spec: the test folds) the NaN-propagating min/max instructions give the same
// values, one instruction each instead of three; a zero bound keeps the compare-and-select form,
// whose ties give the sign of zero as PyTorch does.
KGEN_HD float clamp(float x, float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (lo != 0.f && hi != 0.f) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(lo));
    asm("min.NaN.f32 %0, %0, %1;" : "+f"(r) : "f"(hi));
    return r;
  }
#endif
  return min_nan(max_nan(x, lo), hi);
}

// The arithmetic ops, as functions like every elementwise op of the op table
// (kgen/ops.py): one rounding each, as in PyTorch.
KGEN_HD float add(float x, float y) { return x + y; }
KGEN_HD float sub(float x, float y) { return x - y; }
KGEN_HD float mul(float x, float y) { return x * y; }
KGEN_HD float div(float x, float y) { return x / y; }

// torch.minimum / torch.maximum (torch.min/max with a tensor): NaN on either side wins.
KGEN_HD float minimum(float x, float y) { return min_nan(x, y); }
KGEN_HD float maximum(float x, float y) { return max_nan(x, y); }
// x.masked_fill(mask != 0, value): the mask a value of x's type, nonzero where x is filled (a NaN mask fills too)
KGEN_HD float masked_fill(float x, float value, float mask) { return mask != 0.f ? value : x; }

// Activations, each as PyTorch computes it in float (aten/src/ATen/native/cpu and
// cuda kernels), so NaN and +-inf come out where PyTorch's float64 puts them:
// gelu(-inf), silu(-inf), mish(-inf) and hardswish(-inf) are NaN (-inf * 0).
constexpr float kSqrtHalf = 0.70710678118654752440f;  // 1 / sqrt(2)
constexpr float kSqrtTwoOverPi = 0.79788456080286535588f;  // sqrt(2 / pi)
constexpr float kGeluTanhCubic = 0.044715f;  // the cubic term of the tanh form

KGEN_HD float gelu(float x) { return x * 0.5f * (1.f + erff(x * kSqrtHalf)); }
KGEN_HD float gelu_tanh(float x) {
  const float inner = kSqrtTwoOverPi * (x + kGeluTanhCubic * x * x * x);
  return 0.5f * x * (1.f + tanhf(inner));
}
KGEN_HD float silu(float x) { return x / (1.f + expf(-x)); }
KGEN_HD float mish(float x) { return x * tanhf(log1pf(expf(x))); }
KGEN_HD float softplus(float x, float beta, float threshold) {
  return x * beta > threshold ? x : log1pf(expf(x * beta)) / beta;
}
KGEN_HD float hardsigmoid(float x) { return min_nan(max_nan(x + 3.f, 0.f), 6.f) / 6.f; }
KGEN_HD float hardswish(float x) { return x * min_nan(max_nan(x + 3.f, 0.f), 6.f) / 6.f; }
KGEN_HD float hardtanh(float x, float lo, float hi) { return min_nan(max_nan(x, lo), hi); }
KGEN_HD float leaky_relu(float x, float negative_slope) { return x > 0.f ? x : x * negative_slope; }
KGEN_HD float elu(float x, float alpha) { return x > 0.f || is_nan(x) ? x : alpha * expm1f(x); }
KGEN_HD float exp(float x) { return expf(x); }
KGEN_HD float log(float x) { return logf(x); }
KGEN_HD float sqrt(float x) { return sqrtf(x); }  // IEEE (nvcc's default -prec-sqrt=true)
// torch.rsqrt: ATen's CUDA kernel calls rsqrtf (2 ulp), its CPU kernel divides 1 by the square root
KGEN_HD float rsqrt(float x) {
#ifdef __CUDA_ARCH__
  return rsqrtf(x);
#else
  return 1.f / sqrtf(x);
#endif
}
KGEN_HD float abs(float x) { return fabsf(x); }
KGEN_HD float neg(float x) { return -x; }

// Statistics of a normalization: count, sum of d and sum of d*d, where
// d = v - shift and the shift is a value near the group's mean. Every thread,
// block and split only adds these sums, and the normalized value is
// ((v - shift) - mean_offset) * rstd: no large mean is ever rounded, so data
// far from zero (mean 1e4, std 1) keep fp32 accuracy. The sums are double:
// many equal values (ReLU zeros) would otherwise round the same way each time
// and bias the variance by ~1e-6; these kernels are memory-bound, so FP64
// adds cost nothing measurable. A NaN or inf anywhere makes the group's
// statistics NaN, as in PyTorch.
struct ShiftedSums {
  double count;
  double s1;  // sum of d
  double s2;  // sum of d * d
};

KGEN_HD ShiftedSums sums_empty() { return ShiftedSums{0.0, 0.0, 0.0}; }

KGEN_HD void sums_push(ShiftedSums& s, float d) {
  s.count += 1.0;
  s.s1 += d;
  s.s2 += static_cast<double>(d) * d;
}

KGEN_HD ShiftedSums sums_add(const ShiftedSums& a, const ShiftedSums& b) {
  return ShiftedSums{a.count + b.count, a.s1 + b.s1, a.s2 + b.s2};
}

// Mean (as an offset from the shift) and 1 / sqrt(biased variance + eps).
KGEN_HD void sums_stats(const ShiftedSums& s, float eps, float& mean_offset, float& rstd) {
  const double m = s.s1 / s.count;
  const double var = (s.s2 - s.s1 * m) / s.count;  // can round slightly negative; NaN must stay NaN
  mean_offset = static_cast<float>(m);
  rstd = static_cast<float>(1.0 / sqrt((var < 0.0 ? 0.0 : var) + static_cast<double>(eps)));
}

// Statistics gathered per tile by a generated convolution's epilogue: each
// tile's (count, mean, M2 = sum of squared deviations from its mean), two
// passes over its registers, no shift needed. The tiles of a group are merged
// in double, in a fixed order (conv_gemm's norm epilogue, merged_stats; a batch
// norm's after the Store epilogue: batch_stats' merge_moments_kernel). NaN or
// inf anywhere makes the merged statistics NaN, as in PyTorch.
struct TileMoments {
  float count, mean, m2;
};

// The merged statistics of a group.
struct Moments {
  double count, mean, m2;
};

// The mean; rstd = 1 / sqrt(biased variance + eps).
KGEN_HD float moments_stats(const Moments& m, float eps, float& rstd) {
  rstd = static_cast<float>(1.0 / sqrt(m.m2 / m.count + static_cast<double>(eps)));
  return static_cast<float>(m.mean);
}

// Neither infinite nor NaN (a comparison, not x - x == 0, which fast-math may fold).
constexpr float kFloatMax = 3.402823466e38f;
KGEN_HD bool is_finite(float x) { return fabsf(x) <= kFloatMax; }

// Softmax, log_softmax and logsumexp over a slice of values: the slice's max
// and the sum of exp(v - max), in the max-subtracted form (no exp overflows).
// Values are pushed one by one or gathered per thread and merged:
//   m = max(m1, m2), s = s1 * exp(m1 - m) + s2 * exp(m2 - m)
// with one exp per push or merge (the larger side's factor is 1). The sum is
// kept only while the max is finite; a max that is NaN (a NaN anywhere: max_nan
// keeps it), +inf or -inf (every value -inf) decides the result alone, as in
// PyTorch: logsumexp is then that max, and every softmax / log_softmax output
// of the slice is NaN (PyTorch's exp(inf - inf) and -inf - -inf). merge(a, b)
// and merge(b, a) are the same value, so a butterfly leaves every lane equal.
struct ExpSum {
  float max;
  float sum;  // of exp(v - max); 0 while max is not finite
};

KGEN_HD ExpSum expsum_empty() { return ExpSum{-INFINITY, 0.f}; }

KGEN_HD ExpSum expsum_merge(const ExpSum& a, const ExpSum& b) {
  const float hi = max_nan(a.max, b.max);
  if (!is_finite(hi)) return ExpSum{hi, 0.f};
  const float e = expf((a.max < b.max ? a.max : b.max) - hi);  // the smaller side's factor, 0 for a max of -inf
  if (a.max > b.max) return ExpSum{hi, a.sum + b.sum * e};
  if (b.max > a.max) return ExpSum{hi, a.sum * e + b.sum};
  return ExpSum{hi, a.sum + b.sum};
}

KGEN_HD void expsum_push(ExpSum& p, float v) { p = expsum_merge(p, ExpSum{v, 1.f}); }

// log(sum of exp(v)) of the slice: torch.logsumexp's value, inf, -inf and NaN included.
KGEN_HD float expsum_log(const ExpSum& p) { return is_finite(p.max) ? p.max + logf(p.sum) : p.max; }

}  // namespace kgen
