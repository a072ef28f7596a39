"""ZeRO-Infinity's optimizer offload to NVMe (offload_optimizer.device "nvme"), on real processes.

The swapped step (engine/offload/optimizer_swap.py) runs the same fused Adam kernel as the in-memory
offload (device "cpu") on sub-groups streamed through a few buffers, so the two runs must be bitwise
equal: weights after 10 steps at stages 1-3, fp32 and bf16, world sizes 1 and 2, with tiny
sub-groups (several per shard, so the pipeline's buffer reuse is exercised). A checkpoint of an NVMe
run holds the in-memory run's state and loads into a run without offload; the swap folder exists
while training and is gone after destroy; faults are named errors.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aio_bytes import aio_bytes
from distributed import run_distributed
from models import global_batches, make_model, rank_micro_batch

import engine
from engine.ops.overflow import KnownSquares, sum_squares_and_overflow, sum_squares_of
from engine.zero.norm_scope import counted_rows
from engine.offload.sub_groups import sub_group_cuts

STEPS, MICRO, GAS = 10, 2, 2


def _config(
    stage: int, bf16: bool, device: str, nvme_path: str, pipeline: bool, params: bool = False
) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        offload.update(
            nvme_path=nvme_path, buffer_count=2, pipeline_read=pipeline, pipeline_write=pipeline, pin_memory=True
        )
    zero = {"stage": stage, "reduce_bucket_size": 200, "sub_group_size": 300, "offload_optimizer": offload}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "aio": {"block_size": 4096, "thread_count": 2, "queue_depth": 4},
    } | ({"zero_optimization": {**zero, **_param_offload(nvme_path, pipeline)}} if params else {})


def _param_offload(nvme_path: str, read_ahead: bool) -> dict[str, Any]:
    """Parameters on NVMe; read_ahead: no all-gather prefetch (bucket 0), so every shard read before its
    gather is a read ahead along the recorded order (offload_param.buffer_count units)."""
    keys: dict[str, Any] = {"offload_param": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}}
    return keys | ({"stage3_prefetch_bucket_size": 0} if read_ahead else {})


def _steps(eng: Any, steps: range, dtype: torch.dtype) -> list[float]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    batches = global_batches(steps.stop, MICRO * GAS * ws)
    for step in steps:
        for k in range(GAS):
            x, y = rank_micro_batch(batches[step], rank, ws, MICRO, k)
            loss = torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss))
    return losses


def _run(
    stage: int, bf16: bool, device: str, nvme_path: str, pipeline: bool = True, params: bool = False
) -> dict[str, Any]:
    model = make_model(3)
    eng, *_ = engine.initialize(model=model, config=_config(stage, bf16, device, nvme_path, pipeline, params))
    dtype = torch.bfloat16 if bf16 else torch.float32
    losses = _steps(eng, range(STEPS), dtype)
    swap = eng._stage.offload
    # Between steps a swapped master holds no memory (its values are in the file).
    in_memory = sum(s.master.numel() for s in swap.by_master.values()) if swap is not None else None
    folder = str(swap.dir.path) if swap is not None else None
    files = sorted(os.listdir(folder)) if folder else []
    # Stage 3's shard gradients are memory-mapped swap files (engine/offload/mapped_file.py).
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if folder and folder in line and "/grad." in line}
    grads = [g.shard_grad for u in eng._stage.units for g in u.trainable] if stage == 3 else []
    norm = _norm_of_one_more_window(eng, dtype) if stage == 3 else None
    reads_ahead = eng._stage._gathers.reads_ahead if stage == 3 else 0
    shards_read_ahead = eng._stage._gathers.shards_read_ahead if stage == 3 else 0
    state = eng.consolidated_state_dict()
    eng.destroy()
    handed_back = sum(p.numel() for p in model.parameters())
    return {
        "handed back": handed_back,
        "losses": losses,
        "state": {k: v.float() for k, v in state.items()},
        "folder": folder,
        "files": files,
        "gone": folder is None or not os.path.exists(folder),
        "masters in memory": in_memory,
        "mapped grad files": sorted(os.path.basename(m) for m in mapped),
        "grad targets": len(grads),
        "norm": norm,
        "reads ahead": reads_ahead,
        "shards read ahead": shards_read_ahead,
    }


def _norm_of_one_more_window(eng: Any, dtype: torch.dtype) -> dict[str, Any]:
    """One more accumulation window's backwards (no step): what the step's norm would add up (partial sums
    taken as each reduction landed, or the gradient rows), and whether it is the rows' own sum, bitwise."""
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = global_batches(1, MICRO * GAS * ws)[0]
    for k in range(GAS):
        x, y = rank_micro_batch(batch, rank, ws, MICRO, k)
        eng.backward(torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y))
        if k < GAS - 1:
            eng.step()  # a micro-step inside the window: the engine counts it, nothing is stepped
    stage = eng._stage
    rows = stage._norm_rows()
    counted = [r for g, runs in stage._norm_runs for r in counted_rows(g.shard_grad, runs, g.layout.slice_numel)]
    return {
        "groups": len(stage._norm_runs),
        "known": sum(isinstance(r, KnownSquares) for r in rows),
        "same": sum_squares_of(rows) == sum_squares_and_overflow(counted),
    }


