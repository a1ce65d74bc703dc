// kgen_runtime.h: helpers for the generated torch bindings (argument checks,
// output allocation, the ATen convolution stages). Host code only.
// Copied verbatim into generated/ by `kgen render`; edit templates/kgen_runtime.h.
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string>

// The ATen pieces the bindings use, rather than ATen/ATen.h: declaring every
// operator was two thirds of a module's build time.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <ATen/ops/add.h>
#include <ATen/ops/batch_norm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/bitwise_and.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/var_mean.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#ifdef KGEN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace kgen {

enum class Precision { kIeee, kTf32, kTf32x3 };

// A named range around one stage's calls: torch.profiler shows it with the
// device time of the kernels launched inside (kgen bench times stages so).
// Without a profiler it costs a flag check.
class StageScope {
 public:
  explicit StageScope(const char* name) : record_(at::RecordScope::USER_SCOPE) {
    if (record_.isActive()) record_.before(name);
  }

 private:
  at::RecordFunction record_;
};

// A dimension that is only known at run time (the batch).
constexpr int64_t kAnySize = -1;

inline std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << (shape[i] == kAnySize ? std::string("N") : std::to_string(shape[i]));
  s << "]";
  return s.str();
}

// A dtype as a spec and PyTorch's Python name it (float32, bfloat16, float16).
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    default: return c10::toString(t);
  }
}

// x's dtype must be one the module was rendered for (`rendered`, named `names`); another one is
// refused with the spec edit and the command that add it (`key`: where the spec's dtype is).
inline void check_dtype(const char* op, const at::Tensor& x, std::initializer_list<at::ScalarType> rendered,
                        const char* names, const char* spec, const char* key) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  for (at::ScalarType t : rendered) {
    if (x.scalar_type() == t) return;
  }
  const std::string d = dtype_name(x.scalar_type());
  TORCH_CHECK(d == "float32" || d == "bfloat16" || d == "float16", op, ": x must be float32, bfloat16 or float16 (this module: ",
              names, "), got ", d);
  TORCH_CHECK(false, op, ": x is ", d, ", but this module was rendered for ", names, " only; to add ", d, ", write `dtype: [",
              names, ", ", d, "]` under ", key, " in ", spec, " and run `kgen all ", spec, "`");
}

// Checks dtype, device and static shape of an argument, naming what was
// expected; `like` (if given) is the tensor (x) whose device and dtype it must share,
// as PyTorch's modules refuse mixed dtypes; without it, float32.
// `dtype` (where not Undefined): the dtype `t` has whatever x's is (a batch norm's float statistics).
inline void check_arg(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected,
                      const at::Tensor* like = nullptr, at::ScalarType dtype = at::ScalarType::Undefined) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  if (like == nullptr || dtype != at::ScalarType::Undefined) {
    const at::ScalarType want = like == nullptr ? at::kFloat : dtype;
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", dtype_name(want), ", got ", dtype_name(t.scalar_type()));
  } else {
    TORCH_CHECK(t.scalar_type() == like->scalar_type(), op, ": ", name, " is ", dtype_name(t.scalar_type()), " but x is ",
                dtype_name(like->scalar_type()), ": every input, parameter and buffer must have x's dtype, as PyTorch "
                "requires (convert the model with model.to(torch.", dtype_name(like->scalar_type()), "), or the input)");
  }
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", name, " must be on cpu or cuda, got ", t.device());
  if (like != nullptr) {
    TORCH_CHECK(t.device() == like->device(), op, ": ", name, " must be on ", like->device(), " like x, got ", t.device());
  }
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  for (int64_t d = 0; ok && d < t.dim(); ++d) ok = expected[d] == kAnySize || expected[d] == t.size(d);
  TORCH_CHECK(ok, op, ": ", name, " must have shape ", shape_str(expected), ", got ", shape_str(t.sizes()));
}

// A list argument of an op (the module's parameters or buffers, a stage's values) must hold
// `expected` tensors in the module's order, `first` to `last` by name.
inline void check_count(const char* op, const char* what, size_t given, size_t expected, const char* kind,
                        const char* first, const char* last) {
  if (given == expected) return;
  TORCH_CHECK(expected != 0, op, ": ", what, " must be empty (there is no ", kind, "), got ", given, " tensor(s)");
  TORCH_CHECK(false, op, ": ", what, " must hold ", expected, " ", kind, "(s) in the module's order (", first,
              expected > 1 ? " ... " : "", expected > 1 ? last : "", "), got ", given, " tensor(s)");
}

// Outputs and workspaces are poisoned with this NaN bit pattern when
// KGEN_POISON_OUTPUTS=1 (kgen validate sets it): an element no kernel wrote
// keeps it, and validation looks for it.
constexpr int32_t kPoisonBits = 0x7FDEAD00;
constexpr int16_t kPoisonBits16 = 0x7FDE;  // a NaN as bfloat16 and as float16 (16-bit outputs)

