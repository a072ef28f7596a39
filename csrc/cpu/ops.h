// What the CPU translation units share: the C entry points of the library, the dtype codes, the chunk
// size and the two ways the ops use threads.
//
// [Note: a plain C++ library behind a ctypes binding]
// The kernels take raw pointers, element counts and dtype codes; engine/ops/cpu_lib.py checks every
// argument (dtype, device, contiguity, sizes, ranges) and calls these functions through ctypes, which
// releases the GIL for the call. No torch/extension.h (pybind11 and all of ATen: ~22 s per translation
// unit at -O3 on a 2-core machine) and no link against libtorch: the only torch headers are c10's
// header-only bfloat16/float16 conversions (lanes.h), so a clean build takes seconds. Threads come from
// OpenMP, the runtime torch's own CPU kernels use (one libgomp in the process); the binding passes
// torch.get_num_threads() as `threads`, so torch.set_num_threads governs these ops as it did
// at::parallel_for.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace zero_engine {

// dtype codes of the C API; engine/ops/cpu_lib.py DTYPE_CODES is the same table.
enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline int64_t element_size(int32_t dtype) { return dtype == kFloat32 ? 4 : 2; }

// Elements per work chunk: a multiple of every SIMD width, small enough to stay in L2, large enough
// to amortise the threading overhead. Work split on these boundaries gives bitwise-identical results
// at any thread count.
constexpr int64_t kChunk = 1 << 14;

// Runs body() once on each of `threads` threads (the calling thread is one of them); one thread: no
// parallel region at all. The bodies share work through their own counter (see flatten.cpp).
template <typename F>
void on_threads(int64_t threads, const F& body) {
  if (threads <= 1) {
    body();
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  body();
}

// fn(lo, hi) over contiguous slices of [0, n), one per thread, as at::parallel_for(0, n, 1, fn) splits
// a range under OpenMP; a single thread runs fn(0, n) inline.
template <typename F>
void parallel_for(int64_t n, int64_t threads, const F& fn) {
  const int64_t use = std::min(n, threads);
  if (use <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(use))
  {
    const int64_t team = omp_get_num_threads(), per = (n + team - 1) / team;
    const int64_t lo = omp_get_thread_num() * per, hi = std::min(n, lo + per);
    if (lo < hi) fn(lo, hi);
  }
}

}  // namespace zero_engine

// The C API, bound in engine/ops/cpu_lib.py. Pointers and sizes are checked there; `threads` >= 1.
extern "C" {

// The widest SIMD instruction set this build was compiled for ("avx512", "avx2", "scalar").
const char* ze_simd_level();

// outs[i][:numels[i]] = cast(float(ins[i][:numels[i]]) * float(scale)) for every i (flatten.cpp).
void ze_copy(const void* const* ins, void* const* outs, const int64_t* numels, const int32_t* in_types,
             const int32_t* out_types, int64_t count, double scale, int32_t threads);

// The sum of (float(x) * float(scale))^2 over all elements in double; *overflow = any element inf/nan
// (overflow.cpp).
double ze_sum_squares_and_overflow(const void* const* data, const int64_t* numels, const int32_t* types,
                                   int64_t count, double scale, int32_t threads, int32_t* overflow);

// The partial sums ze_sum_squares_and_overflow adds up, one per chunk of kChunk elements (a tensor's last
// chunk may be shorter; no chunk spans two tensors), into sums[0 .. sum of ceil(numels[i] / kChunk));
// returns 1 when any element is inf/nan, else 0 (overflow.cpp).
int32_t ze_chunk_sum_squares(const void* const* data, const int64_t* numels, const int32_t* types, int64_t count,
                             double scale, int32_t threads, double* sums);

// dst[:n] += float(src[:n]) * float(scale) (accumulate.cpp); returns -1 for a dtype pair it does not
// take, else 0.
int32_t ze_accumulate(void* dst, const void* src, int64_t n, int32_t dst_type, int32_t src_type, double scale,
                      int32_t threads);

// One fused Adam/AdamW step of `count` tensors (adam.cpp); lp_params and lp_types null (no
// low-precision copies), or one bfloat16/float16 tensor per param.
void ze_adam_step(float* const* params, const void* const* grads, float* const* exp_avgs,
                  float* const* exp_avg_sqs, void* const* lp_params, const int64_t* numels,
                  const int32_t* grad_types, const int32_t* lp_types, int64_t count, double lr, double beta1,
                  double beta2, double eps, double weight_decay, int32_t adamw_mode, int64_t step,
                  int32_t bias_correction, double grad_scale, int32_t threads);

// The memory arena (arena.cpp): a pre-touched buffer of `capacity` bytes (a multiple of 64) and its
// best-fit free list. create returns null when the memory cannot be had; take returns the offset of a
// block of `size` bytes (a multiple of 64), or -1 when none fits and then writes the usage that
// refused it; usage writes 6 numbers: capacity, in_use, peak_in_use, largest_free, free_blocks,
// allocations. All but create and destroy are thread-safe.
void* ze_arena_create(int64_t capacity, int32_t threads);
void ze_arena_destroy(void* arena);
void* ze_arena_base(void* arena);
int64_t ze_arena_take(void* arena, int64_t size, int64_t* usage_if_full);
void ze_arena_give_back(void* arena, int64_t offset, int64_t size);
void ze_arena_usage(void* arena, int64_t* out);

// Asynchronous file I/O (aio.cpp; engine/ops/aio.py): a pool of `threads` threads moving transfers in
// blocks of `block_size` bytes, `claim_blocks` blocks per turn of a thread. create returns null when a
// thread cannot be started; destroy finishes every submitted transfer first. submit returns the
// transfer's id (the buffer must stay valid until wait returns); wait blocks until it is done and
// writes 6 numbers: bytes moved, of which through O_DIRECT, errno of the first failure (0: end of
// file), its block's file offset (-1: none), that block's size and bytes moved; it returns -1 for an
// id not pending, else 0. poll returns 1 when done, 0 when not, -1 for an id not pending.
void* ze_aio_create(int32_t threads, int64_t block_size, int32_t claim_blocks);
void ze_aio_destroy(void* pool);
int64_t ze_aio_submit(void* pool, int32_t write, int32_t fd, int32_t direct_fd, void* buffer, int64_t nbytes,
                      int64_t offset);
int64_t ze_aio_wait(void* pool, int64_t id, int64_t* outcome);
int32_t ze_aio_poll(void* pool, int64_t id);

}  // extern "C"
