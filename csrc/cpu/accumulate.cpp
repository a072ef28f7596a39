// accumulate: dst += float32(src) * scale in place, one 1-D segment into an accumulator (the gloo
// reduce-scatter adds each arriving low-precision segment this way; engine/ops/accumulate.py is the
// Python side and the torch fallback).
//
// [Note: accumulate semantics] every element becomes to_dst(float(dst) + float(src) * float(scale)):
// the scale is rounded to float32, the product is a float32 product rounded on its own (no fused
// multiply-add, exactly torch's `src.float() * scale`), the sum a float32 sum, and for a bfloat16 /
// float16 dst the float32 sum is rounded once to dst's dtype to nearest even (c10's conversions,
// torch's own). scale == 1.0 skips the multiply (it is exact). Pairs: dst float32 with src float32,
// bfloat16 or float16; dst bfloat16 / float16 with src of the same dtype. So the torch fallback
// gives bitwise the same results (NaN payloads aside).
//
// No FMA: GCC contracts a product and an add in the same loop body into one FMA (-ffp-contract=fast
// is its default for C++), which rounds once where torch rounds twice. Every product here is written
// to an L1 tile by one loop and added by another; GCC does not fuse loops, so nothing is contracted.
//
// Threads: a segment is usually 64 KiB - 4 MiB, so below kParallelElements the kernel runs on the
// calling thread with no parallel region and no allocation; above, threads claim kChunk-element
// chunks from a shared counter as in flatten.cpp. Element-wise math: bitwise the same at any thread
// count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "lanes.h"
#include "ops.h"

namespace zero_engine {
namespace {

// Below this many elements one thread does the whole segment. Measured here (bf16 src into fp32 dst,
// best of many runs, 1 vs 2 threads): 128 Ki elements 16.0 vs 11.3 us, 256 Ki 30.2 vs 24.2 us, 512 Ki
// 84.6 vs 48.7 us, 4 Mi 879 vs 509 us. Below 512 Ki the second thread gains at most a quarter, and a
// parallel region is a risk on a busy machine: when the other threads' cores are taken (training
// compute beside the communication), each region waited milliseconds for a time slice.
constexpr int64_t kParallelElements = 1 << 19;

constexpr int64_t kTile = 256;  // floats per L1 tile: 1 KiB

using Kernel = void (*)(void* dst, const void* src, int64_t n, bool scaled, float scale);

// tile[i] = float(src[i]) * scale (or just float(src[i])) for one tile; returns where the addends are
// (the source itself for an unscaled float32 source).
template <typename Src>
const float* addends(const Src* src, float* __restrict tile, int64_t len, bool scaled, float scale) {
  if constexpr (std::is_same_v<Src, float>) {
    if (!scaled) return src;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) tile[i] = src[i] * scale;
  } else {
    load_floats(src, tile, len);
    if (scaled) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) tile[i] *= scale;
    }
  }
  return tile;
}

// float32 dst: dst[i] += addend[i], the product (if any) already rounded in the tile.
template <typename Src>
void accumulate_f32(void* dst_ptr, const void* src_ptr, int64_t n, bool scaled, float scale) {
  float* dst = static_cast<float*>(dst_ptr);
  const Src* src = static_cast<const Src*>(src_ptr);
  if constexpr (std::is_same_v<Src, float>) {
    if (!scaled) {  // no product to round: one loop straight through (dst may be src itself)
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
      return;
    }
  }
  alignas(64) float tile[kTile];
  for (int64_t begin = 0; begin < n; begin += kTile) {
    const int64_t len = std::min(kTile, n - begin);
    const float* add = addends(src + begin, tile, len, scaled, scale);
    float* out = dst + begin;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[i] += add[i];
  }
}

// bfloat16 / float16 dst with src of the same dtype: widen both tiles, add in float32, narrow once.
template <typename T>
void accumulate_lp(void* dst_ptr, const void* src_ptr, int64_t n, bool scaled, float scale) {
  T* dst = static_cast<T*>(dst_ptr);
  const T* src = static_cast<const T*>(src_ptr);
  alignas(64) float acc[kTile];
  alignas(64) float tile[kTile];
  for (int64_t begin = 0; begin < n; begin += kTile) {
    const int64_t len = std::min(kTile, n - begin);
    load_floats(dst + begin, acc, len);
    addends(src + begin, tile, len, scaled, scale);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) acc[i] += tile[i];
    store_floats(acc, dst + begin, len);
  }
}