def _pair(stage: int, bf16: bool, nvme_path: str, pipeline: bool, params: bool) -> dict[str, Any]:
    """The NVMe run and the in-memory offload run, one after the other in the same processes."""
    return {
        "nvme": _run(stage, bf16, "nvme", nvme_path, pipeline, params),
        "cpu": _run(stage, bf16, "cpu", nvme_path),
    }


# (stage, world size, bf16, pipelined reads and writes, parameters on NVMe too; with pipelining, shards
# read ahead of their gathers instead of all-gather prefetch)
CASES = [
    (1, 2, False, True, False),
    (1, 1, True, False, False),
    (2, 2, True, True, False),
    (3, 2, False, False, False),
    (3, 1, True, True, False),
    (3, 2, False, True, True),
    (3, 1, True, False, True),
]


@pytest.mark.parametrize(("stage", "world", "bf16", "pipeline", "params"), CASES)
def test_nvme_equals_the_in_memory_offload_bitwise(
    stage: int, world: int, bf16: bool, pipeline: bool, params: bool, tmp_path: Path
) -> None:
    ranks = run_distributed(_pair, world, args=(stage, bf16, str(tmp_path), pipeline, params))
    got, want = ranks[0]["nvme"], ranks[0]["cpu"]
    assert got["losses"] == want["losses"]
    for name, value in want["state"].items():
        assert torch.equal(got["state"][name], value), name
    # The moments were on disk, and the masters where they are a copy (bf16 stages 1-2) or the parameters
    # go to NVMe too (then no master is in memory between steps); the folder is gone after destroy.
    assert any(f.startswith("exp_avg_sq.") for f in got["files"]), got["files"]
    assert any(f.startswith("master.") for f in got["files"]) == ((bf16 and stage != 3) or params), got["files"]
    if params:
        assert got["masters in memory"] == 0
    # Parameters on NVMe: every gather's shard was read from disk, its all-gather launched at a later use.
    assert (got["reads ahead"] > 0) == params, got["reads ahead"]
    # Without all-gather prefetch, shards were read ahead along the recorded order, and used.
    assert (got["shards read ahead"] > 0) == (params and pipeline), got["shards read ahead"]
    # destroy hands the module back whole, except with parameters on NVMe (the model need not fit in RAM).
    assert got["handed back"] == (0 if params else want["handed back"]) and want["handed back"] > 0, got
    # At stage 3 every shard gradient lives in a mapped swap file; stages 1-2 keep them in memory.
    grad_files = [f for f in got["files"] if f.startswith("grad.")]
    assert got["mapped grad files"] == grad_files, got
    assert len(grad_files) == (got["grad targets"] if stage == 3 else 0) and (stage != 3 or grad_files), got
    # Stage 3 on NVMe: the norm adds partial sums taken as each gradient's reduction landed (after the
    # accumulation's last add too), never reading a gradient back from disk, and they are the rows' sum.
    if stage == 3:
        for r in ranks:
            norm, memory = r["nvme"]["norm"], r["cpu"]["norm"]
            assert norm["known"] == norm["groups"] > 0 and norm["same"], norm
            assert memory["known"] == 0 and memory["same"], memory
    assert all(r["nvme"]["gone"] for r in ranks), [r["nvme"]["folder"] for r in ranks]


