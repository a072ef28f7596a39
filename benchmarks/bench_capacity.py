"""The largest GPT each system trains on this machine: 2 ranks, fp32, Adam, micro batch 1, sequence 128.

    .venv/bin/python benchmarks/bench_capacity.py [--max-params N] [--systems ddp,fsdp2,...]
                                                  [--nvme-dir /tmp] [--attempt-timeout 1800]

For each system the GPT grows along one ladder of fixed aspect (GPT-2's: d_model = 64 x n_layers,
head dim 64, GPT-2's vocabulary of 50257) by x1.5 parameters per rung until a run of 2 training steps
fails, then once more between the last success and the first failure (the rung nearest their geometric
mean). Each attempt runs its 2 ranks (benchmarks/capacity_workers/worker.py under the engine's .venv, or
$DEEPSPEED_PYTHON's venv for DeepSpeed; started from here, not by torchrun, whose ranks live in sessions of their own
that a watchdog could not reach) each in its own process group, with oom_score_adj 1000 (so the kernel's
OOM killer, should it ever act, picks the attempt and nothing else on the machine), watched from here:
when MemAvailable drops under --min-available-gib (3) every rank's group is killed and the attempt
counts as failed with reason "memory"; past --attempt-timeout it is killed with reason "time"; a rank
that fails ends the other. Before an NVMe attempt the free space of --nvme-dir must stay >= 10 GB after
the attempt's estimated swap files (16 B/param), otherwise the ladder stops with reason "disk" (then the largest
shape between the last success and that rung that fits the disk is tried).

Systems: ddp (PyTorch DDP, gloo), fsdp2 (fully_shard per block and root, gloo, CPU), deepspeed-3
(DeepSpeed 0.19.8 stage 3 in RAM, deepspeed.zero.Init, torch Adam), deepspeed-3-nvme (its optimizer
and parameters on NVMe: only where its async_io op is compatible; otherwise its row says why),
engine-3 (stage 3 in RAM, engine.zero.Init), engine-3-nvme (stage 3, offload_optimizer and
offload_param on NVMe, engine.zero.Init).

Reported per system: the largest model that trained (parameters, model-state bytes at 16 B/param, peak
RSS summed over the 2 ranks, disk bytes of the swap folder, the second step's seconds), every attempt
with its outcome, and for the engine's NVMe row the physical bound of that model's step: compute = its
forward+backward FLOPs per rank / torch.mm GFLOP/s of one thread (each rank runs one), disk = the bytes
both ranks read and wrote during the step (/proc/<pid>/io) / the fastest direct-I/O read and write rates
(dd's and the engine's aio) measured right before and right after that attempt (the disk's speed drifts
within a run; the report also holds the step against the whole run's fastest rates), and where that
step's time went: its forward, backward and step() with the machine's CPU and disk busy shares.
Writes benchmarks/results/capacity.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch
from machine import DS_PYTHON, ds_python, machine_facts

WORKER = os.path.join(ROOT, "benchmarks", "capacity_workers", "worker.py")
ENGINE_ARENA_BYTES = 0
"""zero_optimization.stage3_arena_bytes of the engine rows (--engine-arena; 0: no arena)."""


VOCAB, SEQ, STEPS, WORLD = 50257, 128, 2, 2
GROWTH = 1.5
BYTES_PER_PARAM = 16  # fp32 parameter + gradient + Adam's two moments
DISK_RESERVE = 10e9
"""Free bytes an NVMe attempt must leave on the swap file system."""
SYSTEMS = ["ddp", "fsdp2", "deepspeed-3", "deepspeed-3-nvme", "engine-3", "engine-3-nvme"]
LABELS = {
    "ddp": "PyTorch DDP (gloo)",
    "fsdp2": "PyTorch FSDP2 (fully_shard, gloo)",
    "deepspeed-3": "DeepSpeed 0.19.8 stage 3, RAM",
    "deepspeed-3-nvme": "DeepSpeed 0.19.8 stage 3, optimizer + params on NVMe",
    "engine-3": "engine stage 3, RAM",
    "engine-3-nvme": "engine stage 3, optimizer + params on NVMe",
}


# ------------------------------------------------------------------------------------------ the ladder
@dataclass(frozen=True)
class Shape:
    layers: int
    d_model: int
    heads: int

    @property
    def params(self) -> int:
        """examples/gpt.py's parameter count: token and position embeddings, blocks (ln1, qkv, proj,
        ln2, mlp: 12 d^2 + 13 d), final LayerNorm, untied head."""
        d = self.d_model
        return 2 * VOCAB * d + SEQ * d + self.layers * (12 * d * d + 13 * d) + 2 * d

    @property
    def flops(self) -> float:
        """Forward + backward FLOPs of one sequence: 6 x tokens x the matmul parameters (blocks and
        head), plus attention's QK^T and AV (4 T^2 d per layer forward, x3 with backward)."""
        d, t = self.d_model, SEQ
        return 6.0 * t * (self.layers * 12 * d * d + VOCAB * d) + 12.0 * self.layers * t * t * d


