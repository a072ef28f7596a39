"""The C++ extension's ops against the best plain-torch way to do the same thing, in one run.

    python benchmarks/bench_ops.py [--mib 64] [--repeats 7]

Memory-bound ops are judged by bandwidth: each row's GB/s counts the bytes the op must read and
write, and is also given as a fraction of glibc memcpy's bandwidth measured in the same run (the
physical limit here; memcpy moves 2 x size bytes). Rows: flatten many tensors into one buffer
(copy_into vs torch.cat(out=), torch._utils._flatten_dense_tensors, torch.cat), the fused cast+scale
copy (bf16 gradients -> fp32 bucket x 1/N vs copy_ then mul_), the fused Adam step with bf16
gradients, unscale/clip and the bf16 copy-out (adam_step vs torch.optim.AdamW(fused=True) plus the
passes it needs), adding a bf16 segment into an fp32 accumulator (accumulate vs a mixed-dtype add_ and
an add_ of src.float()), and the arena (allocate+free, and filling a fresh allocation vs an arena block).
Writes benchmarks/results/ops.md (table, settings) and ops.png (bar chart, if matplotlib is there).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.ops import builder
from engine.ops.accumulate import accumulate
from engine.ops.adam import AdamScalars, AdamTensors, adam_step
from engine.ops.arena import Arena
from engine.ops.flatten import copy_into

RESULTS = ROOT / "benchmarks" / "results"


def timed(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_gbps(nbytes: int, repeats: int, threads: int) -> float:
    """glibc memcpy of `nbytes` split over `threads` threads (ctypes releases the GIL), as the ops use
    that many threads; bytes read + written per second."""
    libc = ctypes.CDLL(None)
    libc.memcpy.restype = ctypes.c_void_p
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    part = nbytes // threads

    with ThreadPoolExecutor(threads) as pool:

        def copy() -> None:
            list(
                pool.map(
                    lambda i: libc.memcpy(dst.data_ptr() + i * part, src.data_ptr() + i * part, part), range(threads)
                )
            )

        return 2 * part * threads / timed(copy, repeats) / 1e9


def pieces(total: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` tensors of uneven sizes adding up to `total` elements."""
    sizes = [total // count + (7 * i) % 97 - 48 for i in range(count - 1)]
    sizes.append(total - sum(sizes))
    return [torch.randn(n).to(dtype) for n in sizes]


def rows_flatten(numel: int, repeats: int) -> list[tuple[str, str, float, int]]:
    srcs = pieces(numel, 64, torch.float32)
    offsets = [0]
    for t in srcs[:-1]:
        offsets.append(offsets[-1] + t.numel())
    dst = torch.empty(numel)
    nbytes = 2 * 4 * numel
    return [
        ("flatten 64 fp32 tensors", "engine copy_into", timed(lambda: copy_into(dst, srcs, offsets), repeats), nbytes),
        ("flatten 64 fp32 tensors", "torch.cat(out=)", timed(lambda: torch.cat(srcs, out=dst), repeats), nbytes),
        (
            "flatten 64 fp32 tensors",
            "torch._utils._flatten_dense_tensors",
            timed(lambda: torch._utils._flatten_dense_tensors(srcs), repeats),
            nbytes,
        ),
        ("flatten 64 fp32 tensors", "torch.cat", timed(lambda: torch.cat(srcs), repeats), nbytes),
    ]


def rows_cast_scale(numel: int, repeats: int) -> list[tuple[str, str, float, int]]:
    srcs = pieces(numel, 64, torch.bfloat16)
    offsets = [0]
    for t in srcs[:-1]:
        offsets.append(offsets[-1] + t.numel())
    dst = torch.empty(numel)
    scale = 0.5

    def two_pass() -> None:
        for t, o in zip(srcs, offsets):
            view = dst[o : o + t.numel()]
            view.copy_(t)
            view.mul_(scale)

    nbytes = (2 + 4) * numel
    return [
        (
            "bf16 grads -> fp32 bucket x 1/N",
            "engine copy_into (one pass)",
            timed(lambda: copy_into(dst, srcs, offsets, scale), repeats),
            nbytes,
        ),
        ("bf16 grads -> fp32 bucket x 1/N", "torch copy_ + mul_ (two passes)", timed(two_pass, repeats), nbytes),
    ]


def rows_adam(numel: int, repeats: int) -> list[tuple[str, str, float, int]]:
    params = pieces(numel, 200, torch.float32)
    grads = [torch.randn_like(p).bfloat16() for p in params]
    avgs = [torch.zeros_like(p) for p in params]
    sqs = [torch.zeros_like(p) for p in params]
    lps = [p.bfloat16() for p in params]
    step = [0]
    coef = 1 / 1024

    def fused() -> None:
        step[0] += 1
        hyper = AdamScalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step[0], grad_scale=coef)
        adam_step(AdamTensors(params, grads, avgs, sqs, lps), hyper)

    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(torch_params, lr=1e-3, weight_decay=0.01, fused=True)

    def torch_way() -> None:
        for p, g in zip(torch_params, grads):
            p.grad = g.float().mul_(coef)  # unscale/clip pass on the fp32 copy of the bf16 gradient
        opt.step()
        with torch.no_grad():
            for lp, p in zip(lps, torch_params):
                lp.copy_(p)  # the bf16 model copy

    nbytes = 28 * numel  # grad 2 + param 4+4 + m 4+4 + v 4+4 + bf16 copy 2
    return [
        (
            "Adam step, bf16 grads, unscale+clip, bf16 copy",
            "engine adam_step (one pass)",
            timed(fused, repeats),
            nbytes,
        ),
        (
            "Adam step, bf16 grads, unscale+clip, bf16 copy",
            "torch AdamW(fused=True) + scale + cast passes",
            timed(torch_way, repeats),
            nbytes,
        ),
    ]


