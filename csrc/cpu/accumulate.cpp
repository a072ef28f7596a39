// accumulate: dst += float32(src) * scale in place, one 1-D segment into an accumulator (the gloo
// reduce-scatter adds each arriving low-precision segment this way; engine/ops/accumulate.py is the
// Python side and the torch fallback, engine/ops/cpu_lib.py checks the tensors and passes their pointers).
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
#include <algorithm>
#include <atomic>
#include <cstdint>
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

// The kernel for (dst, src) dtypes, or nullptr for a pair the op does not take.
Kernel kernel_for(int32_t dst, int32_t src) {
  if (dst == kFloat32) {
    switch (src) {
      case kFloat32: return accumulate_f32<float>;
      case kBFloat16: return accumulate_f32<c10::BFloat16>;
      case kFloat16: return accumulate_f32<c10::Half>;
      default: return nullptr;
    }
  }
  if (dst == src && dst == kBFloat16) return accumulate_lp<c10::BFloat16>;
  if (dst == src && dst == kFloat16) return accumulate_lp<c10::Half>;
  return nullptr;
}

}  // namespace
}  // namespace zero_engine

int32_t ze_accumulate(void* dst, const void* src, int64_t n, int32_t dst_type, int32_t src_type, double scale,
                      int32_t threads) {
  using namespace zero_engine;
  const Kernel kernel = kernel_for(dst_type, src_type);
  if (kernel == nullptr) return -1;  // cpu_lib.py refuses such a pair by name before calling
  char* dst_ptr = static_cast<char*>(dst);
  const char* src_ptr = static_cast<const char*>(src);
  const int64_t dst_bytes = element_size(dst_type), src_bytes = element_size(src_type);
  const bool scaled = scale != 1.0;
  const float scale_f = static_cast<float>(scale);
  if (n < kParallelElements) {  // the common segment: no parallel region
    kernel(dst_ptr, src_ptr, n, scaled, scale_f);
    return 0;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int64_t workers = std::min<int64_t>(chunks, threads);
  // As flatten.cpp: threads claim chunks from a shared counter, so one slowed by other work on its core
  // does not hold the others up.
  std::atomic<int64_t> next{0};
  on_threads(workers, [&] {
    for (int64_t c = next++; c < chunks; c = next++) {
      const int64_t begin = c * kChunk;
      kernel(dst_ptr + begin * dst_bytes, src_ptr + begin * src_bytes, std::min(kChunk, n - begin), scaled,
             scale_f);
    }
  });
  return 0;
}
