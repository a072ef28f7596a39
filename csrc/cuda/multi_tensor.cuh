// What every CUDA op shares: the chunk table that lets one kernel launch cover a whole tensor list,
// the element types, grouped (vector) loads and stores, and a deterministic block sum.
//
// [Note: the chunk table]
// An op launches one kernel for all of its tensors. The host lists one descriptor per non-empty
// tensor (pointers, element types, length) and chunk_begin[t], the index of tensor t's first chunk of
// kChunk elements (a prefix sum ending with the total), writes them into pinned memory and copies them
// to device memory with one asynchronous copy on the current stream (torch's pinned allocator keeps
// the host block until the copy is done; the caching allocator orders the device block's reuse after
// the kernel). Block b takes chunks b, b + gridDim.x, ...; it finds a chunk's tensor by binary search
// in chunk_begin. Within a chunk, thread i takes the groups of kVec consecutive elements i,
// i + blockDim.x, ...: one vector access per pointer when every pointer of the group is aligned to
// the group size, element by element otherwise (misaligned tensors, the tail), in the same order, so
// no result depends on alignment.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <ostream>
#include <vector>

namespace zero_engine::gpu {

constexpr int64_t kChunk = 1 << 16;      // elements per chunk: 32 groups per thread of a block
constexpr int kThreads = 512;            // threads per block
constexpr int kVec = 4;                  // elements per group: 16 bytes of float32
constexpr int64_t kMaxBlocks = 1 << 16;  // beyond this many chunks, blocks loop over several

// Element types as the table carries them; kernels switch on them once per chunk.
enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kNoCopy = 3 };

// "srcs[3]" (index >= 0) or "dst" in error messages, formatted only when a check fails.
struct Name {
  const char* list;
  int64_t index;
};
inline std::ostream& operator<<(std::ostream& out, const Name& name) {
  out << name.list;
  if (name.index >= 0) out << '[' << name.index << ']';
  return out;
}

// ---- the table (see [Note: the chunk table]) ----

template <typename Desc>
struct Table {
  const Desc* desc;            // one per non-empty tensor
  const int64_t* chunk_begin;  // num_tensors + 1 entries
  int64_t num_tensors;
  int64_t num_chunks;
  uint8_t* workspace;  // what the op asked for beyond the table (16-byte aligned)