@pytest.mark.parametrize(
    ("pieces", "size"),
    [
        ([5000], 3000),
        ([100_000], 20_000),
        ([1500, 7000, 1], 3000),
        ([4096, 4096], 2048),
        ([700, 900], 300),
        ([0, 9], 4),
    ],
)
def test_sub_groups_cover_each_element_once_on_the_4k_grid(pieces: list[int], size: int) -> None:
    cuts = sub_group_cuts(pieces, size)
    assert all(0 < n <= size for _, _, n, _ in cuts), cuts
    # In file order, each piece's elements once: the next cut starts where the last ended.
    offset, ends = 0, {}
    for piece, lo, n, at in cuts:
        assert at == offset and lo == ends.get(piece, 0), cuts
        offset, ends[piece] = offset + n, lo + n
    assert offset == sum(pieces) and all(ends.get(j, 0) == numel for j, numel in enumerate(pieces)), cuts
    if size >= 1024:  # 1024 fp32 elements = 4 KiB: a cut that does not start a piece starts on the grid
        assert all(at % 1024 == 0 for _, lo, _, at in cuts if lo != 0), cuts


def _direct_share(nvme_path: str) -> dict[str, float]:
    """The share of the bytes of the swapped steps' transfers (2 steps, one target of 16,897 elements cut
    into sub-groups of at most 3000) that went through O_DIRECT, per direction; -1 where the folder
    refuses O_DIRECT."""
    from engine.ops import aio

    with aio_bytes() as moved:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        config = _config(1, False, "nvme", nvme_path, True) | {"gradient_accumulation_steps": 1}
        config["zero_optimization"]["sub_group_size"] = 3000  # 12,000 bytes: off the 4 KiB grid
        eng, *_ = engine.initialize(model=model, config=config)
        probe = aio.open_file(next(iter(eng._stage.offload.by_master.values())).files["exp_avg"].path)
        direct = probe.direct_fd >= 0
        probe.close()
        moved.update(read=[0, 0], write=[0, 0])  # the steps' transfers only (initialize writes unaligned tensors)
        for _ in range(2):
            eng.backward(eng(torch.randn(MICRO, 64)).square().mean())
            eng.step()
        eng.destroy()
    return {op: (d / total if direct else -1.0) for op, (total, d) in moved.items()}


def test_the_swapped_step_moves_its_sub_groups_through_o_direct(tmp_path: Path) -> None:
    """Sub-groups cut at sub_group_size itself (12,000 bytes here) left every transfer off the 4 KiB grid
    and in the page cache (0% direct: twice the memory traffic, and the kernel's CPU time)."""
    share = run_distributed(_direct_share, 1, args=(str(tmp_path),))[0]
    if share["read"] < 0:  # this file system refuses O_DIRECT (tmpfs): every transfer is buffered there
        assert share == {"read": -1.0, "write": -1.0}
    else:  # only each file's last sub-group (16,897 elements is not a whole number of 4 KiB) is buffered
        assert share["read"] > 0.9 and share["write"] > 0.9, share


def test_parameters_on_nvme_need_stage_3_and_the_optimizer_there(tmp_path: Path) -> None:
    from engine.config import ConfigError

    config = _config(3, False, "cpu", str(tmp_path), True, params=True)
    with pytest.raises(ConfigError, match=r'offload_param.device "nvme": .*offload_optimizer.device "cpu"'):
        engine.initialize(model=make_model(0), config=config)


