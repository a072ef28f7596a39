// A contiguous, pre-touched memory arena with a best-fit free list (ZeRO-R's memory defragmentation,
// paper section 6.3). Python wrapper and the pure-torch fallback: engine/ops/arena.py.
//
// Why: stage 3 takes a fresh full buffer per gathered unit per step, and gradient buckets. Fresh
// memory pays a first-touch page fault per page (copies into it ran at 2.5-3.3 GB/s here against 10+
// GB/s into touched memory), and glibc keeps freed blocks resident and fragmented. The arena takes
// its buffer once, writes every page at creation, and lends 64-byte-aligned blocks as tensors.
//
// [Note: arena block lifetime]
// A block's tensor owns a shared_ptr to the arena's State through its deleter, so the buffer stays
// valid while any tensor or view of it lives, even after the Python Arena is gone; the last owner
// frees it. The deleter runs on whichever thread drops the storage (autograd threads too), so every
// read or change of the free list holds State::mutex, and nothing holding it calls into Python.
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace zero_engine {
namespace {

constexpr int64_t kBlockAlign = 64;     // a cache line: two blocks never share one
constexpr int64_t kHugePage = 2 << 20;  // x86-64 huge page; also the pre-touch chunk

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// A consistent snapshot of the arena's accounting, taken under State::mutex.
struct Usage {
  int64_t capacity, in_use, peak_in_use, largest_free, free_blocks, allocations;
};

struct State {
  State(int64_t capacity_bytes, std::string key)
      : capacity(round_up(capacity_bytes, kBlockAlign)), config_key(std::move(key)) {
    // No madvise(MADV_HUGEPAGE), measured here (THP "madvise" mode): streaming fills and copies into a
    // touched buffer ran at the same speed (8.8 vs 8.5 GB/s fill, 6.9 vs 6.7 copy, one thread), while
    // creation stalled 0.8-3 s per 256 MiB-1 GiB on compaction whenever memory was fragmented. Large
    // arenas stay 2 MiB-aligned so a THP "always" kernel can still use huge pages.
    void* ptr = nullptr;
    const int64_t align = capacity >= kHugePage ? kHugePage : kBlockAlign;  // small arenas: no 2 MiB hole
    TORCH_CHECK(posix_memalign(&ptr, align, capacity) == 0, "Arena: could not allocate ", capacity,
                " bytes; lower ", config_key);
    base = static_cast<char*>(ptr);
    // Pre-touch: write every page now so no step pays a first-touch fault.
    at::parallel_for(0, (capacity + kHugePage - 1) / kHugePage, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memset(base + i * kHugePage, 0, std::min(kHugePage, capacity - i * kHugePage));
      }
    });
    insert_free(0, capacity);
  }
  ~State() { std::free(base); }

  // Caller holds mutex. Best fit: the smallest free block that fits, the lowest address among equals.
  int64_t take(int64_t size) {
    auto it = by_size.lower_bound({size, 0});
    if (it == by_size.end()) return -1;
    const auto [block, offset] = *it;
    erase_free(offset);
    if (block > size) insert_free(offset + size, block - size);
    in_use += size;
    peak_in_use = std::max(peak_in_use, in_use);
    ++allocations;
    return offset;
  }

  // Caller holds mutex. Returns a block, merged with the free blocks right before and after it.
  void give_back(int64_t offset, int64_t size) {
    in_use -= size;
    --allocations;
    auto next = by_offset.lower_bound(offset);
    if (next != by_offset.end() && offset + size == next->first) {
      size += next->second;
      erase_free(next->first);
      next = by_offset.lower_bound(offset);
    }
    if (next != by_offset.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        size += prev->second;
        erase_free(offset);
      }
    }
    insert_free(offset, size);
  }

  // Caller holds mutex.
  Usage usage() const {
    const int64_t largest = by_size.empty() ? 0 : by_size.rbegin()->first;
    return {capacity, in_use, peak_in_use, largest, static_cast<int64_t>(by_offset.size()), allocations};
  }

  void insert_free(int64_t offset, int64_t size) {
    by_offset.emplace(offset, size);
    by_size.emplace(size, offset);
  }
  void erase_free(int64_t offset) {
    auto it = by_offset.find(offset);
    by_size.erase({it->second, offset});
    by_offset.erase(it);
  }

  char* base = nullptr;  // capacity bytes, 2 MiB-aligned (64 if smaller), every page written once
  const int64_t capacity;
  const std::string config_key;  // the setting a user raises when a request does not fit
  std::mutex mutex;              // See [Note: arena block lifetime]
  std::map<int64_t, int64_t> by_offset;           // free blocks, offset -> size, address order
  std::set<std::pair<int64_t, int64_t>> by_size;  // the same blocks as (size, offset), for best fit
  int64_t in_use = 0, peak_in_use = 0, allocations = 0;
};