def ladder_shape(layers: int) -> Shape:
    return Shape(layers, 64 * layers, layers)


def next_rung(params: float) -> Shape:
    """The smallest ladder shape with at least `params` parameters."""
    layers = 1
    while ladder_shape(layers).params < params:
        layers += 1
    return ladder_shape(layers)


def refine_rung(ok: Shape, failed: Shape) -> Shape | None:
    """The ladder shape strictly between the two nearest their geometric mean, if any."""
    between = [ladder_shape(n) for n in range(ok.layers + 1, failed.layers)]
    target = math.sqrt(ok.params * failed.params)
    return min(between, key=lambda s: abs(math.log(s.params / target)), default=None)


def disk_need(shape: Shape) -> int:
    """The NVMe rows' swap files: master, two moments and the gradient, fp32."""
    return BYTES_PER_PARAM * shape.params


# ------------------------------------------------------------------------------------------ attempts
@dataclass
class Attempt:
    system: str
    shape: Shape
    ok: bool = False
    reason: str = ""  # why it failed: memory, time, disk, error text
    seconds: float = 0.0
    ranks: list[dict[str, Any]] = field(default_factory=list)
    min_available_gib: float = 0.0
    disk_rates: list[dict[str, Any]] = field(default_factory=list)  # the engine NVMe rows': right before and after

    @property
    def peak_rss(self) -> int:
        """Peak RSS summed over the ranks, bytes (ru_maxrss of each rank process)."""
        return sum(r["maxrss_after"] for r in self.ranks) * 1024

    @property
    def step_s(self) -> float:
        """The last (second) step's seconds, slowest rank: the first holds one-time work."""
        return max(r["times"][-1] for r in self.ranks)

    @property
    def io(self) -> tuple[int, int]:
        """Bytes read and written during the last step, both ranks."""
        return sum(r["io"][-1][0] for r in self.ranks), sum(r["io"][-1][1] for r in self.ranks)

    @property
    def disk(self) -> int:
        """The swap folder's bytes after the steps (each rank sees both ranks' files: the largest)."""
        return max((r["disk_bytes"] for r in self.ranks), default=0)


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def _command(system: str, shape: Shape, out: str, nvme: str | None) -> list[str]:
    python = ds_python() if system.startswith("deepspeed") else sys.executable
    # oom_score_adj 1000 before exec: the kernel's OOM killer, should it ever act before the watchdog,
    # picks the attempt and nothing else on the machine.
    cmd = ["sh", "-c", 'echo 1000 > /proc/self/oom_score_adj && exec "$@"', "sh", python, WORKER]
    cmd += ["--system", system, "--layers", str(shape.layers), "--d-model", str(shape.d_model)]
    cmd += ["--heads", str(shape.heads), "--vocab", str(VOCAB), "--seq", str(SEQ), "--steps", str(STEPS)]
    cmd += ["--out", out] + (["--nvme", nvme] if nvme else [])
    if system.startswith("engine") and ENGINE_ARENA_BYTES:
        cmd += ["--arena", str(ENGINE_ARENA_BYTES)]
    return cmd


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank's process group (a rank and anything it started), then reap the ranks."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def _launch(system: str, shape: Shape, out: str, nvme: str | None, log: Any) -> list[subprocess.Popen[bytes]]:
    """The ranks, started here rather than by torchrun: torchrun starts each rank in a session of its
    own, out of reach of a kill of torchrun's group, while this watchdog must be able to kill them all."""
    # glibc's malloc serves blocks under its dynamic mmap threshold (up to 32 MiB) from heaps that hold on
    # to freed memory: measured, 1.1 GB a rank at 253M parameters. Every system runs with the threshold at
    # 1 MiB, so freed tensors go back to the kernel.
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD))
    env.update(LOCAL_WORLD_SIZE=str(WORLD))
    cmd = _command(system, shape, out, nvme)
    return [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed as one
        )
        for r in range(WORLD)
    ]