def _save_and_resume(save_dir: str, nvme_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for device in ("nvme", "cpu"):
        model = make_model(3)
        eng, *_ = engine.initialize(model=model, config=_config(2, True, device, nvme_path, True))
        _steps(eng, range(4), torch.bfloat16)
        eng.save_checkpoint(save_dir, tag=device)
        out[f"{device} after"] = _steps(eng, range(4, 7), torch.bfloat16)
        eng.destroy()
    # An NVMe checkpoint into a run without offload, and an in-memory one into an NVMe run (at stage 3).
    for device, tag, stage in (("none", "nvme", 1), ("nvme", "cpu", 3)):
        model = make_model(3)
        eng, *_ = engine.initialize(model=model, config=_config(stage, True, device, nvme_path, True))
        eng.load_checkpoint(save_dir, tag=tag)
        out[f"{tag} into {device}"] = _steps(eng, range(4, 7), torch.bfloat16)
        eng.destroy()
    return out


def test_an_nvme_checkpoint_holds_the_in_memory_state_and_loads_anywhere(tmp_path: Path) -> None:
    out = run_distributed(_save_and_resume, 2, args=(str(tmp_path / "ckpt"), str(tmp_path)))[0]
    assert out["nvme after"] == out["cpu after"]  # saving read the state in and wrote it back unchanged
    for rank in range(2):
        saved = {
            tag: torch.load(tmp_path / "ckpt" / tag / f"rank_{rank}_optim_states.pt", weights_only=True)["pieces"]
            for tag in ("nvme", "cpu")
        }
        assert saved["nvme"].keys() == saved["cpu"].keys()
        for name, pieces in saved["cpu"].items():
            for a, b in zip(saved["nvme"][name], pieces, strict=True):
                for key, value in b.items():
                    assert torch.equal(a[key], value) if torch.is_tensor(value) else a[key] == value, (name, key)
    # The loaded runs continue as the saved ones did (bf16 forward: within a bf16 rounding of the loss).
    assert out["nvme into none"] == pytest.approx(out["nvme after"], rel=1e-2)
    assert out["cpu into nvme"] == pytest.approx(out["cpu after"], rel=1e-2)


def _refused(config_change: str, nvme_path: str) -> str:
    model = make_model(3)
    config = _config(2, False, "nvme", nvme_path, True)
    try:
        eng, *_ = engine.initialize(model=model, config=config)
        _steps(eng, range(1), torch.float32)
        if config_change == "truncate":
            swap = eng._stage.offload
            victim = next(
                f for name, f in swap.by_master[next(iter(swap.by_master))].files.items() if name == "exp_avg"
            )
            os.truncate(victim.path, 100)
            _steps(eng, range(1, 2), torch.float32)
        eng.destroy()
    except Exception as err:  # noqa: BLE001 (the test reads the message of whatever was raised)
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_faults_are_named_on_every_rank(tmp_path: Path) -> None:
    missing = run_distributed(_refused, 2, args=("none", str(tmp_path / "nowhere")))
    for message in missing:
        assert "SwapPathError" in message and "offload_optimizer.nvme_path" in message, message
        assert str(tmp_path / "nowhere") in message, message
    truncated = run_distributed(_refused, 1, args=("truncate", str(tmp_path)))[0]
    assert "exp_avg" in truncated and "bytes" in truncated, truncated


def _refused_then_retried(bad_path: str, good_path: str, file_size_limit: int) -> dict[str, str]:
    """initialize with parameters and optimizer on NVMe at `bad_path` (a full or read-only file system),
    then again at `good_path` in the same process, and a step there."""
    if file_size_limit:  # no small file system to mount (not root): the kernel's file size limit refuses instead
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from the write, not the signal that kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
    config = _config(3, False, "nvme", bad_path, True, params=True)
    try:
        engine.initialize(model=make_model(3), config=config)
        refused = "no error"
    except Exception as err:  # noqa: BLE001 (the test reads the message of whatever was raised)
        refused = f"{type(err).__name__}: {err}"
    if file_size_limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "nvme", good_path, True, params=True))
    loss = _steps(eng, range(1), torch.float32)[0]
    eng.destroy()
    left = sorted(
        os.path.relpath(os.path.join(d, n), bad_path) for d, dirs, files in os.walk(bad_path) for n in dirs + files
    )
    return {"refused": refused, "retried": f"loss {loss}", "left": " ".join(left)}


@contextlib.contextmanager
def _mounted_tmpfs(path: Path, options: str) -> Iterator[bool]:
    """A tmpfs at `path` (root only; False where it cannot be mounted)."""
    path.mkdir()
    (path.parent / "good").mkdir(exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=False).returncode == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_is_named_on_every_rank_and_the_run_can_start_again(tmp_path: Path) -> None:
    with _mounted_tmpfs(tmp_path / "small", "size=8k") as mounted:  # 2 pages: the owner marker and one file
        ranks = run_distributed(
            _refused_then_retried, 2, args=(str(tmp_path / "small"), str(tmp_path / "good"), 0 if mounted else 500)
        )
    for rank in ranks:
        assert rank["refused"].startswith("DiskFullError") and "bytes free" in rank["refused"], rank
        assert str(tmp_path / "small") in rank["refused"] or "failed on rank" in rank["refused"], rank
        # Nothing left behind but the (empty) root of all swap folders.
        assert rank["retried"].startswith("loss") and rank["left"] == "zero_engine_swap", rank