inline bool poison_enabled() {
  const char* v = std::getenv("KGEN_POISON_OUTPUTS");
  return v != nullptr && v[0] == '1';
}

inline at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_enabled()) {
    if (t.scalar_type() == at::kDouble) t.fill_(std::numeric_limits<double>::quiet_NaN());
    else if (t.element_size() == 2) t.view(at::kShort).fill_(kPoisonBits16);
    else t.view(at::kInt).fill_(kPoisonBits);
  }
  return t;
}

// The copies of the running statistics a plan's batch norms update in training mode (the op returns them: it
// may not change its arguments), made in one launch (a foreach copy; a clone apiece cost a launch each); in eval
// mode the statistics themselves, which the norms only read and the op does not return.
inline std::vector<at::Tensor> running_copies(bool training, std::vector<at::Tensor> stats) {
  if (!training) return stats;
  std::vector<at::Tensor> copies;
  copies.reserve(stats.size());
  for (const at::Tensor& s : stats) copies.push_back(at::empty_like(s));
  at::_foreach_copy_(copies, stats);
  return copies;
}

// A workspace of `count` values of T, allocated as doubles (T a struct of
// doubles, such as ShiftedSums) or floats (float, TileMoments); `holder` keeps it alive.
// With `kept` (a WorkspaceCache's buffer), that buffer is reused when it is large enough and of the
// type, else replaced; poisoned on every call like a fresh one.
template <typename T>
T* workspace(at::Tensor& holder, int64_t count, const at::TensorOptions& options, at::Tensor* kept = nullptr) {
  constexpr bool kDoubles = alignof(T) == alignof(double);
  using Elem = typename std::conditional<kDoubles, double, float>::type;
  static_assert(sizeof(T) % sizeof(Elem) == 0, "a workspace value must be whole floats or doubles");
  const int64_t elems = count * static_cast<int64_t>(sizeof(T) / sizeof(Elem));
  const at::ScalarType type = kDoubles ? at::kDouble : at::kFloat;
  if (kept == nullptr) {
    holder = empty({elems}, options.dtype(type));
  } else {
    if (!kept->defined() || kept->scalar_type() != type || kept->numel() < elems) *kept = empty({elems}, options.dtype(type));
    else if (poison_enabled()) *kept = empty({kept->numel()}, options.dtype(type));
    holder = *kept;
  }
  return reinterpret_cast<T*>(holder.data_ptr<Elem>());
}

#ifdef KGEN_WITH_CUDA
// Whether `stream` is capturing a CUDA graph (what the caches keep must then not be shared with the replays).
inline bool stream_capturing(cudaStream_t stream, const char* who) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  TORCH_CHECK(err == cudaSuccess, "kgen: ", who, ": cudaStreamIsCapturing failed: ", cudaGetErrorString(err));
  return capture != cudaStreamCaptureStatusNone;
}
#endif

// Workspaces of one call site, kept between calls: a buffer per (device, stream), grown when a call needs
// more. Calls on one stream run in order, so a buffer is never in use by two kernels at once; calls on
// another stream get their own. Saves an allocation per call (a few microseconds of host time before the
// first launch). On the CPU and while the stream captures a CUDA graph (a replay must not share the buffer
// with later calls) each call gets a fresh allocation. A static of the generated stage function owns it.
class WorkspaceCache {
 public:
  template <typename T>
  T* get(at::Tensor& holder, int64_t count, const at::TensorOptions& options) {
#ifdef KGEN_WITH_CUDA
    if (options.device().is_cuda()) {
      const c10::DeviceIndex device = options.device().index();
      const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
      if (!stream_capturing(stream, "workspace")) {
        std::lock_guard<std::mutex> lock(mutex_);
        at::Tensor* kept = nullptr;
        for (Entry& e : entries_)
          if (e.device == device && e.stream == stream) kept = &e.buffer;
        if (kept == nullptr) {
          entries_.push_back(Entry{device, stream, at::Tensor()});
          kept = &entries_.back().buffer;
        }
        return workspace<T>(holder, count, options, kept);
      }
    }
#endif
    return workspace<T>(holder, count, options);
  }

