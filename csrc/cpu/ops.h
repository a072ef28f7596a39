// Declarations shared by the CPU translation units of the extension (one registration function per
// op family; bindings.cpp calls them all into one Python module).
#pragma once

#include <torch/extension.h>

namespace zero_engine {

void register_flatten(pybind11::module_& m);
void register_overflow(pybind11::module_& m);
void register_adam(pybind11::module_& m);
void register_arena(pybind11::module_& m);
void register_accumulate(pybind11::module_& m);

// The widest SIMD instruction set this build was compiled for ("avx512", "avx2", "scalar").
const char* simd_level();

// Elements per work chunk: a multiple of every SIMD width, small enough to stay in L2, large enough
// to amortise the parallel_for overhead. Work split on these boundaries gives bitwise-identical
// results at any thread count.
constexpr int64_t kChunk = 1 << 14;

}  // namespace zero_engine
