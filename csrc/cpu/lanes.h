// Converting bfloat16 / float16 to and from float32 a tile at a time, the conversions the copies
// (flatten.cpp), the sum of squares (overflow.cpp) and accumulate (accumulate.cpp) run around their
// real work: a loop mixing 16-, 32- and 64-bit lanes vectorises poorly (bfloat16 ran at half the
// speed), so each tile is widened into L1 first (load_floats) and narrowed from L1 last (store_floats).
// Loops the compiler vectorises over c10's own scalar conversions for bfloat16 (so the rounding is
// torch's round-to-nearest-even; the c10::BFloat16 class cast does not vectorise); F16C for float16,
// 8 lanes with the same round-to-nearest-even as the scalar _cvtsh_ss / _cvtss_sh that c10::Half uses
// on x86.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace zero_engine {

inline void load_floats(const float* in, float* f, int64_t n) { std::memcpy(f, in, n * sizeof(float)); }

inline void load_floats(const c10::BFloat16* in, float* __restrict f, int64_t n) {
  const uint16_t* __restrict bits = reinterpret_cast<const uint16_t*>(in);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) f[i] = c10::detail::f32_from_bits(bits[i]);
}

inline void load_floats(const c10::Half* in, float* f, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
#endif
  for (; i < n; ++i) f[i] = static_cast<float>(in[i]);
}

inline void store_floats(const float* f, float* out, int64_t n) { std::memcpy(out, f, n * sizeof(float)); }

inline void store_floats(const float* __restrict f, c10::BFloat16* out, int64_t n) {
  uint16_t* __restrict bits = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = c10::detail::round_to_nearest_even(f[i]);
}

inline void store_floats(const float* f, c10::Half* out, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i half8 = _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half8);
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<c10::Half>(f[i]);
}

}  // namespace zero_engine
