// A contiguous, pre-touched memory arena with a best-fit free list (ZeRO-R's memory defragmentation,
// paper section 6.3). Python wrapper and the pure-torch fallback: engine/ops/arena.py.
//
// Why: stage 3 takes a fresh full buffer per gathered unit per step, and gradient buckets. Fresh
// memory pays a first-touch page fault per page (copies into it ran at 2.5-3.3 GB/s here against 10+
// GB/s into touched memory), and glibc keeps freed blocks resident and fragmented. The arena takes
// its buffer once, writes every page at creation, and lends 64-byte-aligned blocks as tensors.
//
// [Note: arena block lifetime]
// This file is the buffer and its free list; engine/ops/cpu_lib.py lends each block as a tensor (its
// storage holds a Python object whose finalizer gives the block back, the way engine/ops/arena.py's
// fallback does) and keeps the arena alive while any block's storage lives, so the buffer stays valid
// after the Python Arena is gone. A block is given back on whichever thread drops the storage (autograd
// threads too), so every read or change of the free list holds State::mutex; nothing here calls into
// Python.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <utility>

#include "ops.h"

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
  // Takes and pre-touches the buffer; `base` stays null when the memory cannot be had.
  State(int64_t capacity_bytes, int64_t threads) : capacity(round_up(capacity_bytes, kBlockAlign)) {
    // No madvise(MADV_HUGEPAGE), measured here (THP "madvise" mode): streaming fills and copies into a
    // touched buffer ran at the same speed (8.8 vs 8.5 GB/s fill, 6.9 vs 6.7 copy, one thread), while
    // creation stalled 0.8-3 s per 256 MiB-1 GiB on compaction whenever memory was fragmented. Large
    // arenas stay 2 MiB-aligned so a THP "always" kernel can still use huge pages.
    void* ptr = nullptr;
    const int64_t align = capacity >= kHugePage ? kHugePage : kBlockAlign;  // small arenas: no 2 MiB hole
    if (posix_memalign(&ptr, align, capacity) != 0) return;
    base = static_cast<char*>(ptr);
    // Pre-touch: write every page now so no step pays a first-touch fault.
    parallel_for((capacity + kHugePage - 1) / kHugePage, threads, [&](int64_t begin, int64_t end) {
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
  std::mutex mutex;  // See [Note: arena block lifetime]
  std::map<int64_t, int64_t> by_offset;           // free blocks, offset -> size, address order
  std::set<std::pair<int64_t, int64_t>> by_size;  // the same blocks as (size, offset), for best fit
  int64_t in_use = 0, peak_in_use = 0, allocations = 0;
};

// The C API's layout of a Usage: six int64s in field order.
void write_usage(const Usage& u, int64_t* out) {
  const int64_t values[] = {u.capacity, u.in_use, u.peak_in_use, u.largest_free, u.free_blocks, u.allocations};
  std::copy(values, values + 6, out);
}

}  // namespace
}  // namespace zero_engine

using zero_engine::State;
using zero_engine::write_usage;

void* ze_arena_create(int64_t capacity, int32_t threads) {
  auto* state = new (std::nothrow) State(capacity, threads);  // no C++ exception may cross the C API
  if (state != nullptr && state->base == nullptr) {
    delete state;
    return nullptr;
  }
  return state;
}

void ze_arena_destroy(void* arena) { delete static_cast<State*>(arena); }

void* ze_arena_base(void* arena) { return static_cast<State*>(arena)->base; }

int64_t ze_arena_take(void* arena, int64_t size, int64_t* usage_if_full) {
  auto* state = static_cast<State*>(arena);
  std::lock_guard<std::mutex> lock(state->mutex);
  const int64_t offset = state->take(size);
  if (offset < 0) write_usage(state->usage(), usage_if_full);  // the state that refused, for the message
  return offset;
}

void ze_arena_give_back(void* arena, int64_t offset, int64_t size) {
  auto* state = static_cast<State*>(arena);
  std::lock_guard<std::mutex> lock(state->mutex);
  state->give_back(offset, size);
}

void ze_arena_usage(void* arena, int64_t* out) {
  auto* state = static_cast<State*>(arena);
  zero_engine::Usage u{};
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    u = state->usage();
  }
  write_usage(u, out);
}
