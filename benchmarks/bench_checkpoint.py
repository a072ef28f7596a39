"""What checkpoint integrity costs: the CRC-32 taken while each file is written, and checked before it
is read, against the save and load times of the same checkpoint, in the same run.

    python benchmarks/bench_checkpoint.py --params 25e6      # ~300 MB of fp32 master + Adam state

One process (world size 1, stage 1, fp32 AdamW after one step). Save: median of 3 save_checkpoint
calls; the CRC's share is the time to CRC the written files (what the streaming writer adds).
Load: median of 3 load_checkpoint calls, each verifying every file; the check's share is
file_crc32 over them. Files are in the page cache (just written), as when a job resumes on the
machine that saved. Then the stdlib's candidate hashes over the same files (median of 3 passes), to
show why CRC-32 is the one taken: it detects the accidents it is for (flipped, lost or truncated
bytes) and is the fastest. Results: benchmarks/results/checkpoint.md (and .png with matplotlib).

    python benchmarks/bench_checkpoint.py --consolidate --params 1.85e8   # ~2.2 GB engine checkpoint

Consolidation: the same model (Linear layers of 4096^2 + bias, fp32 AdamW, one step, 2 ranks, ZeRO
stage 2) saved by real DeepSpeed (its venv, $DEEPSPEED_PYTHON, DS_ACCELERATOR=cpu) and by the engine, then
consolidated into safetensors by DeepSpeed's zero_to_fp32 (convert_zero_checkpoint_to_fp32_state_dict,
safe_serialization=True) and by `engine.checkpoint.consolidate`. The DeepSpeed parts run in DeepSpeed's venv (this file,
with --ds-save / --ds-convert: nothing of the engine imported there). Results: benchmarks/results/consolidate.md and .png.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import ds_python, machine_facts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Zlib:
    """zlib's running checksums behind hashlib's update()."""

    def __init__(self, fn: Callable[[bytes, int], int], start: int) -> None:
        self.fn, self.value = fn, start

    def update(self, data: bytes) -> None:
        self.value = self.fn(data, self.value)


HASHES: dict[str, Callable[[], object]] = {
    "zlib.crc32 (taken)": lambda: _Zlib(zlib.crc32, 0),
    "zlib.adler32": lambda: _Zlib(zlib.adler32, 1),
    "hashlib.blake2b": hashlib.blake2b,
    "hashlib.sha256": hashlib.sha256,
}


def _hash_seconds(files: list[str], make: Callable[[], object], chunk: int = 16 << 20) -> float:
    t0 = time.perf_counter()
    for path in files:
        digest = make()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                digest.update(block)  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--consolidate", action="store_true", help="the consolidation benchmark instead")
    parser.add_argument("--workdir", default=None, help="consolidation: where the checkpoints go (deleted after)")
    parser.add_argument("--keep", action="store_true", help="consolidation: keep the checkpoints in --workdir")
    parser.add_argument(
        "--before",
        default=None,
        help="consolidation: a source tree of an earlier commit (git archive), whose engine saves a checkpoint too: "
        "rows for it, consolidated by this engine, measured in the same rounds",
    )
    parser.add_argument("--rounds", type=int, default=None, help="consolidation: rounds (default 3)")
    parser.add_argument("--ds-save", default=None, help=argparse.SUPPRESS)  # in DeepSpeed's venv: save there
    args = parser.parse_args()
    if args.ds_save:
        torch.multiprocessing.spawn(_save_rank, args=("deepspeed", args.ds_save, args.params, _free_port()), nprocs=2)
        return
    if args.rounds is not None:
        global REPEATS
        REPEATS = max(1, args.rounds)
    if args.consolidate:
        consolidate_benchmark(args.params, args.workdir, args.keep, args.before)
        return
    integrity(args)


def integrity(args: argparse.Namespace) -> None:
    import engine
    from engine.checkpoint.atomic_file import file_crc32

    load_before = os.getloadavg()
    width = 2048
    layers = max(1, round(args.params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": None,
    }
    eng, *_ = engine.initialize(model=model, config=cfg)
    eng.backward(eng(torch.randn(2, width)).pow(2).mean())
    eng.step()
    with tempfile.TemporaryDirectory() as tmp:
        saves, crcs, loads, checks = [], [], [], []
        for i in range(3):
            t0 = time.perf_counter()
            path = eng.save_checkpoint(tmp, tag=f"t{i}")
            saves.append(time.perf_counter() - t0)
            files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".pt")]
            t0 = time.perf_counter()
            for f in files:
                file_crc32(f)
            crcs.append(time.perf_counter() - t0)
        size = sum(os.path.getsize(f) for f in files)
        for _ in range(3):
            t0 = time.perf_counter()
            eng.load_checkpoint(tmp)
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for f in files:
                file_crc32(f)
            checks.append(time.perf_counter() - t0)
        hashes = {
            name: statistics.median(_hash_seconds(files, make) for _ in range(3)) for name, make in HASHES.items()
        }
    eng.destroy()
    save, crc, load, check = (statistics.median(x) for x in (saves, crcs, loads, checks))
    rows = [
        ("save_checkpoint (CRC-32 streamed while writing)", save, crc),
        ("load_checkpoint (every file checked before reading)", load, check),
    ]
    lines = [
        f"# Checkpoint integrity cost ({size / 1e6:.0f} MB checkpoint, {layers} x {width}^2 params, fp32 AdamW)",
        "",
        "| operation | median s | CRC-32 part s | CRC share |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {total:.3f} | {part:.3f} | {part / total:.1%} |" for name, total, part in rows]
    lines += [
        "",
        f"Candidate hashes over the same {size / 1e6:.0f} MB of files (page cache, 16 MiB reads):",
        "",
        "| hash | median s | GB/s | share of the save |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {t:.3f} | {size / t / 1e9:.2f} | {t / save:.1%} |" for name, t in hashes.items()]
    lines += ["", "Machine:", *machine_facts(ROOT, load_before, busy_cores=1)]
    plt = _write_table("checkpoint.md", lines)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["save", "load"]
    ax.barh(names, [save, load], label="total")
    ax.barh(names, [crc, check], label="CRC-32 part")
    ax.set_xlabel("seconds (median of 3)")
    ax.set_title(f"Checkpoint integrity cost, {size / 1e6:.0f} MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benchmarks", "results", "checkpoint.png"), dpi=100)


# ---------------------------------------------------------------------------------------- consolidation


WIDTH = 4096
REPEATS = 3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(params: float) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(params / (WIDTH * WIDTH)))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _save_rank(rank: int, which: str, save_dir: str, params: float, port: int) -> None:
    """One of 2 ranks: build the model, one AdamW step at ZeRO stage 2, save_checkpoint (DeepSpeed's or ours)."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()} | {"MASTER_ADDR": "127.0.0.1"})
    torch.set_num_threads(1)
    model = _model(params)
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
    }
    if which == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        import engine

        config["optimizer"]["params"].pop("torch_adam")
        eng, *_ = engine.initialize(model=model, config=config)
    eng.backward(eng(torch.randn(1, WIDTH)).pow(2).mean())
    eng.step()
    eng.save_checkpoint(save_dir, tag="global_step1")
    torch.distributed.barrier()
    if rank == 0:  # DeepSpeed copies its zero_to_fp32.py beside the checkpoint: not part of it
        for extra in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(save_dir, extra)):
                os.unlink(os.path.join(save_dir, extra))