def rows_accumulate(numel: int, repeats: int) -> list[tuple[str, str, float, int]]:
    src = torch.randn(numel).bfloat16()  # `numel` bf16 elements: the arriving segment
    dst = torch.randn(numel)
    task = f"bf16 segment ({numel * 2 >> 20} MiB) += into fp32"
    nbytes = (2 + 4 + 4) * numel  # read src and dst, write dst
    return [
        (task, "engine accumulate (one pass)", timed(lambda: accumulate(dst, src), repeats), nbytes),
        (task, "torch dst.add_(src) (mixed dtype)", timed(lambda: dst.add_(src), repeats), nbytes),
        (task, "torch dst.add_(src.float())", timed(lambda: dst.add_(src.float()), repeats), nbytes),
    ]


def rows_arena(nbytes: int, repeats: int) -> list[tuple[str, str, float, int]]:
    arena = Arena(4 * nbytes, config_key="bench_ops arena")
    numel = nbytes // 4

    def arena_alloc_free() -> None:
        for _ in range(16):
            t = arena.allocate([numel // 16], torch.float32)
            del t

    def torch_alloc_free() -> None:
        for _ in range(16):
            t = torch.empty(numel // 16)
            del t

    def arena_fill() -> None:
        arena.allocate([numel], torch.float32).fill_(1.0)

    def fresh_fill() -> None:
        torch.empty(numel).fill_(1.0)

    return [
        ("allocate + free 16 blocks", "engine Arena", timed(arena_alloc_free, repeats), 0),
        ("allocate + free 16 blocks", "torch.empty", timed(torch_alloc_free, repeats), 0),
        ("allocate + fill one buffer", "engine Arena block (pre-touched)", timed(arena_fill, repeats), nbytes),
        ("allocate + fill one buffer", "fresh torch.empty (first-touch faults)", timed(fresh_fill, repeats), nbytes),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="fp32 MiB per buffer (default 64)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    status = builder.status()
    numel = args.mib * 2**20 // 4
    limit = memcpy_gbps(args.mib * 2**20, args.repeats, torch.get_num_threads())
    rows = (
        rows_flatten(numel, args.repeats)
        + rows_cast_scale(numel, args.repeats)
        + rows_adam(numel // 2, args.repeats)
        + rows_accumulate(2 * numel, args.repeats)
        + rows_arena(args.mib * 2**20, args.repeats)
    )
    lines = [
        f"# Extension ops vs plain torch, {args.mib} MiB buffers, {torch.get_num_threads()} thread(s)",
        "",
        (
            f"Extension: {status.state} ({status.simd}); torch {torch.__version__}; {platform.processor() or 'cpu'}, "
            f"{os.cpu_count()} cores. glibc memcpy on {torch.get_num_threads()} thread(s), measured in this run: "
            f"**{limit:.1f} GB/s** (read + write). GB/s counts the bytes each op must read and write; the last "
            "column is a torch row's time over the engine row's time for the same task (above 1: the engine's "
            "op is faster)."
        ),
        "",
        "| task | implementation | median ms | GB/s | of memcpy | speed-up vs this row |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    firsts: dict[str, float] = {}
    for task, impl, seconds, nbytes in rows:
        firsts.setdefault(task, seconds)
        gbps = nbytes / seconds / 1e9 if nbytes else 0.0
        of_memcpy = f"{gbps / limit:.0%}" if nbytes else "-"
        lines.append(
            f"| {task} | {impl} | {seconds * 1e3:.2f} | {gbps:.1f} | {of_memcpy} | "
            f"{seconds / firsts[task]:.2f}x the engine's time |"
            if impl.startswith(("torch", "fresh"))
            else f"| {task} | {impl} | {seconds * 1e3:.2f} | {gbps:.1f} | {of_memcpy} | - |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ops.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"{task}\n{impl}" for task, impl, _, _ in rows]
    values = [s * 1e3 for _, _, s, _ in rows]
    colors = ["tab:blue" if impl.startswith("engine") else "tab:gray" for _, impl, _, _ in rows]
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("median ms (lower is better); blue: engine op, grey: plain torch")
    ax.set_title(f"Extension ops, {args.mib} MiB, memcpy {limit:.1f} GB/s")
    fig.tight_layout()
    fig.savefig(RESULTS / "ops.png", dpi=120)


if __name__ == "__main__":
    main()