  // The tensor chunk c belongs to: the last t with chunk_begin[t] <= c (no tensor is empty).
  __device__ __forceinline__ int64_t tensor_of(int64_t c) const {
    int64_t lo = 0, hi = num_tensors - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (chunk_begin[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
};

template <typename Desc>
class TableBuilder {
  static_assert(sizeof(Desc) % 8 == 0, "descriptors must keep chunk_begin 8-byte aligned");

 public:
  void add(const Desc& desc, int64_t numel) {
    if (numel == 0) return;
    descs_.push_back(desc);
    begins_.push_back(total_);
    total_ += (numel + kChunk - 1) / kChunk;
  }
  bool empty() const { return descs_.empty(); }
  int64_t num_chunks() const { return total_; }
  int blocks() const { return static_cast<int>(total_ < kMaxBlocks ? total_ : kMaxBlocks); }

  // Copies the table to `device` on the current stream, followed by `zeroed_bytes` of zeros and
  // `scratch_bytes` left uninitialised (the op's workspace). `storage` owns the device memory and must
  // live until the kernel is queued.
  Table<Desc> upload(const at::Device& device, at::Tensor& storage, size_t zeroed_bytes = 0,
                     size_t scratch_bytes = 0) const {
    const size_t desc_bytes = descs_.size() * sizeof(Desc);
    const size_t table_bytes = round16(desc_bytes + (begins_.size() + 1) * sizeof(int64_t));
    const size_t upload_bytes = table_bytes + round16(zeroed_bytes);
    at::Tensor host = at::empty({static_cast<int64_t>(upload_bytes)},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* image = static_cast<uint8_t*>(host.data_ptr());
    std::memset(image, 0, upload_bytes);
    std::memcpy(image, descs_.data(), desc_bytes);
    std::memcpy(image + desc_bytes, begins_.data(), begins_.size() * sizeof(int64_t));
    std::memcpy(image + desc_bytes + begins_.size() * sizeof(int64_t), &total_, sizeof(int64_t));

    storage = at::empty({static_cast<int64_t>(upload_bytes + scratch_bytes)},
                        at::TensorOptions().dtype(at::kByte).device(device));
    storage.narrow(0, 0, static_cast<int64_t>(upload_bytes)).copy_(host, /*non_blocking=*/true);
    auto* base = static_cast<uint8_t*>(storage.data_ptr());
    return Table<Desc>{reinterpret_cast<const Desc*>(base), reinterpret_cast<const int64_t*>(base + desc_bytes),
                       static_cast<int64_t>(descs_.size()), total_, base + table_bytes};
  }

 private:
  static size_t round16(size_t bytes) { return (bytes + 15) / 16 * 16; }

  std::vector<Desc> descs_;
  std::vector<int64_t> begins_;
  int64_t total_ = 0;
};

// ---- host checks shared by the ops (TORCH_CHECK on every tensor before anything is launched) ----

inline DType float_type(const at::Tensor& t, const char* op, Name name) {
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, op, ": ", name, " is ", type,
              "; expected float32, bfloat16 or float16");
  return type == at::kFloat ? kF32 : type == at::kBFloat16 ? kBF16 : kF16;
}

inline void check_tensor(const at::Tensor& t, const at::Device& device, const char* op, Name name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " is on ", t.device(),
              "; the CUDA op takes CUDA tensors (the CPU extension takes CPU ones)");
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but the other tensors are on ", device);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is not contiguous; pass a contiguous tensor");
}

// ---- device helpers ----

template <typename T>
struct Tag {
  using type = T;
};
struct NoCopy {};  // the "no low-precision copy" element type of adam_step

// Calls f(Tag<T>{}) for the element type `code` names.
template <typename F>
__device__ __forceinline__ void dispatch(int32_t code, F&& f) {
  switch (code) {
    case kBF16: f(Tag<c10::BFloat16>{}); break;
    case kF16: f(Tag<c10::Half>{}); break;
    default: f(Tag<float>{}); break;
  }
}

// The same for an optional output: kNoCopy gives Tag<NoCopy>.
template <typename F>
__device__ __forceinline__ void dispatch_optional(int32_t code, F&& f) {
  switch (code) {
    case kBF16: f(Tag<c10::BFloat16>{}); break;
    case kF16: f(Tag<c10::Half>{}); break;
    default: f(Tag<NoCopy>{}); break;
  }
}

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T>
__device__ __forceinline__ bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>) == 0;
}

// The group of kVec elements at p as floats: one vector load when `vec`, else the first `left`
// elements one by one (the rest read as 0).
template <typename T>
__device__ __forceinline__ void load_group(const T* p, int64_t left, bool vec, float (&out)[kVec]) {
  if (vec) {
    const Pack<T> pack = *reinterpret_cast<const Pack<T>*>(p);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = static_cast<float>(pack.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = k < left ? static_cast<float>(p[k]) : 0.0f;
  }
}

// Rounds (to nearest even, as torch) and stores the group at p, the same two ways as load_group.
template <typename T>
__device__ __forceinline__ void store_group(T* p, int64_t left, bool vec, const float (&in)[kVec]) {
  if (vec) {
    Pack<T> pack;
#pragma unroll
    for (int k = 0; k < kVec; ++k) pack.v[k] = static_cast<T>(in[k]);
    *reinterpret_cast<Pack<T>*>(p) = pack;
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      if (k < left) p[k] = static_cast<T>(in[k]);
  }
}

// Chunk c of the table: its tensor's descriptor d, and the chunk's first element and length in it.
template <typename Desc>
__device__ __forceinline__ void chunk_range(const Table<Desc>& table, int64_t c, const Desc*& d, int64_t& start,
                                            int64_t& n) {
  const int64_t t = table.tensor_of(c);
  d = &table.desc[t];
  start = (c - table.chunk_begin[t]) * kChunk;
  n = d->numel - start < kChunk ? d->numel - start : kChunk;
}

// Sum of v over the block in a fixed order (a shuffle tree in each warp, then the warp sums in warp
// order); valid in thread 0. `shared` holds kThreads / 32 doubles; every thread of the block must call.
__device__ __forceinline__ double block_sum(double v, double* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.0;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  __syncthreads();  // shared is reused by the next call
  return v;
}

}  // namespace zero_engine::gpu
