// The CUDA ops of the extension: the same signatures and results as the CPU ops of the same names
// (csrc/cpu/), on CUDA tensors, each one kernel launch on the current stream for all its tensors.
//
// This header is shared by ops.cu (compiled by nvcc) and bindings.cpp (compiled by the host compiler),
// so it includes only the light ATen tensor header: <torch/extension.h> and pybind11 stay out of nvcc's
// translation unit, which roughly halves its compile time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace zero_engine::gpu {

// dst (1-D, contiguous): dst[offsets[i] : offsets[i] + srcs[i].numel()] = to_dst(float(srcs[i]) * scale).
// float32/bfloat16/float16 in any combination, rounded to nearest even like torch's casts.
void copy_into(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
               double scale);

// The reverse: dsts[i] = to_dsts[i](float(src[offsets[i] : offsets[i] + dsts[i].numel()]) * scale).
void copy_out(const at::Tensor& src, const std::vector<at::Tensor>& dsts, const std::vector<int64_t>& offsets,
              double scale);

// (sum over every element of (float(x) * float(scale))^2 in double, whether any element x is inf or nan).
// Deterministic: fixed chunks, each reduced in a fixed order, the chunk sums added in a fixed order.
std::tuple<double, bool> sum_squares_and_overflow(const std::vector<at::Tensor>& tensors, double scale);

// One Adam (adamw_mode=false: L2 added to the gradient) or AdamW (decoupled decay) step, as torch.optim
// computes it, on float32 params/exp_avgs/exp_avg_sqs with g = float(grad) * grad_scale; when lp_params
// is not empty, each gets the updated parameter cast to its dtype (bfloat16/float16) in the same pass.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& lp_params, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw_mode, int64_t step, bool bias_correction, double grad_scale);

// dst (1-D, contiguous) += float(src) * scale in place: to_dst(float(dst) + float(src) * float(scale)), the
// product and the sum each rounded to float32, the result rounded once to dst's dtype (nearest even).
// dst float32 with src float32/bfloat16/float16, or dst bfloat16/float16 with src of the same dtype.
void accumulate(const at::Tensor& dst, const at::Tensor& src, double scale);

}  // namespace zero_engine::gpu
