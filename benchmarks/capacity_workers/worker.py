"""One rank of one bench_capacity attempt: build a GPT of the given shape, train it 2 steps, write a JSON.

Started twice by benchmarks/bench_capacity.py (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment,
as torchrun would set them), with this checkout's .venv for ddp, fsdp2 and the engine rows and
$DEEPSPEED_PYTHON's venv (DeepSpeed 0.19.8) for the DeepSpeed rows, so it imports nothing of the engine at module
level (DeepSpeed's venv has no engine).

    worker.py --system S --layers L --d-model D --heads H --vocab V --seq 128 --steps 2 --out DIR [--nvme DIR]

Each rank writes DIR/rank<r>.json: ru_maxrss (KiB) at the start, after wrapping and after the last
step, the seconds of every step, the bytes this process read from and wrote to storage during each
step (/proc/self/io read_bytes/write_bytes: every thread's real I/O, O_DIRECT included, the page
cache's hits not), and the disk bytes its swap folder holds after the steps (NVMe rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # this checkout's engine (the engine rows)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch
from gpt import GPT, GPTConfig

LR = 1e-4
SYSTEMS = ("ddp", "fsdp2", "deepspeed-3", "deepspeed-3-nvme", "engine-3", "engine-3-nvme")
SUB_GROUP = 20_000_000
LIVE = 100_000_000
"""stage3_max_live_parameters and stage3_max_reuse_distance of the stage-3 rows (elements): 0.4 GB of
fp32 gathered parameters a rank beyond the units in use."""
"""sub_group_size of the NVMe rows (elements stepped at a time): buffer_count (4) x 20M x 12 B = 0.96 GB
of host buffers whatever the model; DeepSpeed's default of 1e9 would need 48 GB."""


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process (all its threads) moved to or from storage so far."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _disk_bytes(folder: str | None) -> int:
    """Bytes allocated on disk under `folder` (st_blocks, so reserved space counts)."""
    total = 0
    for base, _, files in os.walk(folder or "/nonexistent"):
        for name in files:
            try:
                total += os.stat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Phases:
    """Seconds of the forward, backward and step() of each engine or DeepSpeed step, with what the whole
    machine did meanwhile: CPU busy (share of all cores, /proc/stat) and, for the disk holding the swap
    folder, bytes read and written and busy time (/proc/diskstats: the share of the phase with requests in
    flight). Machine-wide, so both ranks' work shows in either rank's record."""

    def __init__(self, folder: str | None) -> None:
        self.steps: list[dict[str, dict[str, float]]] = []
        dev = os.stat(folder).st_dev if folder else None
        self._disk = None if dev is None else (os.major(dev), os.minor(dev))

    def _sample(self) -> tuple[float, int, int, int, int, int]:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]
        read = written = busy_ms = 0
        if self._disk is not None:
            with open("/proc/diskstats") as f:
                for line in f:
                    v = line.split()
                    if (int(v[0]), int(v[1])) == self._disk:
                        read, written, busy_ms = int(v[5]) * 512, int(v[9]) * 512, int(v[12])
        return time.perf_counter(), sum(ticks), ticks[3] + ticks[4], read, written, busy_ms

    def run(self, **phases: Callable[[], None]) -> None:
        """Run the phases in order, recording each."""
        record, last = {}, self._sample()
        for name, phase in phases.items():
            phase()
            now = self._sample()
            seconds, ticks = now[0] - last[0], max(now[1] - last[1], 1)
            record[name] = {
                "s": seconds,
                "cpu_busy": 1 - (now[2] - last[2]) / ticks,
                "disk_read": now[3] - last[3],
                "disk_written": now[4] - last[4],
                "disk_busy": (now[5] - last[5]) / 1e3 / max(seconds, 1e-9),
            }
            last = now
        self.steps.append(record)


PHASES: Phases | None = None
"""The engine and DeepSpeed rows' phase records (main() makes it)."""