_CHILD = {
    "deepspeed": (
        "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as convert\n"
        "run = lambda: convert(CKPT, OUT, safe_serialization=True)\n"
    ),
    "engine": (
        "from engine.checkpoint.consolidate import write_safetensors_dir\n"
        "run = lambda: write_safetensors_dir(CKPT, OUT, dtype=DTYPE, workers=WORKERS, verify=VERIFY)\n"
    ),
    # The disk's floor for any tool: the bytes the output is made of (each optimizer file's masters)
    # read by 2 processes in 1 MiB blocks and written into one file, then fsynced; no checks, no work.
    "floor": (
        "import json, multiprocessing, os\n"
        "TAG = os.path.join(CKPT, 'global_step1')\n"
        "heads = json.load(open(os.path.join(TAG, 'manifest.json')))['masters_checksums']\n"
        "runs, at = [], 0\n"
        "for name, m in sorted(heads.items()):\n"
        "    runs.append((os.path.join(TAG, name), m['offset'], m['bytes'], at)); at += m['bytes']\n"
        "def copy(run):\n"
        "    src, offset, n, to = run\n"
        "    fi, fo, buf = os.open(src, os.O_RDONLY), os.open(DST, os.O_WRONLY), bytearray(1 << 20)\n"
        "    for pos in range(0, n, 1 << 20):\n"
        "        got = os.preadv(fi, [memoryview(buf)[: min(1 << 20, n - pos)]], offset + pos)\n"
        "        os.pwrite(fo, memoryview(buf)[:got], to + pos)\n"
        "    os.close(fi); os.fsync(fo); os.close(fo)\n"
        "def run():\n"
        "    os.makedirs(OUT); global DST; DST = os.path.join(OUT, 'floor.safetensors')\n"
        "    with open(DST, 'wb') as f: f.truncate(at)\n"
        "    with multiprocessing.get_context('fork').Pool(WORKERS) as pool: pool.map(copy, runs)\n"
    ),
}
_TIMED = (
    "import json, os, time, psutil, torch\n"
    "rss = psutil.Process().memory_info().rss\n"
    "t0 = time.perf_counter(); run(); t = time.perf_counter() - t0\n"
    "for f in os.listdir(OUT):  # the output on disk: the engine fsyncs its files, DeepSpeed does not\n"
    "    fd = os.open(os.path.join(OUT, f), os.O_RDONLY); os.fsync(fd); os.close(fd)\n"
    "durable = time.perf_counter() - t0\n"
    "print(json.dumps({'seconds': t, 'durable': durable, 'interpreter_rss': rss}))\n"
)


