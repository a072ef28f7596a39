// Widening bfloat16 / float16 into a float32 tile, the conversion both the copies (flatten.cpp) and the
// sum of squares (overflow.cpp) run first: a loop mixing 16-, 32- and 64-bit lanes vectorises poorly
// (bfloat16 ran at half the speed), so each tile is widened into L1 before the real work. c10's own
// conversion for bfloat16 (a loop GCC vectorises; the c10::BFloat16 class cast it does not); F16C for
// float16, 8 lanes with the same round-to-nearest-even as the scalar _cvtsh_ss that c10::Half uses on x86.
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

}  // namespace zero_engine
