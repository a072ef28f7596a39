// copy_into / copy_out: many tensors into / out of ranges of one flat 1-D buffer, cast and scaled in one
// pass (the CUDA twin of csrc/cpu/flatten.cpp).
//
// Part of the single translation unit ops.cu (see there), not a standalone header.
#pragma once

#include "multi_tensor.cuh"
#include "ops.h"

namespace zero_engine::gpu {
namespace {

struct CopyDesc {
  const void* src;
  void* dst;
  int64_t numel;
  int32_t src_type;
  int32_t dst_type;
};

// dst[i] = D(float(src[i]) * scale) over one chunk. The product is a float32 one, as in torch's
// `src.float() * scale`, and the cast rounds to nearest even, so finite and infinite values come out
// bitwise as torch's (a NaN stays a NaN; its payload is the device's).
template <typename S, typename D>
__device__ void copy_chunk(const S* src, D* dst, int64_t n, float scale) {
  const bool vec_ok = aligned<S>(src) && aligned<D>(dst);
  for (int64_t i = int64_t{threadIdx.x} * kVec; i < n; i += int64_t{blockDim.x} * kVec) {
    const int64_t left = n - i;
    const bool vec = vec_ok && left >= kVec;
    float x[kVec];
    load_group(src + i, left, vec, x);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] *= scale;
    store_group(dst + i, left, vec, x);
  }
}

__global__ void __launch_bounds__(kThreads) copy_kernel(Table<CopyDesc> table, float scale) {
  for (int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    const CopyDesc* d;
    int64_t start, n;
    chunk_range(table, c, d, start, n);
    dispatch(d->src_type, [&](auto src_tag) {
      dispatch(d->dst_type, [&](auto dst_tag) {
        using S = typename decltype(src_tag)::type;
        using D = typename decltype(dst_tag)::type;
        copy_chunk(static_cast<const S*>(d->src) + start, static_cast<D*>(d->dst) + start, n, scale);
      });
    });
  }
}

// Copies between a flat 1-D tensor and a list of tensors at element offsets into it (`into`: list ->
// flat, else flat -> list).
void copy_flat(const char* op, bool into, const at::Tensor& flat, const std::vector<at::Tensor>& list,
               const std::vector<int64_t>& offsets, double scale) {
  const Name flat_name{into ? "dst" : "src", -1};
  const char* list_name = into ? "srcs" : "dsts";
  TORCH_CHECK(list.size() == offsets.size(), op, ": ", list.size(), " ", list_name, " but ", offsets.size(),
              " offsets; expected one offset per tensor");
  check_tensor(flat, flat.device(), op, flat_name);
  TORCH_CHECK(flat.dim() == 1, op, ": ", flat_name, " has shape ", flat.sizes(), "; expected a 1-D tensor");
  const DType flat_type = float_type(flat, op, flat_name);
  auto* flat_base = static_cast<uint8_t*>(flat.data_ptr());

  TableBuilder<CopyDesc> table;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    const Name name{list_name, static_cast<int64_t>(i)};
    check_tensor(t, flat.device(), op, name);
    const DType type = float_type(t, op, name);
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), op, ": ", name, " (", t.numel(),
                " elements) at offset ", offsets[i], " does not fit in ", flat_name, " (", flat.numel(),
                " elements); expected 0 <= offset and offset + numel <= ", flat.numel());
    void* at_offset = flat_base + offsets[i] * flat.element_size();
    table.add(into ? CopyDesc{t.data_ptr(), at_offset, t.numel(), type, flat_type}
                   : CopyDesc{at_offset, t.data_ptr(), t.numel(), flat_type, type},
              t.numel());
  }
  if (table.empty()) return;

  const c10::cuda::CUDAGuard guard(flat.device());
  at::Tensor storage;
  const Table<CopyDesc> device_table = table.upload(flat.device(), storage);
  copy_kernel<<<table.blocks(), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(device_table,
                                                                                   static_cast<float>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void copy_into(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets,
               double scale) {
  copy_flat("copy_into", /*into=*/true, dst, srcs, offsets, scale);
}

void copy_out(const at::Tensor& src, const std::vector<at::Tensor>& dsts, const std::vector<int64_t>& offsets,
              double scale) {
  copy_flat("copy_out", /*into=*/false, src, dsts, offsets, scale);
}

}  // namespace zero_engine::gpu