def attempt(system: str, shape: Shape, args: argparse.Namespace) -> Attempt:
    result = Attempt(system, shape)
    nvme = None
    if system.endswith("nvme"):
        free = shutil.disk_usage(args.nvme_dir).free
        need = disk_need(shape)
        if free - need < DISK_RESERVE:
            result.reason = (
                f"disk: {free / 1e9:.1f} GB free, needs {need / 1e9:.1f} GB + {DISK_RESERVE / 1e9:.0f} GB reserve"
            )
            return result
        nvme = tempfile.mkdtemp(prefix="capacity_swap_", dir=args.nvme_dir)
    bracket = system == "engine-3-nvme"  # the row whose step is held against the disk's rates
    if bracket:
        result.disk_rates.append({"when": "right before the attempt", **disk_rates(args.nvme_dir)})
    out = tempfile.mkdtemp(prefix=f"capacity_{system}_")
    log_path = os.path.join(out, "log.txt")
    print(f"[capacity] {system} L={shape.layers} d={shape.d_model}: {shape.params / 1e6:.1f}M params", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        procs = _launch(system, shape, out, nvme, log)
    lowest, killed = _available(), ""
    try:
        while any(p.poll() is None for p in procs):
            avail = _available()
            lowest = min(lowest, avail)
            if avail < args.min_available_gib * 2**30:
                killed = "memory"
            elif time.perf_counter() - t0 > args.attempt_timeout:
                killed = "time"
            if killed or any(p.returncode not in (None, 0) for p in procs):
                break  # a failed rank leaves the other waiting in a collective: end both
            time.sleep(0.05)
    finally:
        _kill(procs)  # also on ^C: no rank outlives its attempt
    codes = [p.returncode for p in procs]
    result.seconds, result.min_available_gib = time.perf_counter() - t0, lowest / 2**30
    files = [os.path.join(out, f"rank{r}.json") for r in range(WORLD)]
    if not killed and codes == [0] * WORLD and all(os.path.exists(p) for p in files):
        result.ok = True
        for p in files:
            with open(p) as f:
                result.ranks.append(json.load(f))
    else:
        with open(log_path) as f:
            tail = [line for line in f.read().splitlines() if "Error" in line or "error" in line]
        result.reason = killed or (tail[-1].strip()[:200] if tail else f"exit status {codes}")
        sys.stderr.write(f"[capacity] failed ({result.reason}); log kept in {log_path}\n")
    if result.ok:
        shutil.rmtree(out, ignore_errors=True)
    if bracket:  # the disk as the attempt left it: its ranks have just ended, their last step seconds before
        result.disk_rates.append({"when": "right after the attempt", **disk_rates(args.nvme_dir)})
    if nvme:
        shutil.rmtree(nvme, ignore_errors=True)
    print(
        f"[capacity]   {'ok' if result.ok else 'FAILED: ' + result.reason} in {result.seconds:.0f} s, "
        f"lowest MemAvailable {result.min_available_gib:.1f} GiB"
        + (f", peak RSS {result.peak_rss / 2**30:.2f} GiB, step {result.step_s:.2f} s" if result.ok else ""),
        flush=True,
    )
    return result


def climb(system: str, args: argparse.Namespace) -> tuple[list[Attempt], str]:
    """Every attempt of one system, and why the climb stopped."""
    tried: list[Attempt] = []
    shape = next_rung(args.start_params)
    while True:
        if args.max_params and shape.params > args.max_params:
            return tried, f"cap: the next rung ({shape.params / 1e6:.0f}M) is over --max-params"
        tried.append(attempt(system, shape, args))
        if not tried[-1].ok:
            break
        shape = next_rung(max(shape.params * GROWTH, shape.params + 1))
    oks = [a for a in tried if a.ok]
    if not oks:
        return tried, tried[-1].reason
    if tried[-1].reason.startswith("disk"):  # the disk, not the system, stopped it: the largest shape that fits
        fits = [ladder_shape(n) for n in range(oks[-1].shape.layers + 1, tried[-1].shape.layers)]
        fits = [s for s in fits if disk_need(s) + DISK_RESERVE <= shutil.disk_usage(args.nvme_dir).free]
        stop = tried[-1].reason
        if fits:
            tried.append(attempt(system, fits[-1], args))
            outcome = "trained" if tried[-1].ok else f"failed: {tried[-1].reason}"
            stop += f"; the largest shape that fits the disk, {fits[-1].params / 1e6:.0f}M, {outcome}"
        return tried, stop
    failed = tried[-1]
    between = refine_rung(oks[-1].shape, failed.shape)
    if between is not None:
        tried.append(attempt(system, between, args))
    stop = f"{failed.shape.params / 1e6:.0f}M failed: {failed.reason}"
    return tried, stop + (f"; {between.params / 1e6:.0f}M failed too" if between and not tried[-1].ok else "")


# ------------------------------------------------------------------------------------------ the bounds
def mm_gflops(seconds: float = 3.0, n: int = 1024) -> float:
    """torch.mm GFLOP/s of one thread (each rank runs one), fp32."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        count += 1
    rate = 2.0 * n**3 * count / (time.perf_counter() - t0) / 1e9
    torch.set_num_threads(threads)
    return rate


def dd_bandwidth(folder: str, mib: int = 1024) -> tuple[float, float]:
    """dd's direct-I/O write and read bytes/s on a `mib` MiB file in `folder` (deleted after)."""
    path = os.path.join(folder, f"capacity_dd_{os.getpid()}.bin")
    rates = []
    try:
        for io in (
            ["if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"],
            [f"if={path}", "of=/dev/null", "bs=1M", f"count={mib}", "iflag=direct"],
        ):
            t0 = time.perf_counter()
            subprocess.run(["dd", *io], capture_output=True, check=True)
            rates.append(mib * 2**20 / (time.perf_counter() - t0))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return rates[0], rates[1]


def aio_bandwidth(folder: str, mib: int = 1024) -> tuple[float, float]:
    """The engine's own async I/O (engine/ops/aio.py with the engine rows' aio section, DeepSpeed's
    defaults: 8 requests in flight; O_DIRECT) writing then reading a `mib` MiB file in `folder` (deleted
    after), bytes/s: what the disk gives requests in flight, which dd's one request at a time does not
    show (benchmarks/results/aio.md: 1.5-2.7x dd's write rate)."""
    import torch

    from engine.ops.aio import AioConfig, AioContext, aligned_empty, open_file

    path = os.path.join(folder, f"capacity_aio_{os.getpid()}.bin")
    nbytes = mib << 20
    ctx = AioContext(AioConfig())
    file = open_file(path, create=True)
    try:
        os.posix_fallocate(file.fd, 0, nbytes)
        buf = aligned_empty(nbytes, torch.uint8).fill_(7)
        t0 = time.perf_counter()
        ctx.write(file, buf, 0).wait()
        os.fdatasync(file.fd)
        write = nbytes / (time.perf_counter() - t0)
        os.posix_fadvise(file.fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # the read comes from the disk
        t0 = time.perf_counter()
        ctx.read(file, buf, 0).wait()
        read = nbytes / (time.perf_counter() - t0)
    finally:
        ctx.close()
        file.close()
        if os.path.exists(path):
            os.remove(path)
    return write, read


def disk_rates(folder: str) -> dict[str, float]:
    """dd's and the engine's aio write and read rates on `folder` now (see aio_bandwidth), after a sync: no
    earlier run's write-back shares the disk with the measurement."""
    os.sync()
    dd_write, dd_read = dd_bandwidth(folder)
    aio_write, aio_read = aio_bandwidth(folder)
    return {"dd_write": dd_write, "dd_read": dd_read, "aio_write": aio_write, "aio_read": aio_read}


def fastest(rates: list[dict[str, Any]], kind: str) -> float:
    """The fastest `kind` ("write"/"read") rate among `rates` (disk_rates' records), either tool."""
    return max(r[f"{tool}_{kind}"] for r in rates for tool in ("dd", "aio"))


def run_rates(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every disk_rates record of the run: before and after the ladder, and the bracket of the bound's step
    (runs older than the records: the dd rates measured at the start)."""
    ladder = data.get("disk_rates") or [
        {"dd_write": data["dd_write"], "dd_read": data["dd_read"], "aio_write": 0, "aio_read": 0}
    ]
    return [*ladder, *data.get("bound", {}).get("disk_rates", [])]


def step_rates(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rates the bound's disk time uses: the bracket of the step's attempt (runs before the bracket
    existed: the whole run's)."""
    return data.get("bound", {}).get("disk_rates") or run_rates(data)


def disk_seconds(bound: dict[str, Any], rates: list[dict[str, Any]]) -> float:
    """The step's bytes at the fastest of `rates`: reads and writes one after the other (one disk)."""
    return bound["read"] / fastest(rates, "read") + bound["written"] / fastest(rates, "write")


def deepspeed_aio_status() -> str:
    """Whether DeepSpeed's async_io op is compatible here, and if not its own words why."""
    code = (
        "from deepspeed.ops.op_builder import AsyncIOBuilder\n"
        "print('COMPATIBLE' if AsyncIOBuilder().is_compatible(verbose=True) else 'INCOMPATIBLE')"
    )
    if not DS_PYTHON:
        return "not checked: DEEPSPEED_PYTHON is not set"
    try:
        done = subprocess.run(
            [DS_PYTHON, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env=dict(os.environ, DS_ACCELERATOR="cpu"),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not checked: {exc}"
    text = done.stdout + done.stderr
    if "INCOMPATIBLE" not in text and "COMPATIBLE" in text:
        return "compatible"
    why = [line.split("[0m", 1)[-1].strip() for line in text.splitlines() if "async_io" in line]
    return " ".join(why) or text.strip()[-300:]


# ------------------------------------------------------------------------------------------ report
def _g(n: float) -> str:
    return f"{n / 1e9:.2f}"


def write_report(data: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# The largest GPT each system trains on this machine", ""]
    if data["max_params"]:
        lines += [
            (
                f"**Capped at {data['max_params'] / 1e6:.0f}M parameters (--max-params, for time).** A row stopped "
                "by the cap says so in its last column: that system may train a larger model. The uncapped run "
                "(the whole machine for an hour or more, nothing else running) is:"
            ),
            "",
            "    .venv/bin/python benchmarks/bench_capacity.py --nvme-dir /tmp --attempt-timeout 1800",
            "",
        ]
    lines += [
        (
            f"2 ranks (gloo, one thread each), fp32, Adam, micro batch 1, sequence {SEQ}, {STEPS} steps per attempt; "
            f"GPT ladder d_model = 64 x layers, head dim 64, vocabulary {VOCAB}, x{GROWTH} parameters per rung, then "
            "one rung between the last success and the first failure. Model states = 16 B/param (parameter, "
            "gradient, two Adam moments, fp32). Peak RSS: ru_maxrss of the two rank processes, summed. Disk: the "
            "swap folder's allocated bytes after the steps. Step: the second step, slowest rank."
        ),
        "",
        (
            "| system | largest that trained | params | model states GB | peak RSS GB (sum of ranks) | disk GB | "
            "step s | stopped because |"
        ),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for system, row in data["systems"].items():
        best = row["best"]
        if best is None:
            lines.append(f"| {LABELS[system]} | none | | | | | | {row['stop']} |")
            continue
        lines.append(
            f"| {LABELS[system]} | L={best['layers']} d={best['d_model']} | {best['params'] / 1e6:.1f}M | "
            f"{_g(best['params'] * BYTES_PER_PARAM)} | {_g(best['peak_rss'])} | "
            f"{_g(best['disk']) if best['disk'] else '-'} | {best['step_s']:.2f} | {row['stop']} |"
        )
    b = data.get("bound")
    lines += ["", "## Step time against the physical bound (engine, NVMe row's largest model)", ""]
    if b:
        at_step, at_best = step_rates(data), run_rates(data)
        disk_s, disk_best = disk_seconds(b, at_step), disk_seconds(b, at_best)
        bound, bound_best = max(b["compute_s"], disk_s), max(b["compute_s"], disk_best)
        rate_list = (
            "; ".join(
                f"{r['when']}: dd {r['dd_write'] / 1e9:.2f}/{r['dd_read'] / 1e9:.2f}, "
                f"engine aio {r['aio_write'] / 1e9:.2f}/{r['aio_read'] / 1e9:.2f}"
                for r in [*data.get("disk_rates", []), *b.get("disk_rates", [])]
            )
            or f"at the start: dd {data['dd_write'] / 1e9:.2f}/{data['dd_read'] / 1e9:.2f}"
        )
        lines += [
            (
                f"torch.mm {data['mm_gflops']:.1f} GFLOP/s per thread; on {data['nvme_dir']}, write/read GB/s"
                + (" (each after a sync)" if b.get("disk_rates") else "")
                + f": {rate_list}. "
                "Compute: forward+backward FLOPs of one sequence per rank (the ranks run in parallel on their own "
                "cores). Disk: bytes both ranks read and wrote during the step (one disk), reads and writes one "
                "after the other."
            ),
            "",
            (
                "This disk's speed drifts within a run, so the bound's disk time takes the fastest rates measured "
                "right before and right after the step's own attempt"
                + f" (write {fastest(at_step, 'write') / 1e9:.2f}, read {fastest(at_step, 'read') / 1e9:.2f} GB/s"
                + ("" if b.get("disk_rates") else "; this run predates that bracket: the whole run's")
                + "). "
                "The last column holds the step against the fastest rates of the whole run (write "
                f"{fastest(at_best, 'write') / 1e9:.2f}, read {fastest(at_best, 'read') / 1e9:.2f} GB/s), which may "
                "have been measured an hour away from the step."
            ),
            "",
            (
                "| params | FLOPs/rank | compute s | read GB | written GB | disk s | bound s = max | step s | "
                "step / bound | step / bound at the run's fastest rates |"
            ),
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            (
                f"| {b['params'] / 1e6:.1f}M | {b['flops'] / 1e12:.3f} T | {b['compute_s']:.2f} | {_g(b['read'])} | "
                f"{_g(b['written'])} | {disk_s:.2f} | {bound:.2f} | {b['step_s']:.2f} | "
                f"{b['step_s'] / bound:.2f} | {b['step_s'] / bound_best:.2f} |"
            ),
        ]
        if b.get("phases"):
            lines += [
                "",
                (
                    "Where that step's time went (rank 0's clock; CPU and disk are the whole machine's: both ranks, "
                    "/proc/stat and /proc/diskstats of the swap folder's disk; disk busy = share of the phase with "
                    "requests in flight):"
                ),
                "",
                "| phase | s | disk read GB | disk written GB | disk busy | CPU busy |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
                *(
                    f"| {name} | {p['s']:.2f} | {_g(p['disk_read'])} | {_g(p['disk_written'])} | "
                    f"{p['disk_busy']:.0%} | {p['cpu_busy']:.0%} |"
                    for name, p in b["phases"].items()
                ),
            ]
    else:
        lines.append("No engine NVMe model trained in this run.")
    lines += [
        "",
        "## Every attempt",
        "",
        "| system | L | d | params | outcome | s | lowest MemAvailable GiB |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for system, row in data["systems"].items():
        for a in row["attempts"]:
            lines.append(
                f"| {system} | {a['layers']} | {a['d_model']} | {a['params'] / 1e6:.1f}M | "
                f"{'ok' if a['ok'] else 'failed: ' + a['reason']} | {a['seconds']:.0f} | {a['min_available_gib']:.1f} |"
            )
    lines += [
        "",
        "Notes:",
        "",
        f"- DeepSpeed's NVMe offload: its async_io op here: {data['ds_aio']}",
        (
            "- Disk bytes per step are measured (/proc/<pid>/io read_bytes and write_bytes of each rank, all its "
            "threads), not modelled: the step writes the fp32 master and both moments (12 B/param) and reads them "
            "(12 B/param); each gather of a unit reads its master shard (4 B/param per gather), except where the "
            "engine's step, running behind the next forward, hands a gather its unit's updated values; the "
            "engine's gradients (swap files) are written once with O_DIRECT as they are reduced (4 B/param) and "
            "read once with O_DIRECT by the step (4 B/param), past the page cache, then zeroed in the file (no "
            "write). A step's "
            "bytes are those of the window from one step's forward to the next's: the step behind the forward "
            "is counted in the step after it."
        ),
        (
            "- Peak RSS counts the two rank processes (started directly, no launcher process). The load average "
            "below says how "
            "much other work shared the 2 cores: step times, and so step / bound, are noisier when it is over 2. "
            "The engine NVMe row's RSS includes its gradients' file pages while they are mapped in (page cache the "
            "kernel reclaims when memory is short; the lowest MemAvailable column is the memory actually left)."
        ),
        f"- Plot: {args.name}.png (every attempt per system, o trained, x failed; dashed: model states = this RAM).",
        (
            "- The engine rows' zero_optimization.stage3_arena_bytes (--engine-arena): "
            f"{data.get('engine_arena', 'not recorded')}."
        ),
        (
            f"- Safety: each attempt in its own process group, oom_score_adj 1000, killed when MemAvailable < "
            f"{args.min_available_gib} GiB (reason memory) or after {args.attempt_timeout:.0f} s (reason time); "
            "NVMe attempts only with >= 10 GB left free after their swap files; when the disk stops the ladder, "
            "the largest shape that fits is tried."
        ),
        *(
            f"- Rerun with --update at {r['date']} (load average before {r['load_before'][0]:.2f}): "
            f"{', '.join(r['systems'])}; {r['why']}"
            for r in data.get("reruns", [])
        ),
        "",
        "Machine:",
        "",
        *machine_facts(ROOT, tuple(data["load_before"]), WORLD),
    ]
    path = os.path.join(ROOT, "benchmarks", "results", f"{args.name}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return path


def plot(data: dict[str, Any], md_path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {md_path}; matplotlib not installed: table only")
        return
    systems = list(data["systems"])
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(systems) + 2.5))
    for i, system in enumerate(systems):
        for a in data["systems"][system]["attempts"]:
            ax.scatter(a["params"], i, marker="o" if a["ok"] else "x", color="#55a868" if a["ok"] else "#c44e52")
        best = data["systems"][system]["best"]
        if best:
            ax.text(best["params"], i + 0.2, f"{best['params'] / 1e6:.0f}M", fontsize=8, ha="center")
    ram = data["ram_bytes"] / BYTES_PER_PARAM
    ax.axvline(ram, color="#888888", linestyle="--", linewidth=1)
    top = ax.get_xaxis_transform()  # x in data, y in axes fraction: labels above the plot
    ax.text(ram, 1.01, "model states = RAM", fontsize=8, color="#666666", ha="center", transform=top)
    if data["max_params"]:
        ax.axvline(data["max_params"], color="#dd8452", linestyle=":", linewidth=1)
        ax.text(data["max_params"], 1.01, "cap", fontsize=8, color="#dd8452", ha="center", transform=top)
    ax.set_xscale("log")
    ax.set_yticks(range(len(systems)), [LABELS[s] for s in systems])
    ax.invert_yaxis()
    ax.set_xlabel("GPT parameters (o trained 2 steps, x failed)")
    ax.set_title(
        "Largest GPT trained, 2 ranks, fp32 Adam"
        + (f" (capped at {data['max_params'] / 1e6:.0f}M)" if data["max_params"] else ""),
        fontsize=10,
        pad=14,
    )
    fig.tight_layout()
    png = md_path[:-3] + ".png"
    fig.savefig(png, dpi=110)
    print(f"wrote {md_path} and {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--max-params", type=float, default=0, help="never try a rung above this (0: no cap)")
    parser.add_argument("--start-params", type=float, default=25e6, help="the first rung's parameters (at least)")
    parser.add_argument("--nvme-dir", default="/tmp", help="where the NVMe rows' swap files and dd's file go")
    parser.add_argument("--attempt-timeout", type=float, default=1800, help="seconds per attempt")
    parser.add_argument("--min-available-gib", type=float, default=3.0, help="kill an attempt under this")
    parser.add_argument("--name", default="capacity", help="results file names: benchmarks/results/NAME.{md,json,png}")
    parser.add_argument("--replot", action="store_true", help="redraw NAME.png from NAME.json, run nothing")
    parser.add_argument(
        "--update",
        default="",
        metavar="WHY",
        help="rerun only --systems and replace their rows in NAME.json (the other rows and the machine's figures "
        "stay from the run that wrote it); WHY goes in the report's notes",
    )
    parser.add_argument(
        "--engine-arena",
        type=float,
        default=0,
        help="the engine rows' zero_optimization.stage3_arena_bytes (bytes; 0: no arena, the default's)",
    )
    args = parser.parse_args()
    global ENGINE_ARENA_BYTES
    ENGINE_ARENA_BYTES = int(args.engine_arena)
    if args.replot:
        with open(os.path.join(ROOT, "benchmarks", "results", f"{args.name}.json")) as f:
            plot(json.load(f), os.path.join(ROOT, "benchmarks", "results", f"{args.name}.md"))
        return
    systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {SYSTEMS}")
    if args.update:
        with open(os.path.join(ROOT, "benchmarks", "results", f"{args.name}.json")) as f:
            data: dict[str, Any] = json.load(f)
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data.setdefault("reruns", []).append(
            {"systems": systems, "date": when, "load_before": os.getloadavg(), "why": args.update}
        )
    else:
        data = {"load_before": os.getloadavg(), "max_params": args.max_params, "nvme_dir": args.nvme_dir}
        data["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        data["ds_aio"] = deepspeed_aio_status()
        data["mm_gflops"] = mm_gflops()
        data["engine_arena"] = ENGINE_ARENA_BYTES
        before = disk_rates(args.nvme_dir)
        data["dd_write"], data["dd_read"] = before["dd_write"], before["dd_read"]  # the fields older runs have
        data["disk_rates"] = [{"when": "before", **before}]
        data["systems"] = {}
    for system in systems:
        if system == "deepspeed-3-nvme" and data["ds_aio"] != "compatible":
            data["systems"][system] = {"attempts": [], "best": None, "stop": f"not run: {data['ds_aio']}"}
            continue
        tried, stop = climb(system, args)
        oks = [a for a in tried if a.ok]
        best = max(oks, key=lambda a: a.shape.params, default=None)
        data["systems"][system] = {
            "stop": stop,
            "attempts": [
                {
                    **asdict(a.shape),
                    "params": a.shape.params,
                    "ok": a.ok,
                    "reason": a.reason,
                    "seconds": a.seconds,
                    "min_available_gib": a.min_available_gib,
                }
                for a in tried
            ],
            "best": None
            if best is None
            else {
                **asdict(best.shape),
                "params": best.shape.params,
                "peak_rss": best.peak_rss,
                "disk": best.disk,
                "step_s": best.step_s,
                "io": best.io,
                "ranks": best.ranks,
            },
        }
        if system == "engine-3-nvme" and best is not None:
            read, written = best.io
            data["bound"] = {
                "params": best.shape.params,
                "flops": best.shape.flops,
                "step_s": best.step_s,
                "compute_s": best.shape.flops / (data["mm_gflops"] * 1e9),
                "read": read,
                "written": written,
                "disk_rates": best.disk_rates,
                "phases": (best.ranks[0].get("phases") or [{}])[-1],
            }
    if "engine-3-nvme" in systems:  # the disk's rates again, after the runs
        when = "after the runs" if not args.update else f"after the rerun of {data['reruns'][-1]['date']}"
        data.setdefault("disk_rates", []).append({"when": when, **disk_rates(args.nvme_dir)})
    if data.get("bound"):
        b = data["bound"]
        b["disk_s"] = disk_seconds(b, step_rates(data))
        b["disk_s_run_fastest"] = disk_seconds(b, run_rates(data))
    with open(os.path.join(ROOT, "benchmarks", "results", f"{args.name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    plot(data, write_report(data, args))


if __name__ == "__main__":
    main()
