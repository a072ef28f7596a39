// sum_squares_and_overflow: the sum of squares of many tensors and whether any element is inf/nan, in
// one read of the data and one launch (the CUDA twin of csrc/cpu/overflow.cpp).
//
// Part of the single translation unit ops.cu (see there), not a standalone header.
#pragma once

#include "multi_tensor.cuh"
#include "ops.h"

#include <cuda_runtime.h>

namespace zero_engine::gpu {
namespace {

struct ReadDesc {
  const void* data;
  int64_t numel;
  int32_t type;
  int32_t unused;
};

// What the kernel hands back; zeroed by the upload.
struct SumResult {
  double sum;
  int32_t overflow;       // 1 when any element is inf or nan
  uint32_t blocks_done;   // finished blocks: the last one to finish adds the chunk sums
};

// Each element adds y * y in double with y = float(x) * scale rounded to float32, as the CPU op and
// torch's `x.float() * scale` (the square of a float is exact in double: only the sum rounds). The flag
// is about x itself: a finite x whose scaled value overflows float32 makes the sum inf, not the flag.
template <typename T>
__device__ void sum_chunk(const T* p, int64_t n, float scale, double& acc, bool& bad) {
  const bool vec_ok = aligned<T>(p);
  for (int64_t i = int64_t{threadIdx.x} * kVec; i < n; i += int64_t{blockDim.x} * kVec) {
    const int64_t left = n - i;
    float x[kVec];
    load_group(p + i, left, vec_ok && left >= kVec, x);  // missing elements read as 0 and add 0
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const double y = x[k] * scale;
      acc += y * y;
      bad |= !isfinite(x[k]);
    }
  }
}

// [Note: a deterministic sum in one launch]
// Each chunk's sum is reduced in a fixed order (thread i's groups in order, then block_sum) and
// stored in partials[chunk]. The last block to finish (a ticket taken after a fence, so every other
// block's partials are visible) adds the chunk sums in a fixed order too: thread i the chunks i,
// i + blockDim.x, ..., then block_sum. No atomic touches a sum, so the result is the same bits on
// every run, whatever the grid size or the order in which blocks run.
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(Table<ReadDesc> table, float scale,
                                                               double* partials, SumResult* result) {
  __shared__ double shared[kThreads / 32];
  __shared__ bool last;
  bool bad = false;
  for (int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    const ReadDesc* d;
    int64_t start, n;
    chunk_range(table, c, d, start, n);
    double acc = 0.0;
    dispatch(d->type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      sum_chunk(static_cast<const T*>(d->data) + start, n, scale, acc, bad);
    });
    acc = block_sum(acc, shared);
    if (threadIdx.x == 0) partials[c] = acc;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(&result->overflow, 1);
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&result->blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < table.num_chunks; c += blockDim.x) acc += __ldcg(partials + c);
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) result->sum = acc;
}

}  // namespace

std::tuple<double, bool> sum_squares_and_overflow(const std::vector<at::Tensor>& tensors, double scale) {
  const char* op = "sum_squares_and_overflow";
  if (tensors.empty()) return {0.0, false};
  const at::Device device = tensors[0].device();
  TableBuilder<ReadDesc> table;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Name name{"tensors", static_cast<int64_t>(i)};
    check_tensor(tensors[i], device, op, name);
    table.add(ReadDesc{tensors[i].data_ptr(), tensors[i].numel(), float_type(tensors[i], op, name), 0},
              tensors[i].numel());
  }
  if (table.empty()) return {0.0, false};

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor storage;  // [table][SumResult, zeroed][partials: one double per chunk]
  const Table<ReadDesc> device_table =
      table.upload(device, storage, sizeof(SumResult), table.num_chunks() * sizeof(double));
  auto* result = reinterpret_cast<SumResult*>(device_table.workspace);
  auto* partials = reinterpret_cast<double*>(device_table.workspace + 16);  // upload rounds SumResult up to 16
  static_assert(sizeof(SumResult) == 16, "partials start 16 bytes into the workspace");
  sum_squares_kernel<<<table.blocks(), kThreads, 0, stream>>>(device_table, static_cast<float>(scale), partials,
                                                              result);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  SumResult host{};
  // The caller needs the numbers now (the loss scaler branches on the overflow): wait for them.
  C10_CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(host), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {host.sum, host.overflow != 0};
}

}  // namespace zero_engine::gpu