 private:
  struct Entry {
    c10::DeviceIndex device;
    const void* stream;
    at::Tensor buffer;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

// Blocks along a split reduction, chosen at run time because it depends on the
// batch: `blocks` blocks before splitting, and enough splits that the device gets
// `blocks_per_sm` blocks per SM, each of the `lanes` threads of an output still
// combining at least `min_per_thread` of its `values`; at most `max_splits`
// (the grid's y limit). The constants come from the stage's schedule (plan.json).
inline int cuda_splits(long long blocks, int sm_count, int blocks_per_sm, long long values, int lanes,
                       int min_per_thread, int max_splits) {
  const long long target = static_cast<long long>(sm_count) * blocks_per_sm;
  long long splits = (target + blocks - 1) / blocks;
  long long cap = values / (static_cast<long long>(lanes) * min_per_thread);
  if (cap > max_splits) cap = max_splits;
  if (splits > cap) splits = cap;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

// A tensor's data as T, the element type of a generated stage in `type` (float, or kgen_math.h's
// kgen::bfloat16 / kgen::float16 for at::kBFloat16 / at::kHalf: the same bits).
template <typename T>
T* data_as(const at::Tensor& t, at::ScalarType type) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "a stage's element type is float or a 16-bit type");
  TORCH_CHECK(t.scalar_type() == type && at::elementSize(type) == sizeof(T), "kgen: expected a ", dtype_name(type),
              " tensor, got ", dtype_name(t.scalar_type()));
  return static_cast<T*>(t.data_ptr());
}

// The pointer of a buffer a fused stage reads (elements T, of dtype `type`), after checking that it
// has the sizes and strides the kernel was specialized for.
template <typename T = float>
inline const T* tile_ptr(const char* op, const char* what, const at::Tensor& t, const at::Tensor& like,
                         at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType type = at::kFloat) {
  TORCH_CHECK(t.scalar_type() == type && t.device() == like.device(), op, ": ", what, " must be ", dtype_name(type), " on ",
              like.device());
  TORCH_CHECK(t.sizes() == sizes, op, ": ", what, " must have shape ", shape_str(sizes), ", got ", shape_str(t.sizes()));
  bool ok = true;
  for (int64_t d = 0; d < t.dim(); ++d) ok = ok && (t.size(d) == 1 || t.stride(d) == strides[d]);
  TORCH_CHECK(ok, op, ": ", what, " must have strides ", strides, ", got ", t.strides());
  return data_as<T>(t, type);
}

// One output of an op with several: itself, or a copy where it shares memory with an argument or an
// earlier output (a value that is a view of another), as a custom op's outputs may alias nothing.
inline at::Tensor unaliased(const at::Tensor& out, std::initializer_list<at::Tensor> others) {
  for (const at::Tensor& t : others) {
    if (t.defined() && out.is_alias_of(t)) return out.clone();
  }
  return out;
}

// Channels [channel0, channel0 + channels) of `whole`: the output of a cat whose operands' stages write them in
// place, allocated here (with `sizes`) where it is not given (a stage run on its own, as validation does).
inline at::Tensor channel_slice(const char* op, const at::Tensor& whole, at::IntArrayRef sizes, int64_t channel0,
                                int64_t channels, const at::TensorOptions& options) {
  const at::Tensor w = whole.defined() ? whole : empty(sizes, options);
  TORCH_CHECK(w.sizes() == sizes && w.is_contiguous(), op, ": the concatenated output must be a contiguous tensor of sizes ",
              sizes, ", got sizes ", w.sizes(), " and strides ", w.strides());
  return w.narrow(1, channel0, channels);
}

inline at::Tensor narrow_spatial(const at::Tensor& x, at::IntArrayRef extent) {
  at::Tensor y = x;
  for (size_t d = 0; d < extent.size(); ++d) {
    if (y.size(2 + d) != extent[d]) y = y.narrow(2 + d, 0, extent[d]);
  }
  return y;
}

// Sets PyTorch's cuDNN TF32 switch for one scope and restores it after.
// The switch is process-global: another thread converting at the same time
// sees it too.
class CudnnTf32Guard {
 public:
  explicit CudnnTf32Guard(bool allow) : previous_(at::globalContext().allowTF32CuDNN()) {
    if (allow != previous_) at::globalContext().setAllowTF32CuDNN(allow);
  }
  ~CudnnTf32Guard() {
    if (at::globalContext().allowTF32CuDNN() != previous_) at::globalContext().setAllowTF32CuDNN(previous_);
  }
  CudnnTf32Guard(const CudnnTf32Guard&) = delete;
  CudnnTf32Guard& operator=(const CudnnTf32Guard&) = delete;

 private:
  bool previous_;
};

// PyTorch's default precision for float32 matrix products ("highest": no TF32) for
// one scope, restored after; like CudnnTf32Guard, the setting is process-global.
class MatmulFp32Guard {
 public:
  MatmulFp32Guard() : previous_(at::globalContext().float32MatmulPrecision()) {
    if (previous_ != at::Float32MatmulPrecision::HIGHEST) at::globalContext().setFloat32MatmulPrecision("highest");
  }
  ~MatmulFp32Guard() {
    if (previous_ == at::Float32MatmulPrecision::HIGH) at::globalContext().setFloat32MatmulPrecision("high");
    if (previous_ == at::Float32MatmulPrecision::MEDIUM) at::globalContext().setFloat32MatmulPrecision("medium");
  }
  MatmulFp32Guard(const MatmulFp32Guard&) = delete;
  MatmulFp32Guard& operator=(const MatmulFp32Guard&) = delete;

