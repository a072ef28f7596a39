"""NVMe offload, whole (ZeRO-Infinity): the optimizer state, fp32 masters and stage 3's gradients in
swap files, and the swapped optimizer step over them. It sits above engine/ops (whose aio.py moves the
bytes and whose fused Adam computes) and engine/comm (every rank sets up or refuses together), and
below engine/zero, whose stages hold one OptimizerSwap as their offload tier (or none) and call it.

The swap (what a stage holds):
- optimizer_swap.py: OptimizerSwap, the swapped state of the step's targets, the step over it (in line,
  or behind the next forward), the reads of stage 3's gathers, resident() for a checkpoint;
  see [Note: the swapped step] and [Note: the step behind the next forward].
- sub_groups.py: where each target's sub-groups lie in its files (pure bookkeeping).
- swapped_run.py: one step's loop over the sub-groups through the host buffers.
- step_thread.py: the thread a step runs in behind the forward, with an event per target.
- nvme_setup.py: the settings read from the config, the rank's swap folder and stage 3's mapped
  gradients, each made on every rank or refused on all.
- staged_writes.py: stage 3's gradient writes with O_DIRECT through a few staging buffers.

The storage under it:

    from engine.offload import AioConfig, AioContext, SwapDir
    context = AioContext(AioConfig.from_section(ds_config.get("aio", {})))
    swap = SwapDir.create(nvme_path, rank, run_id, config_key="zero_optimization.offload_optimizer.nvme_path")
    master = swap.file("fp32_master.0", numel, torch.float32, context)  # <swap.path>/fp32_master.0.swp
    handle = master.write(shard, offset=0)   # returns at once; `shard` must not change until waited
    ...                                      # compute overlaps the transfer
    handle.wait()                            # bytes moved, after the size checks
    master.read(buffer, offset=0).wait()
    swap.close(); context.close()            # files and folder removed (also at exit, and after a crash
                                             # by the next start on this host)

- swap_dir.py: SwapDir, the folder <nvme_path>/zero_engine_swap/<run id>/rank<k>/ with its owner.json
  (pid, host, start time), made after removing the folders of dead processes of this host, removed on
  close and at exit; check_nvme_path (missing, non-directory or read-only paths are SwapPathError).
  `run_id` must be the same on every rank of a run (e.g. rank 0's, broadcast) and differ between runs.
- swap_file.py: SwapFile, `<name>.swp` of `numel` elements of one dtype, space reserved at creation;
  read/write by element offset return a SwapHandle; see [Note: what a swap file checks].
- mapped_file.py: MappedFile, a swap file mapped shared into memory as a plain tensor (stage 3's shard
  gradients with the optimizer on NVMe), space reserved at creation; see [Note: state the step touches
  in place].
- errors.py: SwapPathError, SwapFileError. engine/ops/aio.py's AioError (a short or failed transfer:
  path, offset, bytes expected and moved, errno text) and DiskFullError (ENOSPC/EFBIG/EDQUOT, with the
  file system's free space) are re-exported here.

DeepSpeed's `aio` section becomes AioConfig (engine/ops/aio.py), the parameters of an AioContext:
- block_size (1 MiB): each transfer is cut into requests of this many bytes (one pread/pwrite each);
  a multiple of 4096 keeps every request of an aligned transfer on O_DIRECT.
- queue_depth (8) and intra_op_parallelism, or its older name thread_count (1): DeepSpeed keeps
  queue_depth requests in flight in each of its thread_count threads; a thread here has one blocking
  request in flight, so the pool runs thread_count x queue_depth threads (at most 64), each taking
  one block at a time: the same requests in flight.
- single_submit (false): accepted, no effect (a thread here submits one request at a time anyway).
- overlap_events (true): accepted, no effect: a thread pool has no separate submit and reap phases;
  transfers always overlap with the caller.
- use_gds must be false (GPUDirect Storage is CUDA-only).
The back-end is csrc/cpu/aio.cpp's C++ thread pool when the CPU ops library is built, else the
os.preadv/os.pwritev fallback; a request goes through O_DIRECT when its buffer address, file offset and
size are multiples of 4096 (aligned_empty() makes such buffers), through the page cache otherwise.
Measured here (benchmarks/bench_aio.py, results/aio.md: 1 GiB on ext4, 2 cores shared with other
work, so noisy): at 2-4 threads both back-ends write 2.0-2.8x and read 1.4-2.0x dd's O_DIRECT rate of
the same run, at 1 thread 0.9-1.5x; an unaligned buffer (page cache) reads at 0.4-0.6x; a read runs
while the calling thread computes (hidden share 1.2 with the compiled pool, 0.5-0.95 with the fallback
over two runs: its threads take the GIL between blocks).
"""

from engine.offload.errors import SwapFileError, SwapPathError
from engine.offload.mapped_file import MappedFile
from engine.offload.swap_dir import SwapDir, check_nvme_path
from engine.offload.swap_file import SwapFile, SwapHandle
from engine.ops.aio import AioConfig, AioContext, AioError, DiskFullError, aligned_empty

__all__ = [
    "AioConfig",
    "AioContext",
    "AioError",
    "DiskFullError",
    "MappedFile",
    "SwapDir",
    "SwapFile",
    "SwapFileError",
    "SwapHandle",
    "SwapPathError",
    "aligned_empty",
    "check_nvme_path",
]