def test_a_read_only_path_is_named_on_every_rank_and_the_run_can_start_again(tmp_path: Path) -> None:
    with _mounted_tmpfs(tmp_path / "ro", "ro,size=64k") as mounted:
        if not mounted:
            os.chmod(tmp_path / "ro", 0o555)  # not root: permissions refuse
        ranks = run_distributed(_refused_then_retried, 2, args=(str(tmp_path / "ro"), str(tmp_path / "good"), 0))
    for rank in ranks:
        assert rank["refused"].startswith("SwapPathError"), rank
        assert "offload_optimizer.nvme_path" in rank["refused"] and str(tmp_path / "ro") in rank["refused"], rank
        assert rank["retried"].startswith("loss"), rank


MEGATRON_INFINITY = (
    Path(__file__).resolve().parent
    / "data/deepspeed_configs/DeepSpeedExamples/Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json"
)


def _megatron_infinity(nvme_path: str) -> dict[str, float]:
    """DeepSpeedExamples' Megatron ZeRO-3 infinity config (tests/test_config_corpus.py has it refused for its
    misspelt key), the key spelt as the refusal says and nvme_path pointed here; Megatron passes its own
    Adam. fp16 with a static loss scale, optimizer and parameters on NVMe, 3 steps."""
    import json

    config = json.loads(MEGATRON_INFINITY.read_text())
    zero = config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = zero.pop("stage3_param_persitance_threshold")
    zero["offload_optimizer"]["nvme_path"] = zero["offload_param"]["nvme_path"] = nvme_path
    model = make_model(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng, *_ = engine.initialize(
        model=model, config=config, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    )
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        loss = torch.nn.functional.mse_loss(eng(x.half()).float(), y)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss))
    after = eng.consolidated_state_dict()
    on_disk = eng.memory_report()["nvme"]
    eng.destroy()
    # consolidated_state_dict is rank 0's ({} on the others)
    moved = max((float((after[k].float() - v.float()).abs().max()) for k, v in before.items() if after), default=-1.0)
    return {"first": losses[0], "last": losses[-1], "moved": moved, "on disk": on_disk}


def test_the_megatron_zero3_infinity_config_trains_on_nvme(tmp_path: Path) -> None:
    rank0 = run_distributed(_megatron_infinity, 2, args=(str(tmp_path),))[0]
    assert rank0["on disk"] > 0 and rank0["moved"] > 0, rank0
    assert all(map(math.isfinite, (rank0["first"], rank0["last"]))), rank0


def test_nvme_offload_needs_the_fused_adam(tmp_path: Path) -> None:
    from engine.config import ConfigError

    config = _config(2, False, "nvme", str(tmp_path), True)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 1e-2}}
    with pytest.raises(ConfigError, match=r'device "nvme": the swapped step is the fused Adam .*SGD'):
        engine.initialize(model=make_model(0), config=config)


def _hf_zero3_on_nvme(nvme_path: str) -> str:
    """transformers' tests/deepspeed/ds_config_zero3.json with both offloads on NVMe as transformers'
    DeepSpeed docs write them (nvme_path, buffer_count, buffer_size, max_in_cpu, the aio section),
    through the corpus test's client code (the Trainer's "auto" fill, DeepSpeedCPUAdam)."""
    import json

    import test_config_corpus as corpus

    raw = json.loads((corpus.CORPUS / "transformers/tests/deepspeed/ds_config_zero3.json").read_text())
    zero = raw["zero_optimization"]
    zero["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": nvme_path,
        "pin_memory": True,
        "buffer_count": 4,
        "fast_init": False,
    }
    zero["offload_param"] = {
        "device": "nvme",
        "nvme_path": nvme_path,
        "pin_memory": True,
        "buffer_count": 5,
        "buffer_size": 1e8,
        "max_in_cpu": 1e9,
    }
    raw["aio"] = {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    model = corpus._make_model()
    config, kwargs = corpus._client("transformers/tests/deepspeed/ds_config_zero3.json", raw, model)
    eng, *_ = engine.initialize(model=model, config=config, **kwargs)
    before = eng.consolidated_state_dict()
    g = torch.Generator().manual_seed(7)
    for _ in range(3 * eng.gradient_accumulation_steps()):
        x, y = torch.randn(2, corpus.WIDTH, generator=g), torch.randn(2, corpus.WIDTH, generator=g)
        dtype = torch.bfloat16 if eng.bfloat16_enabled() else torch.float16 if eng.fp16_enabled() else torch.float32
        eng.backward(torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y))
        eng.step()
    after = eng.consolidated_state_dict()
    on_disk = eng.memory_report()["nvme"]
    eng.destroy()
    moved = max((float((after[k].float() - v.float()).abs().max()) for k, v in before.items()), default=None)
    return f"moved {moved}, {on_disk} bytes on disk"