std::string full_message(const Usage& u, const std::string& config_key, c10::IntArrayRef sizes,
                         at::ScalarType dtype, int64_t nbytes, int64_t block) {
  // Word for word the fallback's message (engine/ops/arena.py, _full_message); a test compares them.
  // str(torch.dtype) needs the GIL, which allocate() holds (and its caller never holds State::mutex).
  const auto dtype_name = pybind11::str(pybind11::cast(dtype)).cast<std::string>();
  std::ostringstream out;
  const int64_t free_total = u.capacity - u.in_use;
  out << "Arena: cannot allocate a tensor of shape " << sizes << " and dtype " << dtype_name << " (" << nbytes
      << " bytes, a " << block << "-byte block): capacity " << u.capacity << " bytes, " << u.in_use
      << " in use, largest free block " << u.largest_free << " bytes";
  if (free_total >= block) out << " (" << free_total << " bytes free but fragmented into " << u.free_blocks
                               << " blocks)";
  out << ". Raise " << config_key << " (the arena's capacity in bytes).";
  return out.str();
}

class Arena {
 public:
  Arena(int64_t capacity_bytes, std::string config_key) {
    TORCH_CHECK_VALUE(capacity_bytes > 0, "Arena: capacity_bytes must be positive, got ", capacity_bytes,
                      "; set ", config_key);
    state_ = std::make_shared<State>(capacity_bytes, std::move(config_key));
  }

  at::Tensor allocate(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
    int64_t nbytes = static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t size : sizes) {
      TORCH_CHECK_VALUE(size >= 0, "Arena.allocate: negative size in shape ", c10::IntArrayRef(sizes));
      TORCH_CHECK_VALUE(!c10::mul_overflows(nbytes, size, &nbytes), "Arena.allocate: shape ",
                        c10::IntArrayRef(sizes), " overflows int64 bytes");
    }
    const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    if (nbytes == 0) return at::empty(sizes, options);  // takes no block
    const int64_t block = round_up(nbytes, kBlockAlign);
    int64_t offset = -1;
    Usage usage{};
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      offset = state_->take(block);
      if (offset < 0) usage = state_->usage();
    }
    TORCH_CHECK(offset >= 0, full_message(usage, state_->config_key, sizes, dtype, nbytes, block));
    // Inputs are checked above, so from_blob can only fail on bad_alloc, before it owns the deleter.
    std::shared_ptr<State> state = state_;  // See [Note: arena block lifetime]
    return torch::from_blob(
        state->base + offset, sizes,
        [state, offset, block](void*) {
          std::lock_guard<std::mutex> lock(state->mutex);
          state->give_back(offset, block);
        },
        options);
  }

  pybind11::dict stats() {
    Usage u{};
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      u = state_->usage();
    }
    const int64_t free_total = u.capacity - u.in_use;
    pybind11::dict out;
    out["capacity"] = u.capacity;
    out["in_use"] = u.in_use;
    out["peak_in_use"] = u.peak_in_use;
    out["largest_free"] = u.largest_free;
    out["free_blocks"] = u.free_blocks;
    out["allocations"] = u.allocations;
    out["fragmentation"] =
        free_total > 0 ? 1.0 - static_cast<double>(u.largest_free) / static_cast<double>(free_total) : 0.0;
    return out;
  }

  int64_t data_ptr() const { return reinterpret_cast<int64_t>(state_->base); }

 private:
  std::shared_ptr<State> state_;
};

}  // namespace

void register_arena(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Arena>(m, "Arena", "Pre-touched contiguous CPU buffer lending best-fit 64-byte-aligned blocks")
      .def(py::init<int64_t, std::string>(), py::arg("capacity_bytes"), py::arg("config_key"),
           py::call_guard<py::gil_scoped_release>())  // pre-touching gigabytes takes a while
      .def("allocate", &Arena::allocate, py::arg("sizes"), py::arg("dtype"),
           "A CPU tensor in a free block; its storage gives the block back when it dies")
      .def("stats", &Arena::stats, "capacity, in_use, peak_in_use, largest_free, free_blocks, allocations, "
                                   "fragmentation (1 - largest_free / free bytes)")
      .def("data_ptr", &Arena::data_ptr, "Address of the arena's first byte");
}

}  // namespace zero_engine
