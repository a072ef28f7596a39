"""Read and write GB/s of engine/ops/aio.py's two back-ends against dd, on one file system.

    python benchmarks/bench_aio.py [--dir /tmp] [--gib 1] [--repeats 5]
    python benchmarks/bench_aio.py --from-json benchmarks/results/aio.json   # table and plot again

One preallocated file of --gib GiB in --dir is written whole from one 4096-aligned buffer and read
whole back into another (so every 1 MiB block goes through O_DIRECT), by the compiled pool
(csrc/cpu/aio.cpp) and the Python fallback (os.pwritev/os.preadv on a thread pool) at 1, 2 and 4
threads (block_size 1 MiB, queue_depth 8: DeepSpeed's defaults), and by `dd bs=1M oflag=direct
conv=notrunc` and `dd bs=1M iflag=direct` on the same file, in rounds that time each of them once (so
other work on the machine slows all alike). No fsync on either side (O_DIRECT bypasses the page cache
on both). One extra row per back-end moves a buffer one byte off alignment, so every block goes
through the page cache: what a caller without aligned_empty() gets. Every read-back is compared with
what was written. Then: how much of a read a matmul loop on the calling thread hides. fio is not
installed on this machine, so dd is the reference. The file is deleted at the end. Writes
benchmarks/results/aio.md, aio.json and aio.png (with matplotlib; else run --from-json where it is).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20


def _dd_seconds(args: list[str]) -> float:
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.eE+-]+) s", done.stderr)
    if match is None:
        raise RuntimeError(f"cannot read dd's time from: {done.stderr}")
    return float(match.group(1))


def _fact(command: list[str], pick: str) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown"
    lines = [line for line in out.splitlines() if pick in line or pick == ""]
    return " ".join(lines[-1].split()) if lines else "unknown"


def measure(folder: Path, gib: float, repeats: int) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    from engine.ops.aio import AioConfig, AioContext, aligned_empty, open_file

    load_before = os.getloadavg()[0]
    nbytes = int(gib * (1 << 30)) // MIB * MIB
    path = folder / "zero_engine_bench_aio.bin"
    path.unlink(missing_ok=True)
    file = open_file(path, create=True)
    rows: list[dict[str, Any]] = []
    try:
        os.posix_fallocate(file.fd, 0, nbytes)
        source = aligned_empty(nbytes, torch.uint8)
        source.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        target = aligned_empty(nbytes, torch.uint8)
        blocks = str(nbytes // MIB)
        dd_write = ["if=/dev/zero", f"of={path}", "bs=1M", f"count={blocks}", "oflag=direct", "conv=notrunc"]
        dd_read = [f"if={path}", "of=/dev/null", "bs=1M", f"count={blocks}", "iflag=direct"]
        unaligned_src = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
        unaligned_src.copy_(source)
        unaligned_dst = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
        configs = [(b, t, a) for b in ("compiled", "python") for t, a in ((1, True), (2, True), (4, True), (2, False))]
        contexts = [AioContext(AioConfig(thread_count=t, backend=b)) for b, t, _ in configs]
        times: dict[int, tuple[list[float], list[float]]] = {i: ([], []) for i in range(-1, len(configs))}
        direct: dict[int, list[int]] = {}
        # Round-robin: each round times dd and every configuration once, so a burst of other work on the
        # machine slows all of them alike, and the ratios to dd stay meaningful. Round 0 is a warm-up (a
        # first buffered write into preallocated extents ran at 0.25 GB/s here, later ones at 8).
        for round_ in range(repeats + 1):
            timed = round_ > 0
            w, r = _dd_seconds(dd_write), _dd_seconds(dd_read)
            if timed:
                times[-1][0].append(w)
                times[-1][1].append(r)
            for index, ((backend, threads, aligned), ctx) in enumerate(zip(configs, contexts)):
                src, dst = (source, target) if aligned else (unaligned_src, unaligned_dst)
                dst.zero_()
                start = time.perf_counter()
                handle = ctx.write(file, src, 0)
                handle.wait()
                write_s = time.perf_counter() - start
                os.fdatasync(file.fd)  # untimed: the buffered rows' dirty pages reach the disk, then leave
                os.posix_fadvise(file.fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # the cache: reads come from disk
                start = time.perf_counter()
                read = ctx.read(file, dst, 0)
                read.wait()
                read_s = time.perf_counter() - start
                if not torch.equal(dst, src):
                    raise RuntimeError(f"{backend}, {threads} threads: the read-back differs from what was written")
                if timed:
                    times[index][0].append(write_s)
                    times[index][1].append(read_s)
                direct[index] = [handle.direct_bytes, read.direct_bytes]
            print(f"round {round_} done", flush=True)
        for ctx in contexts:
            ctx.close()
        rows.append(_row("dd (oflag/iflag=direct, bs=1M)", "-", 1, nbytes, *times[-1], 0, 0))
        for index, (backend, threads, aligned) in enumerate(configs):
            buffer = "aligned" if aligned else "unaligned"
            rows.append(_row(backend, buffer, threads, nbytes, *times[index], *direct[index]))
        del unaligned_src, unaligned_dst
        overlap = [
            _overlap(AioContext(AioConfig(thread_count=2, backend=b)), file, target, b) for b in ("compiled", "python")
        ]
    finally:
        file.close()
        path.unlink(missing_ok=True)
    return {
        "bytes": nbytes,
        "repeats": repeats,
        "folder": str(folder),
        "df": _fact(["df", "-T", str(folder)], ""),
        "cpu": _fact(["lscpu"], "Model name"),
        "kernel": os.uname().release,
        "rows": rows,
        "overlap": overlap,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def _overlap(ctx: Any, file: Any, buffer: Any, backend: str, repeats: int = 5) -> dict[str, Any]:
    """Does a read run while this thread computes? Times a whole-file read alone, about as long a run of
    matmuls alone (one torch thread), and both at once (the read submitted, the matmuls run, then wait);
    medians of `repeats`."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(50):
        a @ a
    per_matmul = (time.perf_counter() - start) / 50

    def timed(fn: Any) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    count = max(1, int(timed(lambda: ctx.read(file, buffer, 0).wait()) / per_matmul))

    def compute() -> None:
        for _ in range(count):
            a @ a

    def both() -> None:
        handle = ctx.read(file, buffer, 0)
        compute()
        handle.wait()

    rounds = [
        (timed(lambda: ctx.read(file, buffer, 0).wait()), timed(compute), timed(both)) for _ in range(repeats)
    ]  # interleaved, so that other work on the machine weighs on all three alike
    io_alone, compute_alone, together = (statistics.median(r[k] for r in rounds) for k in range(3))
    ctx.close()
    hidden = (io_alone + compute_alone - together) / min(io_alone, compute_alone)
    return {"backend": backend, "io_s": io_alone, "compute_s": compute_alone, "both_s": together, "hidden": hidden}