def test_transformers_zero3_config_with_nvme_trains(tmp_path: Path) -> None:
    outcomes = run_distributed(_hf_zero3_on_nvme, 2, args=(str(tmp_path),))
    assert outcomes[0].startswith("moved ") and not outcomes[0].startswith("moved 0.0,"), outcomes
    assert int(outcomes[1].split(", ")[1].split()[0]) > 0, outcomes


def _report_and_estimate(nvme_path: str) -> list[dict[str, Any]]:
    ws = torch.distributed.get_world_size()
    rows = []
    for stage, bf16, params in (
        (1, True, False),
        (2, False, False),
        (3, True, False),
        (3, False, True),
        (3, True, True),
    ):
        model = make_model(3)
        estimate = engine.estimate_memory(
            model,
            stage=stage,
            world_size=ws,
            dtype="bf16" if bf16 else "fp32",
            optimizer="adamw",
            bucket_size=200,
            offload_optimizer="nvme",
            offload_param="nvme" if params else "none",
        )
        eng, *_ = engine.initialize(model=model, config=_config(stage, bf16, "nvme", nvme_path, True, params))
        _steps(eng, range(2), torch.bfloat16 if bf16 else torch.float32)
        report = eng.memory_report()
        eng.destroy()
        rows.append(
            {
                "case": (stage, bf16, params),
                "report": {k: report.get(k, 0) for k in ("params", "master", "gradients", "optimizer_state", "nvme")},
                "estimate": {
                    "params": estimate.params,
                    "master": estimate.master,
                    "gradients": estimate.gradients,
                    "optimizer_state": estimate.optimizer_state,
                    "nvme": estimate.disk,
                },
            }
        )
    return rows


def test_the_estimate_with_nvme_equals_memory_report(tmp_path: Path) -> None:
    for rank_rows in run_distributed(_report_and_estimate, 2, args=(str(tmp_path),)):
        for row in rank_rows:
            assert row["report"] == row["estimate"], row
            assert row["report"]["nvme"] > 0 and row["report"]["optimizer_state"] == 0, row
            assert (row["report"]["gradients"] == 0) == (row["case"][0] == 3), row