 private:
  at::Float32MatmulPrecision previous_;
};

// nn.Linear and torch.matmul as ATen (cuBLAS) computes them in full fp32; contiguous.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  MatmulFp32Guard fp32;
  return at::linear(x, w, b).contiguous();
}

namespace detail {

// Whether `t` is what cuBLAS's strided batched product reads as it is (kgen.buffer.batched_matrix, its twin): its
// last two dims one matrix in either order (one of stride 1, the other at least its size), the dims before them
// one batch stride (each one's stride the next one's times its size; dims of size 1 left out).
inline bool batched_matrix(at::IntArrayRef sizes, at::IntArrayRef strides) {
  const int64_t r = static_cast<int64_t>(sizes.size());
  const int64_t m = sizes[r - 2], k = sizes[r - 1], sm = strides[r - 2], sk = strides[r - 1];
  if (!(((sk == 1 || k == 1) && sm >= std::max<int64_t>(k, 1)) || ((sm == 1 || m == 1) && sk >= std::max<int64_t>(m, 1)))) return false;
  int64_t inner = -1;  // the innermost batch dim's index, once one of size > 1 is seen
  for (int64_t d = r - 3; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (inner >= 0 && strides[d] != strides[inner] * sizes[inner]) return false;
    inner = d;
  }
  return true;
}

inline bool batched_matrix_without(std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t dim) {
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return batched_matrix(sizes, strides);
}

// The batch dim (not dim 0, the batch itself) of at most kMaxProductSlices indices whose slices of x, w and their
// contiguous product cuBLAS reads as they are, where at::matmul would copy x or w first and the copies outweigh
// the slices' extra launches (kSliceBytes a launch: about what an H200 copies in a launch's time); -1 where there is
// none or nothing to save. The cost model's twin: kgen.buffer.product_slice_dim.
constexpr int64_t kMaxProductSlices = 16;
constexpr int64_t kSliceBytes = int64_t{1} << 23;
inline int64_t product_slice_dim(const at::Tensor& x, const at::Tensor& w) {
  const int64_t r = x.dim();
  if (r < 4 || w.dim() != r || x.sizes().slice(0, r - 2) != w.sizes().slice(0, r - 2) || x.size(r - 1) != w.size(r - 2)) return -1;
  const bool x_batched = batched_matrix(x.sizes(), x.strides()), w_batched = batched_matrix(w.sizes(), w.strides());
  if (x_batched && w_batched) return -1;
  const int64_t copied = (x_batched ? 0 : x.numel() * x.element_size()) + (w_batched ? 0 : w.numel() * w.element_size());
  std::vector<int64_t> out_sizes = x.sizes().vec(), out_strides(r);
  out_sizes.back() = w.size(r - 1);
  for (int64_t d = r - 1, step = 1; d >= 0; step *= out_sizes[d], --d) out_strides[d] = step;  // contiguous
  int64_t best = -1;
  for (int64_t d = 1; d < r - 2; ++d) {
    const int64_t n = x.size(d);
    if (n == 1 || n > kMaxProductSlices || (best >= 0 && n >= x.size(best)) || copied < (n - 1) * kSliceBytes) continue;
    if (batched_matrix_without(x.sizes().vec(), x.strides().vec(), d) && batched_matrix_without(w.sizes().vec(), w.strides().vec(), d)
        && batched_matrix_without(out_sizes, out_strides, d)) best = d;
  }
  return best;
}

}  // namespace detail

// torch.matmul in full fp32. Where x or w is a view whose batch dims cuBLAS cannot step as one stride (a permute
// interleaving them: Mamba2's einsums) and one batch dim's slices it can, one at::bmm per index of that dim on the
// views themselves instead of at::matmul's copies of them (priced so by kgen.cost.product_view_copies).
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& w) {
  MatmulFp32Guard fp32;
  const int64_t d = detail::product_slice_dim(x, w);
  if (d < 0) return at::matmul(x, w).contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(-1);
  at::Tensor y = at::empty(sizes, x.options());
  const auto as_batch = [](const at::Tensor& t) { return t.view({-1, t.size(-2), t.size(-1)}); };
  for (int64_t i = 0; i < x.size(d); ++i) {
    at::Tensor out = as_batch(y.select(d, i));  // (a view of y: bmm writes it in place)
    at::bmm_out(out, as_batch(x.select(d, i)), as_batch(w.select(d, i)));
  }
  return y;
}

// x with the low 13 mantissa bits cleared: exactly representable in TF32.
// Sums of `window` consecutive entries of `t` along `dim` (entries past the last whole window are
// dropped), contiguous: a product whose outputs are only summed in windows runs with its weight's
// window sums (kgen.lowering.PooledProduct).
inline at::Tensor window_sums(const at::Tensor& t, int64_t dim, int64_t window) {
  const int64_t groups = t.size(dim) / window;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[dim] = groups;
  shape.insert(shape.begin() + dim + 1, window);
  return t.narrow(dim, 0, groups * window).reshape(shape).sum(dim + 1).contiguous();
}