def _row(
    backend: str, buffer: str, threads: int, nbytes: int, writes: list[float], reads: list[float], wd: int, rd: int
) -> dict[str, Any]:
    return {
        "backend": backend,
        "buffer": buffer,
        "threads": threads,
        "write_gbps": nbytes / statistics.median(writes) / 1e9,
        "read_gbps": nbytes / statistics.median(reads) / 1e9,
        "write_direct": wd / nbytes if backend != "dd (oflag/iflag=direct, bs=1M)" else 1.0,
        "read_direct": rd / nbytes if backend != "dd (oflag/iflag=direct, bs=1M)" else 1.0,
    }


def write_table(data: dict[str, Any], out: Path) -> None:
    dd = data["rows"][0]
    lines = [
        "# Async I/O: engine/ops/aio.py's back-ends against dd, one file system",
        "",
        (
            f"A {data['bytes'] / 2**30:.2f} GiB preallocated file in {data['folder']}, written whole from one buffer "
            f"and read whole back (median of {data['repeats']} rounds, each timing dd and every row once, after one "
            "untimed round; 1 MiB blocks, queue_depth 8); GB/s = 1e9 bytes/s. `direct`: the share of bytes that "
            "went through O_DIRECT. Ratios: over dd's figure in the same run. Unaligned rows: the buffer one byte "
            "off a 4096 boundary, so every block goes through the page cache (a write there is a copy into memory, "
            "the disk is written later; the file's pages are synced and dropped, untimed, before each read). No "
            "fsync inside any timing. fio is not installed here: dd is the reference."
        ),
        "",
        "| backend | buffer | threads | write GB/s | write / dd | read GB/s | read / dd | direct (w/r) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['backend']} | {row['buffer']} | {row['threads']} | {row['write_gbps']:.2f} | "
            f"{row['write_gbps'] / dd['write_gbps']:.2f} | {row['read_gbps']:.2f} | "
            f"{row['read_gbps'] / dd['read_gbps']:.2f} | {row['write_direct']:.0%} / {row['read_direct']:.0%} |"
        )
    lines += [
        "",
        (
            "Overlap: a whole-file read (2 threads) alone, fp32 256x256 matmuls on this thread alone (one torch "
            "thread; as many as take about as long as the read), and both at once (read submitted, matmuls, then "
            "wait); medians of 5 interleaved rounds. hidden = (read + compute - both) / the shorter of the two: 1 "
            "when the shorter one is hidden completely, 0 when they ran one after the other (over 1: noise of the "
            "shared cores)."
        ),
        "",
        "| backend | read alone s | compute alone s | both s | hidden |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {o['backend']} | {o['io_s']:.3f} | {o['compute_s']:.3f} | {o['both_s']:.3f} | {o['hidden']:.2f} |"
            for o in data.get("overlap", [])
        ),
        "",
        "Machine:",
        f"- CPU: {data['cpu']}; {os.cpu_count()} logical cores; kernel {data['kernel']}",
        f"- file system (df -T): {data['df']}",
        (
            f"- date: {data['date']}; 1-minute load average {data['load_before']:.2f} before the run, "
            f"{data['load_after']:.2f} after (up to 4 I/O threads and dd run here; more means other work "
            "shared the 2 cores and the figures are noisier)"
        ),
        "",
    ]
    out.write_text("\n".join(lines))


def plot(data: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no matplotlib: run `python {__file__} --from-json {out.with_suffix('.json')}` where it is installed)")
        return
    rows = data["rows"]
    fs_type = data["df"].split()[1] if len(data["df"].split()) > 1 else ""
    labels = [
        r["backend"].split(" ")[0] + ("" if r["backend"].startswith("dd") else f"\n{r['threads']}t {r['buffer']}")
        for r in rows
    ]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar([i - 0.2 for i in x], [r["write_gbps"] for r in rows], 0.4, label="write")
    ax.bar([i + 0.2 for i in x], [r["read_gbps"] for r in rows], 0.4, label="read")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"aio back-ends vs dd, {data['bytes'] / 2**30:.2f} GiB file, {fs_type}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--from-json", type=Path, default=None, help="rewrite the table and plot of a saved run")
    args = parser.parse_args()
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        write_table(data, args.from_json.with_suffix(".md"))
        plot(data, args.from_json.with_suffix(".png"))
        return
    data = measure(args.dir, args.gib, args.repeats)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "aio.json").write_text(json.dumps(data, indent=1))
    write_table(data, RESULTS / "aio.md")
    plot(data, RESULTS / "aio.png")
    print((RESULTS / "aio.md").read_text())


if __name__ == "__main__":
    main()