// torch's name of a dtype ("float32", "bfloat16", "float64", ...), as the Python checks print it.
std::string_view dtype_name(at::ScalarType t) { return c10::getDtypeNames(t).first; }

// The kernel for (dst, src) dtypes, or nullptr for a pair the op does not take.
Kernel kernel_for(at::ScalarType dst, at::ScalarType src) {
  if (dst == at::kFloat) {
    switch (src) {
      case at::kFloat: return accumulate_f32<float>;
      case at::kBFloat16: return accumulate_f32<c10::BFloat16>;
      case at::kHalf: return accumulate_f32<c10::Half>;
      default: return nullptr;
    }
  }
  if (dst == src && dst == at::kBFloat16) return accumulate_lp<c10::BFloat16>;
  if (dst == src && dst == at::kHalf) return accumulate_lp<c10::Half>;
  return nullptr;
}

void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "accumulate: ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "accumulate: ", name, " is on ", t.device(),
              "; the compiled op takes CPU tensors");
  TORCH_CHECK(t.is_contiguous(), "accumulate: ", name, " is not contiguous (stride ", t.strides(),
              "); pass .contiguous()");
  TORCH_CHECK(t.dim() == 1, "accumulate: ", name, " must be 1-D, got shape ", t.sizes(),
              "; pass .view(-1) of a contiguous tensor");
}

void accumulate(const at::Tensor& dst, const at::Tensor& src, double scale) {
  check_tensor(dst, "dst");
  check_tensor(src, "src");
  const Kernel kernel = kernel_for(dst.scalar_type(), src.scalar_type());
  TORCH_CHECK(kernel != nullptr, "accumulate: dst ", dtype_name(dst.scalar_type()), " with src ",
              dtype_name(src.scalar_type()), " is not supported; supported: dst float32 with src float32, "
              "bfloat16 or float16, or dst bfloat16 / float16 with src of the same dtype");
  const int64_t n = dst.numel();
  TORCH_CHECK(src.numel() == n, "accumulate: dst.numel() = ", n, " != src.numel() = ", src.numel(),
              "; dst and src must have the same number of elements");
  char* dst_ptr = static_cast<char*>(dst.data_ptr());
  const char* src_ptr = static_cast<const char*>(src.data_ptr());
  const int64_t dst_bytes = dst.element_size(), src_bytes = src.element_size();
  const bool disjoint = dst_ptr + n * dst_bytes <= src_ptr || src_ptr + n * src_bytes <= dst_ptr;
  TORCH_CHECK(n == 0 || disjoint || (dst_ptr == src_ptr && dst_bytes == src_bytes),
              "accumulate: dst and src partially overlap in memory; pass disjoint tensors (or the same one)");
  const bool scaled = scale != 1.0;
  const float scale_f = static_cast<float>(scale);
  if (n < kParallelElements) {  // the common segment: no parallel region
    kernel(dst_ptr, src_ptr, n, scaled, scale_f);
    return;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int64_t workers = std::min<int64_t>(chunks, at::get_num_threads());
  // As flatten.cpp: threads claim chunks from a shared counter, so one slowed by other work on its core
  // does not hold the others up.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next++; c < chunks; c = next++) {
      const int64_t begin = c * kChunk;
      kernel(dst_ptr + begin * dst_bytes, src_ptr + begin * src_bytes, std::min(kChunk, n - begin), scaled,
             scale_f);
    }
  });
}

}  // namespace

void register_accumulate(pybind11::module_& m) {
  namespace py = pybind11;
  // The GIL is released while adding, so Python threads (e.g. the communication thread) keep running.
  m.def("accumulate", &accumulate, "dst += float(src) * scale in place (float32 math, one rounding into dst)",
        py::arg("dst"), py::arg("src"), py::arg("scale") = 1.0, py::call_guard<py::gil_scoped_release>());
}

}  // namespace zero_engine
