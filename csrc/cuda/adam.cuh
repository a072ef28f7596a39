// adam_step: the fused Adam/AdamW step over many tensors, with the gradient's unscale and the
// low-precision copy in the same pass (the CUDA twin of csrc/cpu/adam.cpp).
//
// Part of the single translation unit ops.cu (see there), not a standalone header.
#pragma once

#include "multi_tensor.cuh"
#include "ops.h"

#include <cmath>
#include <type_traits>

namespace zero_engine::gpu {
namespace {

struct AdamDesc {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* lp;  // the low-precision copy, or null
  int64_t numel;
  int32_t grad_type;
  int32_t lp_type;  // kNoCopy when there is no copy
};

// The step's scalars, computed on the host in double as torch.optim does, then rounded to float as
// torch's kernels round their scalar arguments.
struct AdamCoef {
  float grad_scale;
  float weight_decay;
  float decay;            // 1 - lr * weight_decay (AdamW)
  float exp_avg_weight;   // 1 - beta1, the lerp weight
  float beta2;
  float one_minus_beta2;
  float step_size;        // lr / (1 - beta1^step)
  float bias_correction2_sqrt;
  float eps;
  bool adamw;
};

// One element, in the order of torch.optim's single-tensor Adam/AdamW.
__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v, const AdamCoef& c) {
  g *= c.grad_scale;
  if (c.weight_decay != 0.0f) {
    if (c.adamw) p *= c.decay;
    else g += c.weight_decay * p;
  }
  const float w = c.exp_avg_weight;  // torch's lerp formula
  m = w < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / c.bias_correction2_sqrt + c.eps;
  p += -c.step_size * (m / denom);
}

template <typename G, typename L>
__device__ void adam_chunk(const AdamDesc& d, int64_t start, int64_t n, const AdamCoef& c) {
  float* p = d.param + start;
  float* m = d.exp_avg + start;
  float* v = d.exp_avg_sq + start;
  const G* g = static_cast<const G*>(d.grad) + start;
  constexpr bool kCopy = !std::is_same_v<L, NoCopy>;
  L* lp = kCopy ? static_cast<L*>(d.lp) + start : nullptr;
  bool vec_ok = aligned<float>(p) && aligned<float>(m) && aligned<float>(v) && aligned<G>(g);
  if constexpr (kCopy) vec_ok = vec_ok && aligned<L>(lp);
  for (int64_t i = int64_t{threadIdx.x} * kVec; i < n; i += int64_t{blockDim.x} * kVec) {
    const int64_t left = n - i;
    const bool vec = vec_ok && left >= kVec;
    float pv[kVec], gv[kVec], mv[kVec], vv[kVec];
    load_group(p + i, left, vec, pv);
    load_group(g + i, left, vec, gv);
    load_group(m + i, left, vec, mv);
    load_group(v + i, left, vec, vv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) adam_element(pv[k], gv[k], mv[k], vv[k], c);
    store_group(p + i, left, vec, pv);
    store_group(m + i, left, vec, mv);
    store_group(v + i, left, vec, vv);
    if constexpr (kCopy) store_group(lp + i, left, vec, pv);
  }
}

__global__ void __launch_bounds__(kThreads) adam_kernel(Table<AdamDesc> table, AdamCoef coef) {
  for (int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    const AdamDesc* d;
    int64_t start, n;
    chunk_range(table, c, d, start, n);
    dispatch(d->grad_type, [&](auto grad_tag) {
      dispatch_optional(d->lp_type, [&](auto lp_tag) {
        using G = typename decltype(grad_tag)::type;
        using L = typename decltype(lp_tag)::type;
        adam_chunk<G, L>(*d, start, n, coef);
      });
    });
  }
}

AdamCoef adam_coef(double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                   int64_t step, bool bias_correction, double grad_scale) {
  const double correction1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double correction2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  return AdamCoef{static_cast<float>(grad_scale), static_cast<float>(weight_decay),
                  static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(1.0 - beta1),
                  static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
                  static_cast<float>(lr / correction1), static_cast<float>(std::sqrt(correction2)),
                  static_cast<float>(eps), adamw_mode};
}

void check_float32(const at::Tensor& t, const at::Tensor& param, const char* op, Name name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " is ", t.scalar_type(), "; expected float32");
  TORCH_CHECK(t.numel() == param.numel(), op, ": ", name, " has ", t.numel(), " elements but params[", name.index,
              "] has ", param.numel());
}

}  // namespace

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& lp_params, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw_mode, int64_t step, bool bias_correction, double grad_scale) {
  const char* op = "adam_step";
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count, op, ": ", count,
              " params, ", grads.size(), " grads, ", exp_avgs.size(), " exp_avgs and ", exp_avg_sqs.size(),
              " exp_avg_sqs; expected one of each per param");
  TORCH_CHECK(lp_params.empty() || lp_params.size() == count, op, ": ", lp_params.size(), " lp_params for ", count,
              " params; expected none or one per param");
  TORCH_CHECK(step >= 1, op, ": step is ", step, "; expected >= 1 (the count after this step, as torch.optim's)");
  if (count == 0) return;
  const at::Device device = params[0].device();
  TableBuilder<AdamDesc> table;
  for (size_t i = 0; i < count; ++i) {
    const int64_t index = static_cast<int64_t>(i);
    const at::Tensor& p = params[i];
    check_tensor(p, device, op, Name{"params", index});
    TORCH_CHECK(p.scalar_type() == at::kFloat, op, ": params[", i, "] is ", p.scalar_type(), "; expected float32");
    check_tensor(grads[i], device, op, Name{"grads", index});
    check_tensor(exp_avgs[i], device, op, Name{"exp_avgs", index});
    check_tensor(exp_avg_sqs[i], device, op, Name{"exp_avg_sqs", index});
    const DType grad_type = float_type(grads[i], op, Name{"grads", index});
    TORCH_CHECK(grads[i].numel() == p.numel(), op, ": grads[", i, "] has ", grads[i].numel(),
                " elements but params[", i, "] has ", p.numel());
    check_float32(exp_avgs[i], p, op, Name{"exp_avgs", index});
    check_float32(exp_avg_sqs[i], p, op, Name{"exp_avg_sqs", index});
    void* lp = nullptr;
    DType lp_type = kNoCopy;
    if (!lp_params.empty()) {
      const at::Tensor& l = lp_params[i];
      check_tensor(l, device, op, Name{"lp_params", index});
      TORCH_CHECK(l.scalar_type() == at::kBFloat16 || l.scalar_type() == at::kHalf, op, ": lp_params[", i, "] is ",
                  l.scalar_type(), "; expected bfloat16 or float16");
      TORCH_CHECK(l.numel() == p.numel(), op, ": lp_params[", i, "] has ", l.numel(), " elements but params[", i,
                  "] has ", p.numel());
      lp = l.data_ptr();
      lp_type = float_type(l, op, Name{"lp_params", index});
    }
    table.add(AdamDesc{p.data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                       exp_avg_sqs[i].data_ptr<float>(), lp, p.numel(), grad_type, lp_type},
              p.numel());
  }
  if (table.empty()) return;

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor storage;
  const Table<AdamDesc> device_table = table.upload(device, storage);
  const AdamCoef coef =
      adam_coef(lr, beta1, beta2, eps, weight_decay, adamw_mode, step, bias_correction, grad_scale);
  adam_kernel<<<table.blocks(), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(device_table, coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace zero_engine::gpu