inline at::Tensor tf32_high(const at::Tensor& x) {
  return at::bitwise_and(x.contiguous().view(at::kInt), static_cast<int64_t>(0xFFFFE000)).view(at::kFloat);
}

// One ATen convolution with the spec's precision, output in `format`.
// tf32x3 (split TF32): conv(xh, wh) + conv(xh, wl) + conv(xl, wh), where
// v = vh + vl and vh is v rounded down to TF32; about fp32 accuracy at three
// TF32 convolutions. Non-finite inputs keep vl = 0 so inf stays inf.
inline at::Tensor convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                              at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                              bool transposed, at::IntArrayRef output_padding, int64_t groups, Precision precision,
                              at::MemoryFormat format) {
  // Input and weight in the same memory format, or ATen and cuDNN convert
  // both (and the output) back and forth around the convolution. The CPU runs
  // eager's contiguous call: ATen's CPU channels_last convolution (oneDNN) is not
  // eager's (in bfloat16 on AVX512-BF16 CPUs it spreads a NaN to outputs whose
  // window does not hold it).
  const at::MemoryFormat run = x.is_cuda() ? format : at::MemoryFormat::Contiguous;
  const at::Tensor xin = x.contiguous(run);
  auto conv = [&](const at::Tensor& xx, const at::Tensor& ww, const std::optional<at::Tensor>& bb) {
    return at::convolution(xx, ww.contiguous(run), bb, stride, padding, dilation, transposed, output_padding, groups);
  };
  at::Tensor y;
  if (!xin.is_cuda() || precision == Precision::kIeee || xin.scalar_type() != at::kFloat) {  // (TF32 is float32's only)
    CudnnTf32Guard tf32(false);
    y = conv(xin, w, b);
  } else if (precision == Precision::kTf32) {
    CudnnTf32Guard tf32(true);
    y = conv(xin, w, b);
  } else {
    CudnnTf32Guard tf32(true);
    auto split = [](const at::Tensor& v, at::MemoryFormat f) {
      at::Tensor hi = tf32_high(v).contiguous(f);
      at::Tensor lo = at::where(at::isfinite(v), at::sub(v, hi), at::zeros({}, v.options())).contiguous(f);
      return std::make_pair(hi, lo);
    };
    auto [xh, xl] = split(xin, run);
    auto [wh, wl] = split(w, at::MemoryFormat::Contiguous);
    y = conv(xh, wh, b);
    y.add_(conv(xh, wl, std::nullopt)).add_(conv(xl, wh, std::nullopt));
  }
  return y.contiguous(format);
}

// Per spatial dim d of w (N, C, K...): the sum of copies[d] copies of w, copy t
// shifted by t * step[d] (K + (copies - 1) * step taps). Plain fp32 additions:
// a convolution with a box would let cuDNN round the weights to TF32.
inline at::Tensor shifted_sum(const at::Tensor& w, at::IntArrayRef copies, at::IntArrayRef step) {
  at::Tensor out = w;
  for (size_t d = 0; d < copies.size(); ++d) {
    const int64_t dim = 2 + static_cast<int64_t>(d), K = out.size(dim);
    std::vector<int64_t> shape = out.sizes().vec();
    shape[dim] = K + (copies[d] - 1) * step[d];
    at::Tensor acc = at::zeros(shape, out.options());
    for (int64_t t = 0; t < copies[d]; ++t) acc.narrow(dim, t * step[d], K).add_(out);
    out = acc;
  }
  return out;
}

inline int64_t product(at::IntArrayRef v) {
  int64_t n = 1;
  for (int64_t x : v) n *= x;
  return n;
}

// A float32 tensor rounded to TF32 (10 mantissa bits), ties to even, as cvt.rn.tf32.f32 and eager's
// cuDNN transposed convolutions round their operands; inf and NaN are kept. On the integer bits: add
// half a unit less one plus the kept part's lowest bit, then clear the 13 dropped bits (a carry into the
// exponent is the rounding up to the next binade, or to inf past the largest TF32 value).
inline at::Tensor tf32_half_even(const at::Tensor& w) {
  constexpr int64_t kDropped = 13, kHalfLessOne = (int64_t{1} << (kDropped - 1)) - 1;
  const at::Tensor bits = w.contiguous().view(at::kInt);
  const at::Tensor lowest_kept = at::div(at::bitwise_and(bits, int64_t{1} << kDropped), int64_t{1} << kDropped, "trunc");  // 0 or 1
  const at::Tensor sum = at::add(at::add(bits, lowest_kept), at::Scalar(kHalfLessOne));
  const at::Tensor rounded = at::bitwise_and(sum, at::Scalar(~((int64_t{1} << kDropped) - 1))).view(at::kFloat);
  return at::where(at::isfinite(w), rounded, w);
}

