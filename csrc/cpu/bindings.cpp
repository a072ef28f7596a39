// The Python module of the CPU extension: every op family registers its functions here.
#include "ops.h"

namespace zero_engine {

const char* simd_level() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace zero_engine

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero-engine CPU ops: fused flatten/cast/scale copies, overflow check + sum of squares, "
            "fused Adam, memory arena, accumulate (dst += src * scale)";
  m.def("simd_level", &zero_engine::simd_level, "SIMD instruction set the extension was built for");
  zero_engine::register_flatten(m);
  zero_engine::register_overflow(m);
  zero_engine::register_adam(m);
  zero_engine::register_arena(m);
  zero_engine::register_accumulate(m);
}
