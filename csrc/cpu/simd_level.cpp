// Which SIMD instruction set the library was compiled for (-march=native picks it), for reports and
// `python -m engine.report`; the kernels choose their code paths by the same macros at compile time.
#include "ops.h"

const char* ze_simd_level() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}
