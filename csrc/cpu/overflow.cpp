// sum_squares_and_overflow: the sum of squares of many tensors (for the gradient norm) and whether any
// element is inf/nan (for the loss scaler), in one parallel read of the data (engine/ops/overflow.py is
// the Python side and the torch fallback).
//
// Each element contributes v * v in double, where v = float(x) * float(scale) is rounded to float32
// (the square of a float is exact in double, so only the summation rounds). The overflow flag is about
// the elements x themselves: a finite x whose scaled value overflows float32 makes the sum inf without
// raising the flag. engine/ops/cpu_lib.py checks the tensors and passes their pointers here.
//
// Deterministic: the chunks have fixed boundaries (kChunk elements, never crossing a tensor), each
// chunk's partial sum depends only on its own elements, and the partials are added in chunk order
// after the parallel part, so the result is bitwise the same at any thread count (for a given build:
// the SIMD width sets the order of the additions within a chunk). ze_chunk_sum_squares hands back the
// partials themselves, so a caller can take them early (stage 3: as each gradient is reduced) and add
// them in the same order later, to the same total.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "lanes.h"
#include "ops.h"

namespace zero_engine {
namespace {

double sum_squares(const float* __restrict x, int64_t n, float scale) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i] * scale;  // the float32 product, widened: its square is exact in double
    acc += v * v;
  }
  return acc;
}


template <typename T>
double sum_squares(const T* x, int64_t n, float scale) {
  constexpr int64_t kTile = 256;
  alignas(64) float tile[kTile];
  double acc = 0.0;
  for (int64_t begin = 0; begin < n; begin += kTile) {
    const int64_t len = std::min(kTile, n - begin);
    load_floats(x + begin, tile, len);
    acc += sum_squares(tile, len, scale);
  }
  return acc;
}

template <typename T>
bool any_nonfinite(const char* ptr, int64_t n) {
  const T* x = reinterpret_cast<const T*>(ptr);
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(static_cast<float>(x[i]))) return true;
  }
  return false;
}

struct Chunk {
  const char* data;
  int64_t len;
  int32_t dtype;
};

// The partial sum of one chunk and its overflow flag. An inf/nan element always makes the partial
// sum inf/nan (inf * scale is inf, or nan when scale is 0), so a finite partial proves the chunk
// clean and only a non-finite one is read again to tell an inf/nan element from a scaled overflow.
std::pair<double, bool> reduce(const Chunk& c, float scale) {
  double sum;
  switch (c.dtype) {
    case kFloat32: sum = sum_squares(reinterpret_cast<const float*>(c.data), c.len, scale); break;
    case kBFloat16: sum = sum_squares(reinterpret_cast<const c10::BFloat16*>(c.data), c.len, scale); break;
    default: sum = sum_squares(reinterpret_cast<const c10::Half*>(c.data), c.len, scale); break;
  }
  if (std::isfinite(sum)) return {sum, false};
  switch (c.dtype) {
    case kFloat32: return {sum, any_nonfinite<float>(c.data, c.len)};
    case kBFloat16: return {sum, any_nonfinite<c10::BFloat16>(c.data, c.len)};
    default: return {sum, any_nonfinite<c10::Half>(c.data, c.len)};
  }
}

// Every chunk's partial sum into sums[c] (in chunk order); whether any element is inf/nan.
bool chunk_sums(const std::vector<Chunk>& chunks, double scale, int64_t threads, double* sums) {
  const float scale_f = static_cast<float>(scale);
  std::vector<char> bad(chunks.size());  // char, not vector<bool>: threads write neighbouring entries
  const int64_t n = static_cast<int64_t>(chunks.size());
  // Threads claim chunks from a shared counter (a thread slowed by other work on its core does not hold
  // the others up); which thread reduces a chunk does not change its partial sum.
  std::atomic<int64_t> next{0};
  on_threads(n < 2 ? 1 : threads, [&] {
    for (int64_t c = next++; c < n; c = next++) std::tie(sums[c], bad[c]) = reduce(chunks[c], scale_f);
  });
  bool overflow = false;
  for (int64_t c = 0; c < n; ++c) overflow = overflow || bad[c];
  return overflow;
}

std::pair<double, bool> sum_squares_and_overflow(const std::vector<Chunk>& chunks, double scale, int64_t threads) {
  std::vector<double> sums(chunks.size());
  const bool overflow = chunk_sums(chunks, scale, threads, sums.data());
  double total = 0.0;
  for (const double s : sums) total += s;  // in chunk order: see the note at the top
  return {total, overflow};
}

std::vector<Chunk> make_chunks(const void* const* data, const int64_t* numels, const int32_t* types, int64_t count) {
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < count; ++i) {
    const char* base = static_cast<const char*>(data[i]);
    for (int64_t begin = 0; begin < numels[i]; begin += kChunk) {
      chunks.push_back({base + begin * element_size(types[i]), std::min(kChunk, numels[i] - begin), types[i]});
    }
  }
  return chunks;
}

}  // namespace
}  // namespace zero_engine

double ze_sum_squares_and_overflow(const void* const* data, const int64_t* numels, const int32_t* types,
                                   int64_t count, double scale, int32_t threads, int32_t* overflow) {
  using namespace zero_engine;
  const auto [total, bad] = sum_squares_and_overflow(make_chunks(data, numels, types, count), scale, threads);
  *overflow = bad ? 1 : 0;
  return total;
}

int32_t ze_chunk_sum_squares(const void* const* data, const int64_t* numels, const int32_t* types, int64_t count,
                             double scale, int32_t threads, double* sums) {
  using namespace zero_engine;
  return chunk_sums(make_chunks(data, numels, types, count), scale, threads, sums) ? 1 : 0;
}
