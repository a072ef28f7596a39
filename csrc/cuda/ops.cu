// The CUDA ops declared in ops.h, one file per op family (flatten.cuh, overflow.cuh, adam.cuh,
// accumulate.cuh) on the machinery of multi_tensor.cuh: each op is one kernel launch on the current
// stream for its whole tensor list (see [Note: the chunk table]; accumulate, one tensor pair, passes
// its pointers as kernel arguments instead).
//
// The op files are headers included here, so the extension is one nvcc translation unit: nvcc parses
// the ATen headers once per translation unit and per target architecture, and that parse is most of
// the build time (a file per op would triple it).
#include "accumulate.cuh"
#include "adam.cuh"
#include "flatten.cuh"
#include "overflow.cuh"