// A float32 tensor rounded to TF32, ties away from zero (kgen::tf32_rounded_away on each value: as eager's cuDNN
// NC[D]HW forward convolutions round their operands); inf and NaN are kept.
inline at::Tensor tf32_round_away(const at::Tensor& w) {
  constexpr int64_t kDropped = 13;
  const at::Tensor bits = w.contiguous().view(at::kInt);
  const at::Tensor sum = at::add(bits, at::Scalar(int64_t{1} << (kDropped - 1)));
  const at::Tensor rounded = at::bitwise_and(sum, at::Scalar(~((int64_t{1} << kDropped) - 1))).view(at::kFloat);
  return at::where(at::isfinite(w), rounded, w);
}

// Average pool folded into a convolution's kernel (kgen.lowering.Folded):
// w'[u] = mean over pool taps t of w[u - t * conv_stride].
inline at::Tensor fold_avg_pool_weight(const at::Tensor& w, at::IntArrayRef pool_kernel, at::IntArrayRef conv_stride) {
  return shifted_sum(w, pool_kernel, conv_stride).div_(static_cast<double>(product(pool_kernel)));
}

// ... into a transposed convolution's (Cin, Cout, K...) kernel: window sums of kp
// taps, flipped, one every stride taps from `start` (kgen.lowering.TransposedFold),
// divided by the window size, as the (Cout, Cin, taps...) kernel of an ordinary
// convolution.
inline at::Tensor fold_avg_pool_transposed_weight(const at::Tensor& w, at::IntArrayRef pool_kernel, at::IntArrayRef stride,
                                                  at::IntArrayRef start, at::IntArrayRef taps) {
  std::vector<int64_t> ones(pool_kernel.size(), 1), dims;
  for (size_t d = 0; d < pool_kernel.size(); ++d) dims.push_back(2 + static_cast<int64_t>(d));
  at::Tensor sums = shifted_sum(w, pool_kernel, ones).flip(dims);
  for (size_t d = 0; d < start.size(); ++d) {
    sums = sums.slice(2 + d, start[d], start[d] + stride[d] * (taps[d] - 1) + 1, stride[d]);
  }
  return sums.div(static_cast<double>(product(pool_kernel))).transpose(0, 1);
}

// A convolution whose output is only summed over some spatial dims (kgen.lowering.TapSums): the
// input is summed first, per summed dim `dims[j]` (0-based spatial, increasing) into one partial
// sum per kernel tap, tap k over the input range [ranges[j][2k], ranges[j][2k + 1]) (empty when
// lo >= hi); the taps become input channels, and the convolution runs over the other dims with
// the written geometry (`stride` ... `output_padding` of those dims), in fp32, its bias counted
// `count` times. Every summed dim is then 1 in the output `out_shape`. The ranges' disjoint
// segments are summed once and added up per tap: no subtraction, so an inf a tap does not read
// stays out of its sum. `sums`: the per-tap sums already made (a generated kernel), (N, C, taps...).
inline at::Tensor tap_sum_convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                                      const std::vector<int64_t>& dims, const std::vector<std::vector<int64_t>>& ranges,
                                      bool transposed, at::IntArrayRef stride, at::IntArrayRef padding,
                                      at::IntArrayRef dilation, at::IntArrayRef output_padding, double count,
                                      at::IntArrayRef out_shape, const std::optional<at::Tensor>& sums = std::nullopt) {
  const int64_t rank = x.dim() - 2, n = x.size(0);
  at::Tensor t = sums ? *sums : x;
  for (size_t j = 0; j < (sums ? 0 : dims.size()); ++j) {
    const int64_t dim = 2 + dims[j], taps = static_cast<int64_t>(ranges[j].size() / 2);
    std::vector<int64_t> cuts{0, t.size(dim)};
    for (int64_t v : ranges[j]) cuts.push_back(std::min(std::max<int64_t>(v, 0), t.size(dim)));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<at::Tensor> segments;  // segment q: [cuts[q], cuts[q + 1])
    for (size_t q = 0; q + 1 < cuts.size(); ++q) segments.push_back(t.narrow(dim, cuts[q], cuts[q + 1] - cuts[q]).sum(dim, true));
    const at::Tensor seg = segments.size() == 1 ? segments[0] : at::cat(segments, dim);
    std::vector<at::Tensor> per_tap;  // tap k: the sum of the segments inside its range (a run of them)
    for (int64_t k = 0; k < taps; ++k) {
      const auto first = std::lower_bound(cuts.begin(), cuts.end(), ranges[j][2 * k]);
      const auto last = std::upper_bound(cuts.begin(), cuts.end(), ranges[j][2 * k + 1]);
      const int64_t a = first - cuts.begin(), b = (last - cuts.begin()) - 1;  // segments [a, b)
      if (b <= a) {
        per_tap.push_back(at::zeros_like(seg.narrow(dim, 0, 1)));
      } else {
        per_tap.push_back(b - a == 1 ? seg.narrow(dim, a, 1) : seg.narrow(dim, a, b - a).sum(dim, true));
      }
    }
    t = at::cat(per_tap, dim);
  }
  // the summed dims' taps next to the channels: (N, C * taps, other dims...)
  std::vector<int64_t> order{0, 1}, wt_order, rest;
  for (int64_t d : dims) order.push_back(2 + d);
  for (int64_t d = 0; d < rank; ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) rest.push_back(d), order.push_back(2 + d);
  }
  t = t.permute(order);
  std::vector<int64_t> tshape{n, -1};
  for (int64_t d : rest) tshape.push_back(x.size(2 + d));
  // the weight the same way: ([Cin, taps..., Cout, K_rest...] transposed, [Cout, Cin, taps..., K_rest...] forward)
  wt_order = transposed ? std::vector<int64_t>{0} : std::vector<int64_t>{0, 1};
  for (int64_t d : dims) wt_order.push_back(2 + d);
  if (transposed) wt_order.push_back(1);
  for (int64_t d : rest) wt_order.push_back(2 + d);
  int64_t taps = 1;
  for (int64_t d : dims) taps *= w.size(2 + d);
  std::vector<int64_t> wshape = transposed ? std::vector<int64_t>{w.size(0) * taps, w.size(1)}
                                           : std::vector<int64_t>{w.size(0), w.size(1) * taps};
  for (int64_t d : rest) wshape.push_back(w.size(2 + d));
  at::Tensor wr = w.permute(wt_order).reshape(wshape);
  std::optional<at::Tensor> bias;
  if (b) bias = b->mul(count);
  at::Tensor y;
  CudnnTf32Guard tf32(false);
  if (rest.empty()) {  // every spatial dim summed: (N, Cin * taps) x (Cin * taps, Cout)
    const at::Tensor w2 = wr.reshape({wr.size(0), wr.size(1)});
    y = at::matmul(t.reshape({n, -1}), transposed ? w2 : w2.t());
    if (bias) y = y.add(*bias);
  } else {
    y = at::convolution(t.reshape(tshape).contiguous(), wr.contiguous(), bias, stride, padding, dilation, transposed,
                        output_padding, 1);
  }
  return y.reshape(out_shape);
}