def _train_until_killed(nvme_path: str, save_dir: str) -> None:
    """A rank that saves a checkpoint after 2 steps, then trains until it is killed (mid-swap, likely)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=0, world_size=1)
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "nvme", nvme_path, True, True))
    _steps(eng, range(2), torch.float32)
    eng.save_checkpoint(save_dir, tag="before")
    Path(save_dir, "saved").write_text(str(eng._stage.offload.dir.path))
    _steps(eng, range(2), torch.float32)
    Path(save_dir, "training").touch()  # the parent kills it from here: swap reads and writes under way
    while True:
        _steps(eng, range(2), torch.float32)


def _resume_after_a_crash(nvme_path: str, save_dir: str, dead_folder: str) -> dict[str, Any]:
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "nvme", nvme_path, True, True))
    left = os.path.exists(dead_folder)  # the next start removed the killed run's swap folder
    eng.load_checkpoint(save_dir, tag="before")
    losses = _steps(eng, range(2, 4), torch.float32)
    eng.destroy()
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "cpu", nvme_path, True))
    eng.load_checkpoint(save_dir, tag="before")
    reference = _steps(eng, range(2, 4), torch.float32)  # the same checkpoint, resumed in memory
    eng.destroy()
    return {"left": left, "losses": losses, "reference": reference}


def test_a_rank_killed_mid_swap_leaves_the_checkpoint_loadable_and_its_files_are_cleaned(tmp_path: Path) -> None:
    import multiprocessing
    import signal
    import time

    from distributed import free_port

    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    ctx = multiprocessing.get_context("spawn")
    os.environ["PORT"] = str(free_port())
    child = ctx.Process(target=_train_until_killed, args=(str(tmp_path), str(save_dir)))
    child.start()
    deadline = time.monotonic() + 120
    while not (save_dir / "training").exists() and time.monotonic() < deadline and child.is_alive():
        time.sleep(0.05)
    assert (save_dir / "training").exists() and child.is_alive() and child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    dead = (save_dir / "saved").read_text()
    assert os.path.isdir(dead)  # a killed process removes nothing
    out = run_distributed(_resume_after_a_crash, 1, args=(str(tmp_path), str(save_dir), dead))[0]
    assert not out["left"], dead
    assert out["losses"] == out["reference"], out


def _behind_the_forward(save_dir: str, nvme_path: str, delay: float) -> dict[str, Any]:
    """Stage 3 with parameters on NVMe (each step run behind the next forward, its thread held back by
    `delay` seconds so that every reader finds it still running) and the in-memory offload, through the
    readers of a step's results: the next forward, an evaluation forward, a checkpoint's save (then
    loaded into a run without offload), two steps with no forward between them, and a learning rate
    the scheduler changes after every step."""
    out: dict[str, Any] = {}
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = global_batches(6, MICRO * GAS * ws)
    for device in ("nvme", "cpu"):
        config = _config(3, False, device, nvme_path, True, params=device == "nvme")
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}}
        eng, *_ = engine.initialize(model=make_model(3), config=config)
        swap = eng._stage.offload
        if swap is not None:
            run = swap._run

            def held_back(jobs: Any, written: Any, run: Any = run) -> None:
                time.sleep(delay)
                run(jobs, written)

            swap._run = held_back
        losses, evals = [], []
        for step in range(6):
            for k in range(GAS):
                x, y = rank_micro_batch(batches[step], rank, ws, MICRO, k)
                loss = torch.nn.functional.mse_loss(eng(x), y)
                eng.backward(loss)
                eng.step()
                losses.append(float(loss))
            if step == 1:
                with torch.no_grad():
                    evals.append(float(torch.nn.functional.mse_loss(eng(x), y)))
            if step == 2:
                eng.save_checkpoint(save_dir, tag=device)
            if step == 3:
                eng.step()  # a micro-step of nothing: the window's first gradients come from the next backward
        out[device] = {
            "losses": losses,
            "evals": evals,
            "lr": eng.get_lr(),
            "state": {k: v.float() for k, v in eng.consolidated_state_dict().items()},
            "behind": swap.steps_behind if swap is not None else 0,
        }
        eng.destroy()
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "none", nvme_path, True))
    eng.load_checkpoint(save_dir, tag="nvme")
    out["loaded"] = {k: v.float() for k, v in eng.consolidated_state_dict().items()}
    eng.destroy()
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "none", nvme_path, True))
    eng.load_checkpoint(save_dir, tag="cpu")
    out["loaded cpu"] = {k: v.float() for k, v in eng.consolidated_state_dict().items()}
    eng.destroy()
    return out


def test_the_step_behind_the_next_forward_is_waited_for_by_every_reader(tmp_path: Path) -> None:
    got = run_distributed(_behind_the_forward, 2, args=(str(tmp_path / "ckpt"), str(tmp_path), 0.3))[0]
    nvme, cpu = got["nvme"], got["cpu"]
    assert nvme["behind"] == 6 and cpu["behind"] == 0  # every NVMe step ran in its thread
    assert nvme["losses"] == cpu["losses"] and nvme["evals"] == cpu["evals"] and nvme["lr"] == cpu["lr"]
    for name, value in cpu["state"].items():
        assert torch.equal(nvme["state"][name], value), name
    for name, value in got["loaded cpu"].items():
        assert torch.equal(got["loaded"][name], value), name


def _step_fails_behind_the_forward(nvme_path: str) -> dict[str, str]:
    """Stage 3, parameters on NVMe: a moment file truncated by hand between steps makes the next step,
    which runs in its thread, fail; the next forward raises that error, and destroy still cleans up."""
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "nvme", nvme_path, True, params=True))
    _steps(eng, range(1), torch.float32)
    swap = eng._stage.offload
    swap.finish()
    os.truncate(next(iter(swap.by_master.values())).files["exp_avg"].path, 100)
    _steps(eng, range(1, 2), torch.float32)  # its step plans and starts; the thread finds the file cut
    try:
        _steps(eng, range(2, 3), torch.float32)
        raised = "no error"
    except Exception as err:  # noqa: BLE001 (the test reads the message of whatever was raised)
        raised = f"{type(err).__name__}: {err}"
    folder = swap.dir.path
    eng.destroy()
    return {"raised": raised, "left": str(os.path.exists(folder))}


def test_a_failed_step_behind_the_forward_is_raised_by_the_next_reader(tmp_path: Path) -> None:
    got = run_distributed(_step_fails_behind_the_forward, 1, args=(str(tmp_path),))[0]
    assert got["raised"].startswith("SwapFileError") and "exp_avg" in got["raised"], got
    assert "has 100 bytes, expected" in got["raised"], got
    assert got["left"] == "False", got


def _gathers_take_the_stepped_values(nvme_path: str) -> dict[str, Any]:
    """Stage 3, parameters on NVMe, the step not held back: it waits for the next forward's gathers to ask
    for each target, so it never writes one back before its gather asks (which would read it again)."""
    eng, *_ = engine.initialize(model=make_model(3), config=_config(3, False, "nvme", nvme_path, True, params=True))
    swap = eng._stage.offload
    _steps(eng, range(1), torch.float32)
    held = swap.held.wait(timeout=120)  # the step went as far as it may before anything reads it
    begun_before_the_forward = len(swap._begun)
    _steps(eng, range(1, 4), torch.float32)
    out = {"held": held, "begun": begun_before_the_forward, "handed": swap.handed, "reread": swap.reread}
    eng.destroy()
    return out


def test_the_step_behind_the_forward_hands_every_gather_its_values(tmp_path: Path) -> None:
    for got in run_distributed(_gathers_take_the_stepped_values, 2, args=(str(tmp_path),)):
        assert got["held"] and got["begun"] == 0, got
        assert got["handed"] > 0 and got["reread"] == 0, got


def _grad_transfers(nvme_path: str) -> dict[str, Any]:
    """Bytes of the stage-3 gradient files moved by aio over 2 steps (GAS 1), per direction, how many went
    through O_DIRECT, and the gradient bytes of a step; whether the folder takes O_DIRECT."""
    with aio_bytes("/grad.") as moved:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
        config = _config(3, False, "nvme", nvme_path, True) | {"gradient_accumulation_steps": 1}
        config["zero_optimization"]["sub_group_size"] = 4096
        eng, *_ = engine.initialize(model=model, config=config)
        grads = [g.shard_grad for u in eng._stage.units for g in u.trainable]
        direct = all(m.file.direct_fd >= 0 for m in eng._stage.offload.dir.mapped_files.values())
        for _ in range(2):
            eng.backward(eng(torch.randn(MICRO, 64)).square().mean())
            eng.step()
        eng.destroy()
    return {"moved": moved, "step bytes": sum(g.numel() * g.element_size() for g in grads), "direct": direct}


def test_stage_3_gradients_go_to_disk_and_back_past_the_page_cache(tmp_path: Path) -> None:
    """Each backward writes every shard gradient once and each step reads it once, with O_DIRECT (the
    reduction from a staging buffer, the step into its sub-group buffer): no page-cache page is touched
    ([Note: gradients past the page cache]); only a file's partial last 4 KiB block is buffered."""
    for got in run_distributed(_grad_transfers, 2, args=(str(tmp_path),)):
        moved, step_bytes = got["moved"], got["step bytes"]
        assert step_bytes > 16 * 4096 and moved["write"][0] == moved["read"][0] == 2 * step_bytes, got
        if got["direct"]:
            assert moved["write"][1] >= 0.9 * moved["write"][0] and moved["read"][1] >= 0.9 * moved["read"][0], got
        else:  # this file system refuses O_DIRECT (tmpfs): every transfer is buffered there
            assert moved["write"][1] == moved["read"][1] == 0, got
