// copy_into / copy_out: many tensors into / out of ranges of one flat 1-D buffer, with a dtype cast and a
// scale, in one parallel pass (engine/ops/flatten.py is the Python side and the torch fallback;
// engine/ops/cpu_lib.py checks the tensors and ranges and passes each pair's two pointers here).
//
// [Note: copy semantics] every element becomes cast_to_out_dtype(float(in) * float(scale)): the
// multiply is done in float32 with the scale rounded to float32 first, exactly what torch does for a
// float32 tensor times a Python float; the casts are c10::BFloat16 / c10::Half's round-to-nearest-even,
// torch's own. scale == 1.0 skips the multiply (a pure copy or cast; memcpy when the dtypes match).
// So the torch fallback gives bitwise the same results (NaN payloads aside).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "lanes.h"
#include "ops.h"

namespace zero_engine {
namespace {

using Kernel = void (*)(const void* in, void* out, int64_t n, bool scaled, float scale, bool stream);

// Outputs at least this large are written with streaming (non-temporal) stores. Measured here
// (bf16 -> fp32 x scale, 2 threads): at 16 MiB out the bucket stays in cache and both ways take the
// same time; at 64 MiB ordinary stores ran 5.95 ms (each written line is first read in) and streaming
// ones 3.28 ms; at 512 MiB 40.1 vs 25.2 ms. A bucket that large leaves the cache before anyone reads
// it back anyway.
constexpr int64_t kStreamBytes = 16 << 20;

// One tensor's share of the work: its elements at `in` go to `out`.
struct Job {
  const char* in;
  char* out;
  int64_t numel;
  int64_t in_bytes;   // element sizes, to step into the job chunk by chunk
  int64_t out_bytes;
  Kernel kernel;
};

// Conversions to and from float32, a tile at a time: load_floats / store_floats in lanes.h.

// Writes `bytes` from `src` (a tile in L1) to `dst` with streaming stores from the first 64-byte
// boundary of `dst` on; the unaligned head and the tail go through memcpy. The caller fences.
void stream_bytes(char* dst, const char* src, int64_t bytes) {
#if defined(__AVX512F__)
  constexpr int64_t kVec = 64;
#elif defined(__AVX2__)
  constexpr int64_t kVec = 32;
#else
  constexpr int64_t kVec = 0;
#endif
  if constexpr (kVec == 0) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const int64_t head = std::min<int64_t>(bytes, (kVec - reinterpret_cast<uintptr_t>(dst) % kVec) % kVec);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + kVec <= bytes; i += kVec) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(__AVX2__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#endif
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

template <typename In, typename Out>
void convert(const void* in_ptr, void* out_ptr, int64_t n, bool scaled, float scale, bool stream) {
  const In* in = static_cast<const In*>(in_ptr);
  Out* out = static_cast<Out*>(out_ptr);
  if constexpr (std::is_same_v<In, Out>) {
    if (!scaled) {  // a plain copy: glibc's memcpy picks its own streaming threshold (on par with torch.cat)
      std::memcpy(out, in, n * sizeof(In));
      return;
    }
  }
  if constexpr (std::is_same_v<In, float> && std::is_same_v<Out, float>) {  // no conversion: one loop
    if (!stream) {
      const float* __restrict src = in;
      float* __restrict dst = out;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
      return;
    }
  }
  // Through float32 tiles that stay in L1: convert in, scale, convert out, and (streaming) copy the
  // output tile to memory with non-temporal stores. Streaming tiles start on the destination's cache
  // lines (the few elements before the first line boundary are stored normally): tiles that straddle
  // lines ran at half the speed (a 64-tensor bucket at odd offsets: 5.3 ms against 2.5 ms aligned).
  constexpr int64_t kTile = 256;
  alignas(64) float tile[kTile];
  alignas(64) Out out_tile[kTile];
  auto tiles = [&](int64_t first, int64_t last, bool streaming) {
    for (int64_t begin = first; begin < last; begin += kTile) {
      const int64_t len = std::min(kTile, last - begin);
      const float* floats = tile;
      if constexpr (std::is_same_v<In, float>) {  // already float32: no widening copy
        if (scaled) {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) tile[i] = in[begin + i] * scale;
        } else {
          floats = in + begin;
        }
      } else {
        load_floats(in + begin, tile, len);
        if (scaled) {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) tile[i] *= scale;
        }
      }
      if (streaming) {
        store_floats(floats, out_tile, len);
        stream_bytes(reinterpret_cast<char*>(out + begin), reinterpret_cast<const char*>(out_tile),
                     len * static_cast<int64_t>(sizeof(Out)));
      } else {
        store_floats(floats, out + begin, len);
      }
    }
  };
  int64_t head = 0;
  if (stream) {
    const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % 64);
    head = std::min<int64_t>(n, misaligned == 0 ? 0 : (64 - misaligned) / static_cast<int64_t>(sizeof(Out)));
  }
  tiles(0, head, false);
  tiles(head, n, stream);
}

template <typename In>
Kernel kernel_to(int32_t out) {
  switch (out) {
    case kFloat32: return convert<In, float>;
    case kBFloat16: return convert<In, c10::BFloat16>;
    default: return convert<In, c10::Half>;  // the dtypes were checked before
  }
}

Kernel kernel_for(int32_t in, int32_t out) {
  switch (in) {
    case kFloat32: return kernel_to<float>(out);
    case kBFloat16: return kernel_to<c10::BFloat16>(out);
    default: return kernel_to<c10::Half>(out);
  }
}

// Splits the jobs into kChunk-element chunks (never crossing a tensor) and runs them all in one
// parallel region, so many small tensors and one huge one spread over the threads alike.
void run(const std::vector<Job>& jobs, double scale, int64_t threads) {
  struct Chunk {
    const Job* job;
    int64_t begin;
    int64_t len;
  };
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (const Job& job : jobs) {
    for (int64_t begin = 0; begin < job.numel; begin += kChunk) {
      chunks.push_back({&job, begin, std::min(kChunk, job.numel - begin)});
    }
    total += job.numel;
  }
  const bool scaled = scale != 1.0;
  const float scale_f = static_cast<float>(scale);
  int64_t out_bytes = 0;
  for (const Job& job : jobs) out_bytes += job.numel * job.out_bytes;
  const bool stream = out_bytes >= kStreamBytes;
  // Threads claim chunks from a shared counter instead of a fixed split, so a thread slowed by other
  // work on its core does not hold the others up. Below two chunks of work, one thread does it all.
  const int64_t workers = total < 2 * kChunk ? 1 : threads;
  std::atomic<int64_t> next{0};
  on_threads(workers, [&] {
    for (int64_t c = next++; c < static_cast<int64_t>(chunks.size()); c = next++) {
      const Chunk& chunk = chunks[c];
      const Job& job = *chunk.job;
      job.kernel(job.in + chunk.begin * job.in_bytes, job.out + chunk.begin * job.out_bytes, chunk.len, scaled,
                 scale_f, stream);
    }
    if (stream) _mm_sfence();  // this thread's streaming stores are visible before the op returns
  });
}

}  // namespace
}  // namespace zero_engine

void ze_copy(const void* const* ins, void* const* outs, const int64_t* numels, const int32_t* in_types,
             const int32_t* out_types, int64_t count, double scale, int32_t threads) {
  using namespace zero_engine;
  std::vector<Job> jobs;
  jobs.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    jobs.push_back({static_cast<const char*>(ins[i]), static_cast<char*>(outs[i]), numels[i],
                    element_size(in_types[i]), element_size(out_types[i]), kernel_for(in_types[i], out_types[i])});
  }
  run(jobs, scale, threads);
}