// A 16-bit tensor converted to float (ATen's batch norm computes a 16-bit input's statistics in float);
// any other as it is.
inline at::Tensor float_of_16_bit(const at::Tensor& t) {
  const bool half = t.defined() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
  return half ? t.to(at::kFloat) : t;
}

// Batch norm's per-channel scale, weight / sqrt(var + eps) (1 / sqrt(...) where `weight` is
// undefined: no affine), for (x - mean) * scale + bias in a fused stage; eval mode's from the
// running variance, training mode's from the batch's (batch_norm_batch_stats). Float for 16-bit
// tensors (the stages take it as float: ATen's invstd is float there).
inline at::Tensor batch_norm_scale(const at::Tensor& var_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor var = float_of_16_bit(var_in), weight = float_of_16_bit(weight_in);
  const at::Tensor root = at::sqrt(at::add(var, eps));
  return weight.defined() ? at::div(weight, root) : at::reciprocal(root);
}

// Training-mode batch norm's statistics (the batch_stats stage): x's per-channel mean and biased
// variance over (batch, spatial), in one pass; returns {mean, scale} (batch_norm_scale). Where
// running_mean is defined, updates it and running_var in place as nn.BatchNorm does:
// (1 - factor) * running + factor * the batch's, the variance unbiased.
inline std::pair<at::Tensor, at::Tensor> batch_norm_batch_stats(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                                at::Tensor running_mean, at::Tensor running_var,
                                                                double factor) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  const int64_t n = x.numel() / x.size(1);
  TORCH_CHECK(n > 1, "Expected more than 1 value per channel when training, got input size ", x.sizes());
  const auto [var, mean] = at::var_mean(float_of_16_bit(x), dims, std::optional<at::Scalar>(0), /*keepdim=*/false);
  if (running_mean.defined() && running_mean.scalar_type() != at::kFloat) {
    // 16-bit running statistics: each updated in float and rounded once, as ATen's batch norm updates them
    const at::Tensor unbiased = at::mul(var, static_cast<double>(n) / static_cast<double>(n - 1));
    running_mean.copy_(at::add(at::mul(mean, factor), at::mul(running_mean.to(at::kFloat), 1.0 - factor)));
    running_var.copy_(at::add(at::mul(unbiased, factor), at::mul(running_var.to(at::kFloat), 1.0 - factor)));
  } else if (running_mean.defined()) {
    running_mean.mul_(1.0 - factor).add_(mean, factor);
    running_var.mul_(1.0 - factor).add_(at::mul(var, static_cast<double>(n) / static_cast<double>(n - 1)), factor);
  }
  return {mean, batch_norm_scale(var, weight, eps)};
}

