// accumulate: dst += float(src) * scale in place, one 1-D segment into an accumulator (the CUDA twin of
// csrc/cpu/accumulate.cpp; [Note: accumulate semantics] there and in engine/ops/accumulate.py).
//
// One tensor pair per call, so no chunk table: the pointers travel as kernel arguments (no pinned
// upload), and a grid-stride loop over groups of kVec elements does the work, one vector access per
// pointer when both are aligned to the group (multi_tensor.cuh's load_group / store_group), element
// by element otherwise, with the same math either way.
//
// Part of the single translation unit ops.cu (see there), not a standalone header.
#pragma once

#include "multi_tensor.cuh"
#include "ops.h"

namespace zero_engine::gpu {
namespace {

// d = D(float(d) + float(s) * scale): the product and the sum each rounded to float32 on their own.
// nvcc contracts `d + s * scale` into one FMA by default (--fmad=true), which rounds once where torch
// and the CPU op round twice; __fmul_rn / __fadd_rn are never contracted.
template <typename S, typename D>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(D* dst, const S* src, int64_t n, float scale) {
  const bool vec_ok = aligned<S>(src) && aligned<D>(dst);
  const int64_t step = int64_t{gridDim.x} * blockDim.x * kVec;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec; i < n; i += step) {
    const int64_t left = n - i;
    const bool vec = vec_ok && left >= kVec;
    float d[kVec], s[kVec];
    load_group(dst + i, left, vec, d);
    load_group(src + i, left, vec, s);
#pragma unroll
    for (int k = 0; k < kVec; ++k) d[k] = __fadd_rn(d[k], __fmul_rn(s[k], scale));
    store_group(dst + i, left, vec, d);
  }
}

template <typename S, typename D>
void launch_accumulate(const at::Tensor& dst, const at::Tensor& src, int64_t n, float scale) {
  const int64_t groups = (n + kVec - 1) / kVec;
  const int64_t blocks = (groups + kThreads - 1) / kThreads;
  accumulate_kernel<S, D><<<static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0,
                            c10::cuda::getCurrentCUDAStream()>>>(static_cast<D*>(dst.data_ptr()),
                                                                 static_cast<const S*>(src.data_ptr()), n, scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const char* dtype_name(DType t) { return t == kF32 ? "float32" : t == kBF16 ? "bfloat16" : "float16"; }

}  // namespace

void accumulate(const at::Tensor& dst, const at::Tensor& src, double scale) {
  const char* op = "accumulate";
  const Name dst_name{"dst", -1}, src_name{"src", -1};
  check_tensor(dst, dst.device(), op, dst_name);
  check_tensor(src, dst.device(), op, src_name);
  const auto check_1d = [op](const at::Tensor& t, Name name) {
    TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", t.sizes(),
                "; pass .view(-1) of a contiguous tensor");
  };
  check_1d(dst, dst_name);
  check_1d(src, src_name);
  const DType dst_type = float_type(dst, op, dst_name);
  const DType src_type = float_type(src, op, src_name);
  TORCH_CHECK(dst_type == kF32 || dst_type == src_type, op, ": dst ", dtype_name(dst_type), " with src ",
              dtype_name(src_type), " is not supported; supported: dst float32 with src float32, bfloat16 or "
              "float16, or dst bfloat16 / float16 with src of the same dtype");
  const int64_t n = dst.numel();
  TORCH_CHECK(src.numel() == n, op, ": dst.numel() = ", n, " != src.numel() = ", src.numel(),
              "; dst and src must have the same number of elements");
  const auto* d = static_cast<const uint8_t*>(dst.data_ptr());
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  const bool disjoint = d + n * dst.element_size() <= s || s + n * src.element_size() <= d;
  TORCH_CHECK(n == 0 || disjoint || (d == s && dst_type == src_type), op,
              ": dst and src partially overlap in memory; pass disjoint tensors (or the same one)");
  if (n == 0) return;

  const c10::cuda::CUDAGuard guard(dst.device());
  const float scale_f = static_cast<float>(scale);
  switch (dst_type) {
    case kBF16: launch_accumulate<c10::BFloat16, c10::BFloat16>(dst, src, n, scale_f); break;
    case kF16: launch_accumulate<c10::Half, c10::Half>(dst, src, n, scale_f); break;
    default:
      switch (src_type) {
        case kBF16: launch_accumulate<c10::BFloat16, float>(dst, src, n, scale_f); break;
        case kF16: launch_accumulate<c10::Half, float>(dst, src, n, scale_f); break;
        default: launch_accumulate<float, float>(dst, src, n, scale_f); break;
      }
  }
}

}  // namespace zero_engine::gpu
