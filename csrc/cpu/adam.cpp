// Fused Adam/AdamW step over many tensors in one call (Python side: engine/ops/adam.py).
//
// One pass per element: read the gradient once (fp32, bf16 or fp16), scale it by grad_scale
// (unscale x clip), update exp_avg, exp_avg_sq and the fp32 master, and write the bf16/fp16 copy
// of the new parameter. With bf16 gradients and a bf16 copy that is 28 bytes per parameter, where
// torch's fused AdamW (28 with fp32 gradients) plus separate unscale and cast passes moves 40 or more.
//
// Math per element in float32, in the order of torch.optim.Adam's single-tensor path; the scalar
// coefficients are computed once in double, as Python computes them there:
//   g = float(grad) * grad_scale;   L2 (Adam): g = g + wd * p;   AdamW: p = p * (1 - lr * wd)
//   m = lerp(m, g, 1 - beta1);      v = v * beta2 + (1 - beta2) * g * g
//   p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)          bc_i = 1 - beta_i^step (or 1)
//
// SIMD: AVX-512 intrinsics (16 floats per instruction) when built with AVX-512 F/BW/VL; the tail
// of a tensor uses masked loads/stores, so every element runs the same instruction sequence.
// Without AVX-512, a loop under `#pragma omp simd` left to the compiler (see the generic kernel).
// Threads: parallel_for (ops.h) over a table of kChunk-element chunks of all tensors (one parallel
// region per call, whatever the number of tensors); the math is element-wise, so the result is bitwise
// identical at any thread count. engine/ops/cpu_lib.py checks the tensors and passes their pointers.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZERO_ENGINE_ADAM_AVX512 1
#include <immintrin.h>
#endif

#include "ops.h"

namespace zero_engine {
namespace {

struct Coeffs {
  float grad_scale, l2_decay, adamw_decay, lerp_coeff, beta2, one_minus_beta2;
  float bc2_sqrt, eps, neg_step_size;
  bool l2, adamw, lerp_small;
};

// One tensor's raw pointers; lp is null when no low-precision copy is wanted.
struct Slot {
  float *p, *m, *v;
  const void* g;
  void* lp;
  int32_t g_type, lp_type;
};

struct Chunk {
  int64_t slot, begin, size;
};

struct NoCopy {};  // the "no low-precision copy" case of the kernels' L parameter

// Scalar form of the update (the generic kernel's body; the AVX-512 kernel is the same on 16 lanes).
// Fused multiply-adds sit exactly where torch's CPU kernels have them: add(alpha) is fma(b, alpha, a),
// the vectorised lerp is fma(w, end - start, start) (w < 0.5) or fma(w - 1, end - start, end), and
// addcmul's `self + s * t1 * t2` compiles to fma(s * t1, t2, self) in torch's GCC build; everything
// else is a separate rounding. m and v then come out bitwise torch's (AVX-512 kernel, pip torch).
// The parameter can differ by an ulp of the update: torch's CPU sqrt goes through MKL and is one ulp
// off the correctly rounded sqrt used here on about 0.6% of inputs.
inline void update_one(const Coeffs c, float g, float& p, float& m, float& v) {
  g = g * c.grad_scale;
  g = c.l2 ? std::fma(p, c.l2_decay, g) : g;  // selects, not branches: the loop stays vectorisable
  p = c.adamw ? p * c.adamw_decay : p;
  m = std::fma(c.lerp_coeff, g - m, c.lerp_small ? m : g);
  v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = p + c.neg_step_size * m / denom;
}

#if defined(ZERO_ENGINE_ADAM_AVX512)

// GCC contracts a product and a following add into one FMA (-ffp-contract=fast); torch rounds the
// product in a separate op, so the product goes through this empty asm, which the compiler must
// treat as an opaque rounded value.
inline __m512 rounded(__m512 x) {
  asm("" : "+v"(x));
  return x;
}

inline __m512 load16(const float* x, __mmask16 k) { return _mm512_maskz_loadu_ps(k, x); }
inline __m512 load16(const c10::BFloat16* x, __mmask16 k) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* x, __mmask16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, x)); }

// The low-precision copy is only written: a full, 32-byte-aligned group goes out as a streaming store,
// which skips reading the destination line first (2 of the 30 bytes per parameter; ~4% measured).
inline void store_halves(void* y, __mmask16 k, __m256i h) {
  if (k == 0xFFFF && (reinterpret_cast<uintptr_t>(y) & 31) == 0) {
    _mm256_stream_si256(static_cast<__m256i*>(y), h);
  } else {
    _mm256_mask_storeu_epi16(y, k, h);
  }
}

