// Asynchronous file I/O for NVMe offload: a pool of threads doing pread/pwrite (engine/ops/aio.py binds
// it; its pure-Python fallback does the same with os.preadv/os.pwritev in a thread pool).
//
// Why threads: neither liburing nor libaio headers are on this machine, and a blocking pread/pwrite
// per thread keeps a device busy as well when there are enough threads in flight. ctypes releases the
// GIL for ze_aio_wait, so Python (compute, communication) runs while the pool moves bytes.
//
// [Note: how a transfer is split]
// A transfer of `nbytes` at file offset `offset` is cut into blocks of `block_size` bytes (the last may
// be shorter). Threads take blocks off a FIFO of transfers in runs of `claim` blocks (engine/ops/aio.py
// passes 1, with DeepSpeed's thread_count x queue_depth threads) and issue one pread/pwrite per block. A block whose buffer
// address, file offset and size are multiples of kDirectAlign goes through the O_DIRECT descriptor
// (when the caller opened one); any other block, and a block the file system refuses with EINVAL,
// goes through the buffered one. Short counts are retried until the block is done; EOF on a read
// (no progress) and every errno end the transfer: the first failure (lowest file offset) is kept and
// the blocks not yet started are skipped. Nothing here calls into Python.
#include <errno.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ops.h"

namespace zero_engine {

constexpr int64_t kDirectAlign = 4096;  // the largest logical block size of common devices

struct Transfer {
  bool write;
  int fd, direct_fd;
  char* buffer;
  int64_t nbytes, offset, blocks;
  int64_t next = 0, finished = 0;                // blocks handed out, blocks finished
  int64_t bytes = 0, direct_bytes = 0;           // moved so far, of which through O_DIRECT
  int error = 0;                                  // errno of the first failure; 0 with fail_at >= 0: EOF
  int64_t fail_at = -1, fail_want = 0, fail_got = 0;  // that block's file offset, size, bytes moved
  bool done = false;
};

// One block's outcome, gathered without the lock.
struct Outcome {
  int64_t bytes = 0, direct_bytes = 0;
  int error = 0;
  int64_t fail_at = -1, fail_want = 0, fail_got = 0;
};

bool aligned(int64_t value) { return value % kDirectAlign == 0; }

void move_block(const Transfer& t, int64_t index, int64_t block_size, Outcome& out) {
  const int64_t start = index * block_size, size = std::min(block_size, t.nbytes - start);
  int64_t done = 0;
  bool direct_ok = t.direct_fd >= 0;
  while (done < size) {
    char* ptr = t.buffer + start + done;
    const int64_t pos = t.offset + start + done, left = size - done;
    const bool direct =
        direct_ok && aligned(reinterpret_cast<intptr_t>(ptr)) && aligned(pos) && aligned(left);
    const int fd = direct ? t.direct_fd : t.fd;
    const ssize_t n = t.write ? pwrite(fd, ptr, left, pos) : pread(fd, ptr, left, pos);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && direct && errno == EINVAL) {  // this file system or device refuses this O_DIRECT request
      direct_ok = false;
      continue;
    }
    if (n <= 0) {
      out.error = n < 0 ? errno : 0;
      out.fail_at = t.offset + start, out.fail_want = size, out.fail_got = done;
      break;
    }
    done += n;
    if (direct) out.direct_bytes += n;
  }
  out.bytes += done;
}

struct Pool {
  Pool(int64_t threads, int64_t block, int64_t claim_blocks) : block_size(block), claim(claim_blocks) {
    for (int64_t i = 0; i < threads; ++i) workers.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    work_ready.notify_all();
    for (auto& w : workers) w.join();  // the queue is drained first: no buffer is left half-moved
  }

  int64_t submit(Transfer t) {
    t.blocks = (t.nbytes + block_size - 1) / block_size;
    std::lock_guard<std::mutex> lock(mutex);
    const int64_t id = next_id++;
    auto& slot = transfers[id] = std::make_unique<Transfer>(t);
    if (slot->blocks == 0) {
      slot->done = true;
    } else {
      queue.push_back(slot.get());
      work_ready.notify_all();
    }
    return id;
  }

  // Blocks until transfer `id` is done, writes its outcome and forgets it; -1 for an unknown id.
  int64_t wait(int64_t id, int64_t* out) {
    std::unique_lock<std::mutex> lock(mutex);
    auto it = transfers.find(id);
    if (it == transfers.end()) return -1;
    Transfer& t = *it->second;
    finished.wait(lock, [&] { return t.done; });
    out[0] = t.bytes, out[1] = t.direct_bytes, out[2] = t.error;
    out[3] = t.fail_at, out[4] = t.fail_want, out[5] = t.fail_got;
    transfers.erase(it);
    return 0;
  }

  int64_t poll(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = transfers.find(id);
    return it == transfers.end() ? -1 : (it->second->done ? 1 : 0);
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      work_ready.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stopping, and nothing left to move
      Transfer& t = *queue.front();
      const int64_t first = t.next, count = std::min(claim, t.blocks - first);
      t.next += count;
      if (t.next == t.blocks) queue.pop_front();
      const bool skip = t.fail_at >= 0;  // an earlier block failed: the rest is not started
      lock.unlock();
      Outcome out;
      for (int64_t b = first; b < first + count && !skip && out.fail_at < 0; ++b) move_block(t, b, block_size, out);
      lock.lock();
      t.bytes += out.bytes, t.direct_bytes += out.direct_bytes;
      if (out.fail_at >= 0 && (t.fail_at < 0 || out.fail_at < t.fail_at)) {
        t.error = out.error, t.fail_at = out.fail_at, t.fail_want = out.fail_want, t.fail_got = out.fail_got;
      }
      t.finished += count;
      if (t.finished == t.blocks) {
        t.done = true;
        finished.notify_all();
      }
    }
  }

  const int64_t block_size, claim;
  std::mutex mutex;  // guards everything below and every Transfer's counters
  std::condition_variable work_ready, finished;
  std::deque<Transfer*> queue;  // transfers with blocks not yet handed out, oldest first
  std::map<int64_t, std::unique_ptr<Transfer>> transfers;  // submitted and not yet waited for
  int64_t next_id = 0;
  bool stop = false;
  std::vector<std::thread> workers;
};

}  // namespace zero_engine

using zero_engine::Pool;

void* ze_aio_create(int32_t threads, int64_t block_size, int32_t claim_blocks) {
  try {
    return new Pool(threads, block_size, claim_blocks);
  } catch (...) {  // a thread that cannot be started
    return nullptr;
  }
}

void ze_aio_destroy(void* pool) { delete static_cast<Pool*>(pool); }

int64_t ze_aio_submit(void* pool, int32_t write, int32_t fd, int32_t direct_fd, void* buffer, int64_t nbytes,
                      int64_t offset) {
  zero_engine::Transfer t{};
  t.write = write != 0, t.fd = fd, t.direct_fd = direct_fd;
  t.buffer = static_cast<char*>(buffer), t.nbytes = nbytes, t.offset = offset;
  return static_cast<Pool*>(pool)->submit(t);
}

int64_t ze_aio_wait(void* pool, int64_t id, int64_t* outcome) {
  return static_cast<Pool*>(pool)->wait(id, outcome);
}

int32_t ze_aio_poll(void* pool, int64_t id) { return static_cast<int32_t>(static_cast<Pool*>(pool)->poll(id)); }