// Weight of one sub-pixel phase: from the spatially flipped transposed-conv
// weight (Cin, Cout, K...), every stride-th tap from `start`, as (Cout, Cin, T...).
inline at::Tensor subpixel_weight(const at::Tensor& flipped, at::IntArrayRef start, at::IntArrayRef stride,
                                  at::IntArrayRef taps) {
  at::Tensor w = flipped;
  for (size_t d = 0; d < start.size(); ++d) {
    w = w.slice(2 + d, start[d], start[d] + stride[d] * (taps[d] - 1) + 1, stride[d]);
  }
  return w.transpose(0, 1);
}

#ifdef KGEN_WITH_CUDA
inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

inline void check_launch(cudaError_t err, const char* op, const char* stage) {
  TORCH_CHECK(err == cudaSuccess, op, ": ", stage, " kernel launch failed: ", cudaGetErrorString(err));
}
#endif

// Weights derived for a stage (re-laid and packed for a generated kernel; flipped,
// cut into sub-pixel phases, folded or put in the convolution's memory format for
// ATen's), kept while their source is unchanged: the same tensor (held, so its
// storage is not reused) with the same data on the same device (`.data =`, as
// Module.to moves a parameter, keeps the tensor and its version), the same
// version (in-place updates, an optimizer step, bump it), used on the same
// stream. Not kept while the stream captures a CUDA graph (a replay must
// re-derive weights updated in place since) or for inference tensors (no version
// counter): then derived afresh each call.
class WeightCache {
 public:
#ifdef KGEN_WITH_CUDA
  // A buffer of `floats` floats (whatever w's dtype: a 16-bit weight is packed as float) for `w` on
  // `stream`; `*stale` says whether the caller must (re)write it before use.
  at::Tensor get(const at::Tensor& w, int64_t floats, cudaStream_t stream, bool* stale) {
    std::lock_guard<std::mutex> lock(mutex_);
    *stale = true;
    if (!may_keep(w, stream)) return at::empty({floats}, w.options().dtype(at::kFloat));
    if (unchanged(w) && buffer_.numel() == floats) {
      *stale = false;
      return buffer_;
    }
    remember(w, stream);
    if (!buffer_.defined() || buffer_.numel() != floats || buffer_.device() != w.device()) {
      buffer_ = at::empty({floats}, w.options().dtype(at::kFloat));
    }
    return buffer_;
  }
#endif

  // The tensors `derive` makes from `w`, on any device (CUDA: on the current stream).
  std::vector<at::Tensor> derived(const at::Tensor& w, const std::function<std::vector<at::Tensor>()>& derive) {
    return derived(at::ArrayRef<at::Tensor>(w), derive);
  }

  // The tensors `derive` makes from `sources` (all on one device), kept while every one is unchanged.
  std::vector<at::Tensor> derived(at::ArrayRef<at::Tensor> sources, const std::function<std::vector<at::Tensor>()>& derive) {
    std::lock_guard<std::mutex> lock(mutex_);
    const void* stream = nullptr;
#ifdef KGEN_WITH_CUDA
    if (sources.front().is_cuda()) stream = at::cuda::getCurrentCUDAStream().stream();
#endif
    if (!may_keep(sources, stream)) return derive();
    if (!unchanged(sources)) {
      derived_ = derive();
      remember(sources, stream);
    }
    return derived_;
  }

 private:
  struct Source {
    at::Tensor tensor;  // held, so its storage is not reused
    int64_t version;
    const void* data;
    c10::Device device;
  };

  // (ArrayRef: a call with one tensor allocates nothing)
  bool may_keep(at::ArrayRef<at::Tensor> ws, const void* stream) const {
    for (const at::Tensor& w : ws) {
      if (w.is_inference()) return false;
    }
    if (!sources_.empty() && stream_ != stream) return false;
#ifdef KGEN_WITH_CUDA
    if (ws.front().is_cuda()) return !stream_capturing(static_cast<cudaStream_t>(const_cast<void*>(stream)), "weight cache");
#endif
    return true;
  }
  bool unchanged(at::ArrayRef<at::Tensor> ws) const {
    if (sources_.size() != ws.size()) return false;
    for (size_t i = 0; i < ws.size(); ++i) {
      const Source& s = sources_[i];
      const at::Tensor& w = ws[i];
      if (!s.tensor.is_same(w) || s.version != w._version() || s.data != w.data_ptr() || s.device != w.device()) return false;
    }
    return true;
  }
  void remember(at::ArrayRef<at::Tensor> ws, const void* stream) {
    sources_.clear();
    for (const at::Tensor& w : ws) sources_.push_back(Source{w, w._version(), w.data_ptr(), w.device()});
    stream_ = stream;
  }

  std::mutex mutex_;
  std::vector<Source> sources_;
  at::Tensor buffer_;
  std::vector<at::Tensor> derived_;
  const void* stream_ = nullptr;  // (each device's default stream is the same null handle: the device tells them apart)
};

}  // namespace kgen