_BEFORE: list[str] = []
"""--before's source tree, when given."""


def _drop_cache(paths: list[str], read: bool) -> None:
    """Inputs out of the page cache (cold: posix_fadvise DONTNEED, per file, no effect on others' files)
    or all read into it (warm)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if read:
                while os.read(fd, 16 << 20):
                    pass
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _measure(tool: str, ckpt: str, out: str, dtype: str, workers: int, verify: bool, cold: bool) -> dict[str, float]:
    """One consolidation in a fresh process: seconds of the call, the interpreter's RSS before it, and
    the peak RSS of the process and its workers together (sampled every 5 ms)."""
    import json
    import shutil
    import subprocess

    import psutil

    files = [os.path.join(ckpt, "global_step1", f) for f in os.listdir(os.path.join(ckpt, "global_step1"))]
    _drop_cache(files, read=not cold)
    shutil.rmtree(out, ignore_errors=True)
    code = f"CKPT, OUT, WORKERS, VERIFY = {ckpt!r}, {out!r}, {workers}, {verify}\n"
    code += f"import torch; DTYPE = torch.{dtype}\n" + _CHILD["engine" if tool == "engine-before" else tool] + _TIMED
    python = ds_python() if tool == "deepspeed" else sys.executable
    tree = _BEFORE[0] if tool == "engine-before" else ROOT  # an earlier commit's engine, from its own files
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": tree}
    proc = psutil.Popen([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=tree)
    peak, main_peak = 0, 0
    while proc.poll() is None:
        try:  # PSS: pages the workers share with the process they were forked from count once
            tree = [proc, *proc.children(recursive=True)]
            peak = max(peak, sum(p.memory_full_info().pss for p in tree))
            main_peak = max(main_peak, proc.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.005)
    stdout = proc.stdout.read().decode() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} consolidation failed ({proc.returncode}): {stdout}")
    result = json.loads(stdout.strip().splitlines()[-1])
    written = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".safetensors")]
    result["out_bytes"] = sum(os.path.getsize(f) for f in written)
    _drop_cache(written, read=False)  # its dirty pages written back now, not during the next run
    shutil.rmtree(out)
    return result | {"peak_pss": peak, "main_rss": main_peak}


def _save_before(tree: str, save_dir: str, params: float) -> None:
    """An engine checkpoint saved by the engine in `tree` (an earlier commit's files), with its own _save_rank."""
    import subprocess

    code = (
        f"import sys, torch; sys.path.insert(0, {os.path.join(tree, 'benchmarks')!r})\n"
        "from bench_checkpoint import _save_rank, _free_port\n"
        f"torch.multiprocessing.spawn(_save_rank, args=('engine', {save_dir!r}, {params}, _free_port()), nprocs=2)\n"
    )
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": tree}, cwd=tree, check=True)


def consolidate_benchmark(params: float, workdir: str | None, keep: bool = False, before: str | None = None) -> None:
    import shutil
    import statistics
    import subprocess
    import tempfile

    load_before = os.getloadavg()
    root = workdir or tempfile.mkdtemp(prefix="bench_consolidate_")
    ds_ckpt, ours_ckpt = os.path.join(root, "deepspeed"), os.path.join(root, "engine")
    try:
        if not os.path.isdir(ds_ckpt):  # --keep: an earlier run's checkpoints are reused
            subprocess.run(
                [ds_python(), os.path.abspath(__file__), "--ds-save", ds_ckpt, "--params", str(params)],
                env={**os.environ, "DS_ACCELERATOR": "cpu"},
                check=True,
            )
        if not os.path.isdir(ours_ckpt):
            torch.multiprocessing.spawn(_save_rank, args=("engine", ours_ckpt, params, _free_port()), nprocs=2)
        before_ckpt = os.path.join(root, "engine_before")
        if before is not None and not os.path.isdir(before_ckpt):
            _save_before(before, before_ckpt, params)
        sizes = {
            ckpt: sum(e.stat().st_size for e in os.scandir(os.path.join(ckpt, "global_step1")))
            for ckpt in (ds_ckpt, ours_ckpt, before_ckpt)
            if os.path.isdir(ckpt)
        }
        runs = [
            ("DeepSpeed zero_to_fp32 (safe_serialization)", "deepspeed", ds_ckpt, "float32", 1, True),
            ("engine consolidate", "engine", ds_ckpt, "float32", 2, True),
            ("engine consolidate, 1 worker", "engine", ours_ckpt, "float32", 1, True),
            ("engine consolidate", "engine", ours_ckpt, "float32", 2, True),
            ("engine consolidate --no-verify", "engine", ours_ckpt, "float32", 2, False),
            ("engine consolidate --dtype bf16", "engine", ours_ckpt, "bfloat16", 2, True),
            ("disk floor: the masters' bytes read and written, nothing else", "floor", ours_ckpt, "float32", 2, False),
        ]
        if before is not None:
            _BEFORE[:] = [before]
            runs += [
                ("engine consolidate, the earlier commit's code", "engine-before", before_ckpt, "float32", 2, True),
                ("engine consolidate", "engine", before_ckpt, "float32", 2, True),
            ]
        got: dict[tuple[int, bool], list[dict[str, float]]] = {}
        for _ in range(REPEATS):  # interleaved, so that other work on the machine weighs on every tool alike
            for cold in (True, False):
                for i, (name, tool, ckpt, dtype, workers, verify) in enumerate(runs):
                    result = _measure(tool, ckpt, os.path.join(root, "out"), dtype, workers, verify, cold)
                    print(name, ckpt, "cold" if cold else "warm", result, flush=True)
                    got.setdefault((i, cold), []).append(result)
        rows = []
        for (i, cold), results in got.items():
            name, _, ckpt, *_ = runs[i]
            rows.append(
                (
                    name,
                    {ds_ckpt: "DeepSpeed's", ours_ckpt: "engine's"}.get(ckpt, "engine's, saved before"),
                    "cold" if cold else "warm",
                    statistics.median(g["seconds"] for g in results),
                    statistics.median(g["durable"] for g in results),
                    sizes[ckpt],
                    int(results[0]["out_bytes"]),
                    int(max(g["peak_pss"] for g in results)),
                    int(max(g["main_rss"] for g in results)),
                    int(results[0]["interpreter_rss"]),
                )
            )
        rows.sort(key=lambda r: (r[2], not r[0].startswith("DeepSpeed")))
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
        elif not keep:
            shutil.rmtree(ds_ckpt, ignore_errors=True)
            shutil.rmtree(ours_ckpt, ignore_errors=True)
            shutil.rmtree(os.path.join(root, "engine_before"), ignore_errors=True)
    _report(rows, params, load_before)


def _report(
    rows: list[tuple[str, str, str, float, float, int, int, int, int, int]], params: float, load_before: tuple
) -> None:
    layers = max(1, round(params / (WIDTH * WIDTH)))
    largest = WIDTH * WIDTH * 4
    baseline = {r[2]: r[4] for r in rows if r[0].startswith("DeepSpeed")}
    lines = [
        (
            f"# Consolidation into safetensors ({layers} x Linear({WIDTH}, {WIDTH}), "
            f"{layers * (WIDTH * WIDTH + WIDTH) / 1e6:.0f}M params, fp32 AdamW, ZeRO stage 2 at 2 ranks)"
        ),
        "",
        (
            f"Median of {REPEATS} runs, each in a fresh process, the tools interleaved (the call timed, not the "
            "interpreter's start). cold: the checkpoint's files dropped from the page cache first "
            "(posix_fadvise DONTNEED, per file); warm: read into it first. 'on disk' adds an fsync of the "
            "output files after the call (the engine fsyncs before it returns, DeepSpeed's zero_to_fp32 does "
            "not): the like-for-like time, which the GB/s and the ratio use. Input GB/s = the tag directory's "
            "bytes / s (DeepSpeed's also holds a model-states file with the fp32 weights, which neither tool "
            "needs); output GB/s = safetensors bytes / s. The engine checks CRC-32s (--no-verify skips them): "
            "of each model file whole, and of each optimizer file's head up to the end of its fp32 masters "
            "(the manifest's masters_checksums), not its Adam moments; a checkpoint saved before that entry "
            "existed ('saved before' rows: --before's commit saved it, same model) has every byte of its files "
            "checked, moments included; the row \"the earlier commit's code\" consolidates it with that commit's "
            "engine too (the state before). DeepSpeed's files have no checksums. Peak memory: the PSS of the process and its workers together (pages shared since the "
            "fork count once) and the main process's RSS, sampled every 5 ms, the largest of the runs; "
            "interpreter: the main process's RSS before the call (Python, torch and the tool imported). The "
            f"largest tensor is {largest / 2**20:.0f} MiB. Engine rows use 2 workers unless said. The disk "
            "floor row is no tool: 2 processes read each optimizer file's masters (the bytes the output is made "
            "of) in 1 MiB blocks, write them into one file and fsync it; what this disk takes to move the "
            "output's bytes in and out, with no check and no format, in the same rounds."
        ),
        "",
        (
            "| tool | checkpoint | cache | s (call) | s (on disk) | input GB/s | output GB/s | vs DeepSpeed "
            "| peak PSS, all processes MiB | peak RSS, main MiB | interpreter MiB |"
        ),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ckpt, cache, s, durable, size, out, peak, main_rss, interp in rows:
        ratio = baseline.get(cache, float("nan")) / durable
        lines.append(
            f"| {name} | {ckpt} ({size / 1e9:.2f} GB) | {cache} | {s:.2f} | {durable:.2f} | "
            f"{size / durable / 1e9:.2f} | {out / durable / 1e9:.2f} | {ratio:.1f}x | {peak / 2**20:.0f} | "
            f"{main_rss / 2**20:.0f} | {interp / 2**20:.0f} |"
        )
    lines += ["", "Machine:", *machine_facts(ROOT, load_before, busy_cores=2)]
    plt = _write_table("consolidate.md", lines)
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 1.5), width_ratios=[3, 2])
    labels = [f"{r[0]} ({r[1]} ckpt, {r[2]})" for r in rows]
    ax1.barh(
        labels, [r[4] for r in rows], color=["tab:red" if r[0].startswith("DeepSpeed") else "tab:blue" for r in rows]
    )
    ax1.set_xlabel(f"seconds, output on disk (median of {REPEATS})")
    ax1.invert_yaxis()
    ax2.barh(labels, [r[7] / 2**20 for r in rows], color="tab:gray", label="peak PSS, all processes")
    ax2.barh(labels, [r[9] / 2**20 for r in rows], color="tab:green", label="interpreter")
    ax2.axvline(largest / 2**20, color="k", linestyle=":", label="largest tensor")
    ax2.set_xlabel("MiB")
    ax2.set_yticks([])
    ax2.invert_yaxis()
    ax2.legend(fontsize=7)
    fig.suptitle("Consolidating a ZeRO-2 checkpoint into safetensors")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "benchmarks", "results", "consolidate.png"), dpi=100)


def _write_table(name: str, lines: list[str]) -> Any:
    """Write and print a results table (benchmarks/results/<name>); matplotlib's pyplot for its plot, or
    None when matplotlib is not installed."""
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", name), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for the plot)")
        return None
    return plt


if __name__ == "__main__":
    main()