def _ds_config(nvme: str | None, largest_param: int = 0) -> dict[str, Any]:
    """The stage-3 config of DeepSpeed and the engine rows. `largest_param`: elements of the largest
    parameter (the embedding), which DeepSpeed's parameter swap buffers must hold (offload_param.buffer_size;
    its default 1e8 is refused above d_model 1989)."""
    # DeepSpeed's defaults keep up to 1e9 gathered elements live (4 GB a rank in fp32) and every unit reused
    # within 1e9 elements gathered from forward to backward: the whole model, at these sizes. Its docs say
    # to lower both when memory is short; the same values go to DeepSpeed and the engine.
    zero: dict[str, Any] = {"stage": 3, "stage3_max_live_parameters": LIVE, "stage3_max_reuse_distance": LIVE}
    if nvme:
        zero.update(
            offload_optimizer={
                "device": "nvme",
                "nvme_path": nvme,
                "buffer_count": 4,
                "pipeline_read": True,
                "pipeline_write": True,
            },
            offload_param={"device": "nvme", "nvme_path": nvme, "buffer_size": max(largest_param, 100_000_000)},
            sub_group_size=SUB_GROUP,
        )
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _torch_step(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> Callable[..., None]:
    opt = torch.optim.Adam(params, lr=LR, foreach=False)  # foreach would copy every state list at once

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()

    return step


def _build(args: argparse.Namespace, cfg: GPTConfig) -> tuple[Callable[..., None], Callable[[], None]]:
    """The model wrapped by the system under test: (step(x, y), close())."""
    system, nvme = args.system, args.nvme
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(GPT(cfg))
        return _torch_step(ddp, list(ddp.parameters())), lambda: None
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _torch_step(model, list(model.parameters())), lambda: None
    if system.startswith("deepspeed"):
        import deepspeed

        conf = _ds_config(nvme, cfg.vocab_size * cfg.d_model)
        if nvme:
            # Its pipelined swapper fails an assertion at 225M params with these buffers (pipelined_optimizer_
            # swapper.py: `assert new_alloc_buffers is not None`, DeepSpeed's "not enough buffers"): its
            # default, unpipelined, runs.
            conf["zero_optimization"]["offload_optimizer"].update(pipeline_read=False, pipeline_write=False)
        if not nvme:
            conf["optimizer"]["params"]["torch_adam"] = True  # no offload: its CPU Adam is refused
            conf["zero_force_ds_cpu_optimizer"] = False
        with deepspeed.zero.Init(config_dict_or_path=conf):
            model = GPT(cfg)
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    else:
        import engine

        conf = _ds_config(nvme, cfg.vocab_size * cfg.d_model)
        if args.arena:  # the engine's own key: gathered units and buckets from a pre-touched arena
            conf["zero_optimization"]["stage3_arena_bytes"] = args.arena
        with engine.zero.Init(config_dict_or_path=conf):
            model = GPT(cfg)
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=conf)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        assert PHASES is not None
        loss: list[torch.Tensor] = []
        PHASES.run(
            forward=lambda: loss.append(eng(x, y)), backward=lambda: eng.backward(loss[0]), step=lambda: eng.step()
        )

    return step, eng.destroy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    for name in ("--layers", "--d-model", "--heads", "--vocab", "--seq", "--steps"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme", default=None)
    parser.add_argument("--arena", type=int, default=0, help="engine rows: zero_optimization.stage3_arena_bytes")
    args = parser.parse_args()
    if args.system.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=3600))
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    g = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g),) * 2 for _ in range(args.steps)]
    rec: dict[str, Any] = {"rank": rank, "maxrss_start": _maxrss_kib()}
    torch.manual_seed(0)
    global PHASES
    PHASES = Phases(args.nvme)
    step, close = _build(args, cfg)
    rec["maxrss_wrapped"] = _maxrss_kib()
    times, io = [], []
    for x, y in data:
        torch.distributed.barrier()
        io0, t0 = _io(), time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
        io1 = _io()
        io.append([io1[0] - io0[0], io1[1] - io0[1]])
    rec.update(maxrss_after=_maxrss_kib(), times=times, io=io, disk_bytes=_disk_bytes(args.nvme), phases=PHASES.steps)
    close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