inline void store16(NoCopy*, __mmask16, __m512) {}
// Round to nearest even with integer ops, bit for bit c10's float->bfloat16 (NaN -> 0x7FC0);
// avx512_bf16's vcvtneps2bf16 would keep NaN payloads instead, and is not on every AVX-512 CPU.
inline void store16(c10::BFloat16* y, __mmask16 k, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  store_halves(y, k, _mm512_cvtepi32_epi16(top));
}
inline void store16(c10::Half* y, __mmask16 k, __m512 x) {
  store_halves(y, k, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename G, typename L>
void adam_kernel(const Coeffs c, float* p, float* m, float* v, const G* g, L* lp, int64_t n) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale), l2_decay = _mm512_set1_ps(c.l2_decay);
  const __m512 adamw_decay = _mm512_set1_ps(c.adamw_decay), lerp_coeff = _mm512_set1_ps(c.lerp_coeff);
  const __m512 beta2 = _mm512_set1_ps(c.beta2), one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const bool l2 = c.l2, adamw = c.adamw, lerp_small = c.lerp_small;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    __m512 gv = rounded(_mm512_mul_ps(load16(g + i, k), grad_scale));
    __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
    __m512 mv = _mm512_maskz_loadu_ps(k, m + i);
    __m512 vv = _mm512_maskz_loadu_ps(k, v + i);
    if (l2) gv = _mm512_fmadd_ps(pv, l2_decay, gv);
    if (adamw) pv = rounded(_mm512_mul_ps(pv, adamw_decay));
    mv = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(gv, mv), lerp_small ? mv : gv);
    vv = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, gv), gv, rounded(_mm512_mul_ps(vv, beta2)));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), bc2_sqrt), eps);
    pv = _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(neg_step_size, mv), denom));
    _mm512_mask_storeu_ps(p + i, k, pv);
    _mm512_mask_storeu_ps(m + i, k, mv);
    _mm512_mask_storeu_ps(v + i, k, vv);
    store16(lp + i, k, pv);
  }
  if constexpr (!std::is_same_v<L, NoCopy>) _mm_sfence();  // order the streaming stores before returning
}

#else  // no AVX-512: update_one in a loop for the compiler to vectorise. The coefficients are a local
       // copy (stores through p cannot alias them) and the flags are selects. GCC vectorises this
       // loop only with -fno-math-errno (torch's own flag; else sqrtf keeps an errno branch) and may
       // fuse a product into an add that torch rounds separately (an ulp, never thread-dependent).

template <typename G, typename L>
void adam_kernel(const Coeffs c, float* p, float* m, float* v, const G* g, L* lp, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    update_one(c, static_cast<float>(g[i]), pi, mi, vi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_same_v<L, NoCopy>) lp[i] = L(pi);  // c10's round-to-nearest-even
  }
}

#endif

template <typename G>
void run_chunk_typed(const Coeffs& c, const Slot& s, int64_t begin, int64_t n) {
  const G* g = static_cast<const G*>(s.g) + begin;
  float *p = s.p + begin, *m = s.m + begin, *v = s.v + begin;
  if (s.lp == nullptr) {
    adam_kernel(c, p, m, v, g, static_cast<NoCopy*>(nullptr), n);
  } else if (s.lp_type == kBFloat16) {
    adam_kernel(c, p, m, v, g, static_cast<c10::BFloat16*>(s.lp) + begin, n);
  } else {
    adam_kernel(c, p, m, v, g, static_cast<c10::Half*>(s.lp) + begin, n);
  }
}

void run_chunk(const Coeffs& c, const Slot& s, int64_t begin, int64_t n) {
  switch (s.g_type) {
    case kFloat32: return run_chunk_typed<float>(c, s, begin, n);
    case kBFloat16: return run_chunk_typed<c10::BFloat16>(c, s, begin, n);
    default: return run_chunk_typed<c10::Half>(c, s, begin, n);
  }
}

// torch's rule (at::internal::GRAIN_SIZE): below this many elements a parallel region costs more than
// it saves.
constexpr int64_t kGrainSize = 32768;

}  // namespace
}  // namespace zero_engine

void ze_adam_step(float* const* params, const void* const* grads, float* const* exp_avgs,
                  float* const* exp_avg_sqs, void* const* lp_params, const int64_t* numels,
                  const int32_t* grad_types, const int32_t* lp_types, int64_t count, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int32_t adamw_mode, int64_t step,
                  int32_t bias_correction, double grad_scale, int32_t threads) {
  using namespace zero_engine;
  std::vector<Slot> slots(count);
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const bool lp = lp_params != nullptr;
    slots[i] = {params[i], exp_avgs[i], exp_avg_sqs[i], grads[i], lp ? lp_params[i] : nullptr, grad_types[i],
                lp ? lp_types[i] : kFloat32};
    total += numels[i];
    for (int64_t begin = 0; begin < numels[i]; begin += kChunk) {
      chunks.push_back({i, begin, std::min(kChunk, numels[i] - begin)});
    }
  }

  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  Coeffs c{};
  c.grad_scale = static_cast<float>(grad_scale);
  c.l2 = adamw_mode == 0 && weight_decay != 0.0;
  c.adamw = adamw_mode != 0 && weight_decay != 0.0;
  c.l2_decay = static_cast<float>(weight_decay);
  c.adamw_decay = static_cast<float>(1.0 - lr * weight_decay);
  const auto lerp_weight = static_cast<float>(1.0 - beta1);  // torch: lerp_(grad, 1 - beta1)
  c.lerp_small = std::abs(lerp_weight) < 0.5f;
  c.lerp_coeff = c.lerp_small ? lerp_weight : lerp_weight - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / bc1));

  const auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) run_chunk(c, slots[chunks[i].slot], chunks[i].begin, chunks[i].size);
  };
  const auto num_chunks = static_cast<int64_t>(chunks.size());
  parallel_for(num_chunks, total < kGrainSize ? 1 : threads, run);
}
