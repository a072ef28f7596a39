"""engine.estimate: per-rank model-state bytes per ZeRO stage (the paper's Table 1, this engine's dtypes)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

import engine
from engine.estimate import MemoryEstimate, estimate_memory, format_table, main

ROOT = pathlib.Path(__file__).resolve().parents[1]

PSI = 7_500_000_000  # the paper's example: 7.5B parameters on 64-way data parallelism
N = 64


def test_paper_example_bf16_adam() -> None:
    # b = 2 (bf16), g = 2 (accumulate in bf16), m = 4 (fp32 master), s = 8 (Adam's two fp32 moments).
    b, g, m, s = 2, 2, 4, 8
    shard = PSI // N  # 117,187,500: divides exactly
    expected = {
        # bf16 accumulation: the fp32 gradient shard is a separate buffer (all of it at stage 0).
        0: (b * PSI, g * PSI + 4 * PSI, m * PSI, s * PSI),
        1: (b * PSI, g * PSI + 4 * shard, m * shard, s * shard),
        2: (b * PSI, 4 * shard, m * shard, s * shard),
        3: (b * shard, 4 * shard, m * shard, s * shard),
    }
    estimates = estimate_memory(PSI, world_size=N, dtype="bf16", optimizer="adam")
    assert [e.stage for e in estimates] == [0, 1, 2, 3]
    for e in estimates:
        assert (e.params, e.gradients, e.master, e.optimizer_state) == expected[e.stage]
        assert e.total == sum(expected[e.stage])
        assert (e.world_size, e.numel) == (N, PSI)
    # The paper's stage 0 is 16 Psi = 120 GB and its stage 1 4 Psi + 12 Psi / N = 31.4 GB; this engine
    # adds the fp32 gradient it reduces into (4 Psi at stage 0, 4 Psi / N at stage 1).
    assert estimates[0].params == 15_000_000_000
    assert estimates[0].total == 20 * PSI == 150_000_000_000
    assert estimates[1].total == 4 * PSI + 16 * shard
    # Our stage 2/3 gradients are an fp32 shard (4 Psi/N), not the paper's 2 Psi/N.
    assert estimates[2].total == 2 * PSI + 16 * shard
    assert estimates[3].total == 18 * shard


def test_single_stage_matches_list() -> None:
    everything = estimate_memory(PSI, world_size=N, dtype=torch.bfloat16, grad_accum_dtype="fp32")
    for stage in range(4):
        one = estimate_memory(PSI, stage=stage, world_size=N, dtype="bfloat16", grad_accum_dtype=torch.float32)
        assert isinstance(one, MemoryEstimate)
        assert one == everything[stage]
    # fp32 accumulation changes the full gradient buffer of stages 0-1 only.
    assert everything[0].gradients == everything[1].gradients == 4 * PSI
    assert everything[2].gradients == 4 * (PSI // N)


def test_fp32_has_no_master_copy() -> None:
    # In fp32 the optimizer updates the parameter shard in place: m = 0 at every stage.
    one = estimate_memory(PSI, stage=1, world_size=N, dtype="fp32")
    assert one.master == 0
    assert (one.params, one.gradients, one.optimizer_state) == (4 * PSI, 4 * PSI, 8 * (PSI // N))
    assert all(e.master == 0 for e in estimate_memory(PSI, world_size=N, dtype="float32"))


@pytest.mark.parametrize(
    ("optimizer", "state_bytes"),
    [("adam", 8), ("AdamW", 8), ("LAMB", 8), ("sgd", 4), ("Adagrad", 4), ("lion", 4)],
)
def test_optimizer_state_bytes(optimizer: str, state_bytes: int) -> None:
    assert estimate_memory(1000, stage=0, optimizer=optimizer).optimizer_state == state_bytes * 1000
    assert estimate_memory(1000, stage=1, world_size=4, optimizer=optimizer).optimizer_state == state_bytes * 250


def test_uneven_shards_round_up() -> None:
    e = estimate_memory(10, stage=3, world_size=4, dtype="fp16")
    assert (e.params, e.gradients, e.master, e.optimizer_state) == (2 * 3, 4 * 3, 4 * 3, 8 * 3)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)  # 800
        self.frozen = torch.nn.Linear(8, 8)  # 72, frozen below
        self.head = torch.nn.Linear(8, 100, bias=True)  # weight tied to embed; bias 100
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)


def test_module_counts_tied_once_and_skips_frozen() -> None:
    e = estimate_memory(_Tied(), stage=0)
    assert e.numel == 800 + 100
    assert e.params == 4 * 900


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'fp32'.*'bf16'.*'fp16'"):
        estimate_memory(10, dtype="fp8")
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        estimate_memory(10, grad_accum_dtype=torch.int8)
    with pytest.raises(ValueError, match="'adam'.*'sgd'.*'lion'"):
        estimate_memory(10, optimizer="rmsprop")
    with pytest.raises(ValueError, match="stage"):
        estimate_memory(10, stage=4)
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(10, world_size=0)
    with pytest.raises(ValueError, match=">= 0"):
        estimate_memory(-1)
    with pytest.raises(TypeError):
        estimate_memory(7.5e9)  # type: ignore[arg-type]


def test_format_table() -> None:
    table = format_table(estimate_memory(PSI, world_size=N, dtype="bf16"))
    assert "Psi = 7,500,000,000" in table and "N = 64" in table and "bf16" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4
    assert "139.70 GiB" in rows[0]  # 150e9 bytes
    assert "MiB" in rows[3]
    assert "bucket buffers" in table  # says what is excluded
    assert len(format_table(estimate_memory(PSI, stage=2, world_size=N)).splitlines()) == 7


def test_exported_from_package() -> None:
    assert engine.estimate_memory is estimate_memory
    assert "estimate_memory" in engine.__all__


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.estimate", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_prints_four_stages() -> None:
    proc = _cli("--params", "7.5e9", "--world-size", "64", "--dtype", "bf16", "--grad-accum-dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # notably no runpy double-import warning
    for label in ("0 (baseline)", "1 (P_os)", "2 (P_os+g)", "3 (P_os+g+p)"):
        assert f"| {label} |" in proc.stdout
    assert "N = 64" in proc.stdout


def test_cli_one_stage() -> None:
    proc = _cli("--params", "1.5B", "--world-size", "8", "--optimizer", "SGD", "--stage", "3")
    assert proc.returncode == 0, proc.stderr
    assert "| 3 (P_os+g+p) |" in proc.stdout and "| 0 (baseline) |" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7.5e9", "--dtype", "fp8"], "--dtype: invalid choice"),
        (["--params", "7.5e9", "--optimizer", "rmsprop"], "--optimizer: invalid choice"),
        (["--params", "lots"], "not a parameter count"),
        (["--params", "1e6", "--world-size", "0"], "--world-size"),
        (["--params", "1e6", "--stage", "4"], "--stage: invalid choice"),
    ],
)
def test_cli_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # In-process (argparse exits with status 2) to spare a torch import per case.
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
